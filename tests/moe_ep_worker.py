"""Run by tests/test_moe.py under torchrun (and in-process for one rank): a few training steps of
the llama workload's tiny_moe preset; prints the global per-step losses and the MoE metrics as JSON."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from harness.distributed import exit_rank
from workloads.base import RunContext
from workloads.llama.config import LlamaConfig
from workloads.llama.workload import LlamaWorkload

STEPS = 6


def train(ctx: RunContext, **overrides) -> dict:
    config = LlamaConfig(preset="tiny_moe", batch_size=8, seq_len=64, train_batches=STEPS, eval_batches=1,
                         **overrides)
    workload = LlamaWorkload(config, ctx)
    workload.setup()
    losses = []
    for _ in range(STEPS):
        loss = workload.step().loss.detach().clone()
        if ctx.distributed:  # equal local batches: the global loss is the mean of the ranks'
            dist.all_reduce(loss, group=ctx.process_group)
            loss /= ctx.world_size
        losses.append(float(loss))
    workload.observe_step_times([1.0] * STEPS)
    result = {"losses": losses, "metrics": workload.extra_metrics(), "parallelism": workload.parallelism}
    workload.teardown()
    return result


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = RunContext(device=torch.device("cpu"), seed=0, rank=rank, world_size=world,
                     process_group=dist.group.WORLD)
    result = train(ctx)
    if rank == 0:
        with open(os.path.join(sys.argv[1], "result.json"), "w") as out:
            json.dump(result, out)
    exit_rank(0)  # the group destroyed and the interpreter's teardown skipped: a gloo group can abort that teardown


if __name__ == "__main__":
    main()
