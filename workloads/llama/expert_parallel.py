"""Expert parallelism: each rank holds ``n_experts / world`` experts, and every MoE layer sends the
routed token copies to the rank of their expert and back with ``all_to_all_single`` (variable
splits; gloo on CPU, nccl on CUDA), metered like DLRM's embedding all-to-all.

Per MoE layer and step there are three exchanges forward (the per-expert counts, the tokens out,
the results back) and two backward (the gradients of the two token exchanges, reversed). The
dense part of the model stays data-parallel (DDP over the non-expert parameters).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from workloads.llama.moe import ExpertDispatcher, GroupedExperts, moe_layers


@dataclass
class AllToAllMeter:
    """Bytes this rank sent to *other* ranks and wall time inside ``all_to_all_single`` (the
    collectives here are blocking, so on CPU that is the time the step spends in them; on
    accelerators the device is synchronised around each call, which adds its own cost)."""

    device: torch.device
    calls: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int] | None,
                   input_splits: list[int] | None, group: dist.ProcessGroup | None) -> None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        rows = input_splits if input_splits is not None else [input.shape[0] // world] * world
        row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
        self.bytes_sent += (sum(rows) - rows[rank]) * row_bytes
        self._sync()
        start = time.perf_counter()
        dist.all_to_all_single(output, input, output_splits, input_splits, group=group)
        self._sync()
        self.seconds += time.perf_counter() - start
        self.calls += 1

    def _sync(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)


class _TokenAllToAll(torch.autograd.Function):
    """``all_to_all_single`` whose backward sends the gradients back the way the tokens came."""

    @staticmethod
    def forward(ctx: Any, x_nd: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup | None, meter: AllToAllMeter) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.meter = (output_splits, input_splits), group, meter
        out_md = x_nd.new_empty((sum(output_splits), *x_nd.shape[1:]))
        meter.all_to_all(out_md, x_nd.contiguous(), output_splits, input_splits, group)
        return out_md

    @staticmethod
    def backward(ctx: Any, grad_md: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        output_splits, input_splits = ctx.splits
        grad_nd = grad_md.new_empty((sum(input_splits), *grad_md.shape[1:]))
        ctx.meter.all_to_all(grad_nd, grad_md.contiguous(), input_splits, output_splits, ctx.group)
        return grad_nd, None, None, None, None


class AllToAllDispatcher(ExpertDispatcher):
    """Sends each expert's token copies to the rank that holds it (experts ``r*L .. r*L+L-1`` on
    rank ``r``), runs the local experts on what arrives, and returns the results."""

    def __init__(self, group: dist.ProcessGroup | None, meter: AllToAllMeter) -> None:
        self.group, self.meter = group, meter
        self.world = dist.get_world_size(group)

    def __call__(self, routed_nd: torch.Tensor, tokens_per_expert_x: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        local = tokens_per_expert_x.numel() // self.world
        send_counts_wl = tokens_per_expert_x.view(self.world, local).contiguous()
        recv_counts_wl = torch.empty_like(send_counts_wl)
        self.meter.all_to_all(recv_counts_wl, send_counts_wl, None, None, self.group)
        input_splits = send_counts_wl.sum(dim=1).tolist()
        output_splits = recv_counts_wl.sum(dim=1).tolist()
        received_md = _TokenAllToAll.apply(routed_nd, output_splits, input_splits, self.group, self.meter)
        # copies arrive grouped by source rank, then by expert: regroup them by local expert
        local_expert_m = torch.repeat_interleave(
            torch.arange(local, device=routed_nd.device).repeat(self.world), recv_counts_wl.flatten()
        )
        order_m = torch.argsort(local_expert_m, stable=True)
        out_md = experts(received_md[order_m], recv_counts_wl.sum(dim=0))
        out_md = out_md[torch.argsort(order_m)]  # back to arrival order
        return _TokenAllToAll.apply(out_md, input_splits, output_splits, self.group, self.meter)


def shard_experts(model: nn.Module, group: dist.ProcessGroup | None, meter: AllToAllMeter) -> list[str]:
    """Keep this rank's slice of every MoE layer's experts and route through ``group``.

    Every rank must have built the same full model (same seed), so expert ``e`` here is expert
    ``e`` of a single-process run. Returns the names of the now rank-local expert parameters,
    which data parallelism must leave alone.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for layer in moe_layers(model):
        if layer.n_experts % world:
            raise ValueError(
                f"invalid config 'workload': expert parallelism over {world} ranks needs the expert count "
                f"({layer.n_experts}) to be a multiple of the world size; change the rank count or set "
                "workload.expert_parallel=false"
            )
        local = layer.n_experts // world
        experts = layer.experts
        for name in ("w1", "w3", "w2"):
            full = getattr(experts, name)
            setattr(experts, name, nn.Parameter(full.detach()[rank * local:(rank + 1) * local].clone()))
        layer.dispatcher = AllToAllDispatcher(group, meter)
    return [name for name, _ in model.named_parameters() if ".experts." in name]


__all__ = ["AllToAllMeter", "AllToAllDispatcher", "shard_experts"]
