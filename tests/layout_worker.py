"""Run by tests/test_parallel_layouts.py under torchrun (gloo, CPU): the llama workload's tiny preset (or
``--preset``) in each layout given (``tp=2,pp=2``, one argument per layout, run one after the other in the same
processes), 20 training steps through the workload's own ``step()``; prints one JSON line per layout: the global
loss per step, the largest step-1 gradient difference from a reference (``--reference FILE``, written by the
1-rank run with ``--write-reference FILE``), the eval loss, the samples and FLOPs of a step summed over the
ranks (as the harness sums them), the per-dimension communication figures, a MoE's expert-load figures, and
with ``--checkpoint DIR`` the eval loss of a fresh model that loaded (DCP) what the first layout saved."""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from harness.distributed import exit_rank
from workloads.base import RunContext
from workloads.llama.config import LlamaConfig
from workloads.llama.layout import ParallelConfig
from workloads.llama.workload import LlamaWorkload

STEPS = 20


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (DTensor shards gathered), by name."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        out[name.replace("_checkpoint_wrapped_module.", "")] = (grad.full_tensor() if isinstance(grad, DTensor)
                                                                else grad).detach().clone()
    return out


def make_workload(layout: str, opts: argparse.Namespace, ctx: RunContext) -> LlamaWorkload:
    values = {}
    for item in filter(None, layout.split(",")):
        key, value = item.split("=")
        values[key] = value if key == "pp_schedule" else int(value)
    # three layers: two pipeline stages hold 2 and 1 (the uneven split Llama 3 405B's 126 layers on 16 need)
    config = LlamaConfig(preset=opts.preset, n_layers=3, batch_size=8, seq_len=64, train_batches=opts.steps,
                         eval_batches=1, parallel=ParallelConfig(**values))
    workload = LlamaWorkload(config, ctx)
    workload.setup()
    return workload


def train(workload: LlamaWorkload, opts: argparse.Namespace, world: int) -> dict:
    grads: dict[str, torch.Tensor] = {}

    def record(*_) -> None:  # step 1's gradients, after clipping, before the update
        if not grads:
            grads.update(full_grads(workload.model))

    workload.optimizer.register_step_pre_hook(record)
    losses = []
    for _ in range(opts.steps):
        step = workload.step()
        loss = step.loss.detach().clone().float()
        if world > 1:  # each rank holds its data-parallel slice's loss: the mean over ranks is the global one
            dist.all_reduce(loss)
            loss /= world
        losses.append(float(loss))
    # what the harness sums over the ranks: one step's samples and FLOPs
    counted = torch.tensor([float(step.samples), workload.flops_per_step()], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(counted)
    # the most parameter bytes one rank holds (FSDP2's shards, tensor- and expert-parallel slices), as the planner
    # counts them
    from torch.distributed.tensor import DTensor

    held = torch.tensor(float(sum(4 * (p.to_local() if isinstance(p, DTensor) else p).numel()
                                  for p in workload.model.parameters())))
    if world > 1:
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
    metrics = workload.extra_metrics()
    result = {"losses": losses, "eval_loss": workload.evaluate()["eval_loss"], "layout": workload.layout.describe(),
              "samples_per_step": counted[0].item(), "flops_per_step": counted[1].item(),
              "param_bytes_max_rank": held.item(),
              "comm": {k: v for k, v in metrics.items() if "comm" in k or "bubble" in k},
              "expert_load": {k: v for k, v in metrics.items() if k in ("expert_load_max_over_mean", "tokens_dropped")}}
    if opts.write_reference:
        torch.save(grads, opts.write_reference)
    if opts.reference:
        reference = torch.load(opts.reference, weights_only=True)
        worst = torch.zeros(())
        for name, grad in grads.items():
            worst = torch.maximum(worst, (grad - reference[name]).abs().max())
        names = torch.tensor(len(grads))
        if world > 1:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        result["grad_max_err"] = float(worst)
        result["grad_tensors_this_rank"] = int(names)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layouts", nargs="*", help="layouts to run one after the other: 'tp=2,pp=2' ('' = defaults)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--reference")
    parser.add_argument("--write-reference")
    parser.add_argument("--checkpoint", help="the first layout saves its trained model here (DCP); every later "
                                             "one loads it into a fresh model and reports its eval loss")
    parser.add_argument("--steps", type=int, default=STEPS)
    opts = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    # the harness's warm-up: the second step is the one whose communication is measured per dimension
    ctx = RunContext(device=torch.device("cpu"), seed=0, rank=rank, world_size=world,
                     process_group=dist.group.WORLD if world > 1 else None, warmup_steps=2)
    for index, layout in enumerate(opts.layouts or [""]):
        workload = make_workload(layout, opts, ctx)
        result = train(workload, opts, world)
        if opts.checkpoint and index == 0:
            dcp.save(get_model_state_dict(workload.model), checkpoint_id=opts.checkpoint)
        workload.teardown()
        if opts.checkpoint and index > 0:
            fresh = make_workload(layout, opts, ctx)
            state = get_model_state_dict(fresh.model)
            dcp.load(state, checkpoint_id=opts.checkpoint)
            set_model_state_dict(fresh.model, state)
            result["loaded_eval_loss"] = fresh.evaluate()["eval_loss"]
            fresh.teardown()
        if rank == 0:
            print("RESULT " + json.dumps(result), flush=True)
    exit_rank(0)  # the group destroyed and the interpreter's teardown skipped: a gloo group can abort that teardown


if __name__ == "__main__":
    main()
