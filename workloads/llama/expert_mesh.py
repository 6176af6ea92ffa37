"""A mixture of experts on the device mesh: the routed experts split over ``ep`` data-parallel ranks, each
expert's hidden width over ``tp``, the rest of the MoE layer tensor-parallel like a dense feed-forward.

The design, the simplest found that trains exactly like one rank:

- **An expert mesh** beside the layout's: ``init_device_mesh(device, (pp, dp / ep, ep, tp))``, dims ``pp edp
  ep tp``, over the same ranks in the same order (a rank's data-parallel index ``dp_replicate × dp_shard +
  dp_shard`` is ``edp × ep + ep``). ``ep`` groups ranks that see different tokens and hold different experts;
  ``edp`` groups ranks that hold the same experts.
- **Expert weights are DTensors on ``edp × ep × tp``**: ``w1``/``w3`` ``(Replicate, Shard(0), Shard(2))``
  (experts over ep, the hidden width column-wise over tp), ``w2`` ``(Replicate, Shard(0), Shard(1))``
  (row-wise). DCP saves and loads them like any DTensor, so a checkpoint moves between layouts, and the
  gradient clip reduces their norm over their mesh. FSDP2 leaves them out (``ignored_params``): its dp mesh
  mixes ranks that hold different experts.
- **Token copies travel over the ``ep`` group** through the flat expert parallelism's
  :class:`~workloads.llama.expert_parallel.AllToAllDispatcher` and its meter.
- **The MoE layer computes on local tensors** (:func:`workloads.llama.moe.local_tensor`). Its input is made
  whole on every tp rank (all-gathered from the sequence-parallel stream) and its gradient declared
  ``Partial`` (Megatron's *f*); its output, the routed experts' and the shared expert's row-wise products, is
  a ``Partial`` sum reduced to the residual stream's layout (Megatron's *g*: a reduce-scatter, or an
  all-reduce without sequence parallelism). Both are DTensor redistributions in the layer's forward hooks.
  The router (replicated) and the shared expert (column- then row-wise) are DTensors on the tp mesh, sharded
  over dp by FSDP2 with the rest of the block; a replicated weight's gradient is ``Partial`` over tp, and
  FSDP2 (or :func:`finish_grads` without FSDP2) reduces it to the weight's placement.
- **Expert gradients**: an expert's local gradient already sums what its ep peers' tokens contributed (the
  all-to-all's backward brings them back); :func:`finish_grads` redistributes it to the parameter's placement
  (a sum over ``edp``) and divides by dp, which gives one rank's gradient of the global mean loss, as FSDP2's
  averaged dense gradients do.
- **Load balance**: the routed copies are counted over the data-parallel groups before the bias update, so
  every rank moves the same bias (:func:`workloads.llama.moe.update_expert_bias`).

Why not FSDP2 over ``edp`` for the experts (torchtitan's choice)? Its shards and ep's would both cut the
experts' dim 0 once ``edp × ep`` exceeds the expert count, which DCP cannot describe as one box per rank;
replicating the experts over ``edp`` costs memory only where ``ep < dp``, and the planner
(:mod:`workloads.llama.footprint`) counts it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from workloads.llama.expert_parallel import AllToAllDispatcher, AllToAllMeter
from workloads.llama.layout import Layout
from workloads.llama.moe import MoE, moe_layers

EXPERT_MESH_DIMS = ("pp", "edp", "ep", "tp")  # outermost first, as the layout's mesh
# the layout's mesh dimension family each expert-mesh dimension's collectives are charged to
EXPERT_DIM_FAMILY = {"pp": "pp", "edp": "dp", "ep": "ep", "tp": "tp"}


def build_expert_mesh(layout: Layout, device: torch.device) -> object:
    """The ``pp × edp × ep × tp`` mesh over the layout's ranks (``edp = dp / ep``)."""
    from torch.distributed.device_mesh import init_device_mesh

    sizes = (layout.pp, layout.dp // layout.ep, layout.ep, layout.tp)
    return init_device_mesh(device.type, sizes, mesh_dim_names=EXPERT_MESH_DIMS)


def distribute_experts(model: nn.Module, expert_mesh: object, meter: AllToAllMeter) -> list[nn.Parameter]:
    """Turn every MoE layer's routed expert weights into DTensors on ``edp × ep × tp`` (this rank keeps its
    experts' slice of the hidden width) and route the layer's tokens over the ``ep`` group when it has more
    than one rank. Run on the meta model; returns the expert parameters."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = expert_mesh["edp", "ep", "tp"]
    params = []
    for layer in moe_layers(model):
        for name, width_dim in (("w1", 2), ("w3", 2), ("w2", 1)):
            weight = getattr(layer.experts, name)
            sharded = distribute_tensor(weight.data, mesh, [Replicate(), Shard(0), Shard(width_dim)],
                                        src_data_rank=None)
            param = nn.Parameter(sharded, requires_grad=weight.requires_grad)
            layer.experts.register_parameter(name, param)
            params.append(param)
        if expert_mesh["ep"].size() > 1:
            layer.dispatcher = AllToAllDispatcher(expert_mesh.get_group("ep"), meter)
    return params


def parallelize_moe(layer: MoE, tp_mesh: object, sequence_parallel: bool) -> None:
    """Tensor parallelism for one MoE layer (the routed experts are sharded by :func:`distribute_experts`): the
    router replicated and the shared expert column- then row-wise as DTensors on ``tp_mesh``, the layer's input
    made whole on every tp rank and its ``Partial`` output reduced to the residual stream's layout."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    stream = Shard(1) if sequence_parallel else Replicate()
    placements: list[tuple[nn.Module, object]] = [(layer.router, Replicate())]
    if layer.shared_expert is not None:
        shared = layer.shared_expert
        placements += [(shared.gate_proj, Shard(0)), (shared.up_proj, Shard(0)), (shared.down_proj, Shard(1))]
    for linear, placement in placements:
        weight = distribute_tensor(linear.weight.data, tp_mesh, [placement], src_data_rank=None)
        linear.register_parameter("weight", nn.Parameter(weight, requires_grad=linear.weight.requires_grad))

    def whole_input(_layer: nn.Module, inputs: tuple) -> tuple:
        (x_bsd,) = inputs
        if not isinstance(x_bsd, DTensor):
            x_bsd = DTensor.from_local(x_bsd, tp_mesh, [stream], run_check=False)
        # every tp rank's gradient of the input is its part of the sum (f)
        return (x_bsd.redistribute(tp_mesh, [Replicate()]).to_local(grad_placements=[Partial()]),)

    def reduced_output(_layer: nn.Module, _inputs: tuple, out_bsd: torch.Tensor) -> torch.Tensor:
        partial = DTensor.from_local(out_bsd, tp_mesh, [Partial()], run_check=False)
        return partial.redistribute(tp_mesh, [stream]).to_local()  # (g)

    layer.register_forward_pre_hook(whole_input)
    layer.register_forward_hook(reduced_output)


@torch.no_grad()
def finish_grads(model: nn.Module, expert_params: Iterable[nn.Parameter], dp: int) -> None:
    """After the backward: the experts' gradients divided by ``dp`` (each sums every data-parallel rank's
    contribution to its own mean loss), then every DTensor gradient that is still ``Partial`` -- the experts'
    over ``edp``, replicated weights' over tp where FSDP2 did not already reduce them -- redistributed to its
    parameter's placement (a sum over the mesh dims where it was partial)."""
    from torch.distributed.tensor import DTensor

    for param in expert_params:
        if param.grad is not None:
            param.grad.to_local().div_(dp)
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def data_parallel_groups(mesh: object, layout: Layout) -> list:
    """The process groups of the layout's data-parallel dims larger than one (the ranks that see other tokens)."""
    return [mesh.get_group(dim) for dim in ("dp_shard", "dp_replicate") if getattr(layout, dim) > 1]


__all__ = ["EXPERT_DIM_FAMILY", "EXPERT_MESH_DIMS", "build_expert_mesh", "data_parallel_groups",
           "distribute_experts", "finish_grads", "parallelize_moe"]
