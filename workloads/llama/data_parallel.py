"""Llama data-parallel over all ranks without a device mesh (``workload.parallelism``).

:func:`wrap_data_parallel` wraps the whole model in DDP or shards it with FSDP2, or, under expert parallelism,
wraps it in DDP that leaves the rank-local experts alone; :func:`clip_gradients` clips by the norm of the whole
model's gradient, which under expert parallelism is summed over the ranks' experts.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from workloads.base import RunContext


def wrap_data_parallel(model: nn.Module, parallelism: str, ctx: RunContext, expert_param_names: list[str]) -> nn.Module:
    """``model`` as ``parallelism`` (none, ddp, ep+ddp or fsdp2) trains it; ``expert_param_names``: the rank-local
    experts' parameters (ep+ddp)."""
    if parallelism == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [ctx.device.index] if ctx.is_accelerator else None
        # no buffer broadcast before every forward (DDP's default): MoE's expert counters are each rank's
        # own (see ep+ddp below), and the dense model's only buffers are the constant RoPE tables
        # (rope_cos, rope_sin), whose broadcast is a collective per step that changes nothing (3.9 ms of a
        # 2-rank CPU step here) and that TorchRec's DDP wrapper (DLRM, seqrec) does not make either
        return DistributedDataParallel(model, device_ids=device_ids, process_group=ctx.process_group,
                                       forward_sync_buffers=False)
    if parallelism == "ep+ddp":
        from torch.nn.parallel import DistributedDataParallel

        # the rank-local experts are not replicas: DDP must not average them
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_param_names)
        device_ids = [ctx.device.index] if ctx.is_accelerator else None
        # buffers are synced once at start, then stay per rank: the expert counters differ by
        # design, and the bias moves alike everywhere (it follows the all-reduced loads)
        return DistributedDataParallel(model, device_ids=device_ids, process_group=ctx.process_group,
                                       forward_sync_buffers=False)
    if parallelism == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    return model


def clip_gradients(model: nn.Module, raw_model: nn.Module, expert_param_names: list[str], max_norm: float,
                   ctx: RunContext) -> None:
    """Clip to ``max_norm`` by the norm of the *whole* model's gradient: under expert
    parallelism (``expert_param_names`` not empty) each rank holds only its experts' gradients, so their
    squared norms are summed over the ranks. The experts' gradients are also averaged like DDP's: each is
    the sum of every rank's contribution (they arrive through the all-to-all's backward). ``model`` is the
    wrapped model, ``raw_model`` the one inside it."""
    if not expert_param_names:
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return
    named = dict(raw_model.named_parameters())
    experts = [named[name] for name in expert_param_names if named[name].grad is not None]
    for param in experts:
        param.grad.div_(ctx.world_size)
    dense = [p for name, p in named.items() if name not in set(expert_param_names) and p.grad is not None]
    dense_sq = nn.utils.get_total_norm([p.grad for p in dense]) ** 2
    expert_sq = nn.utils.get_total_norm([p.grad for p in experts]) ** 2
    dist.all_reduce(expert_sq, group=ctx.process_group)
    total = (dense_sq + expert_sq).sqrt()
    nn.utils.clip_grads_with_norm_(dense + experts, max_norm, total)
