"""A Llama layout (:mod:`workloads.llama.layout`) built on one device mesh with PyTorch's own APIs.

The mesh is ``init_device_mesh(device, (pp, dp_replicate, dp_shard, tp))``; on it:

1. **Pipeline** (``torch.distributed.pipelining``): this rank keeps its stage's layers (the others
   become :class:`~workloads.llama.model.SkippedLayer`, so parameter names stay the whole model's);
   the first stage keeps the embedding, the last the final norm and output head. A GPipe or 1F1B
   schedule runs the batch in ``pp_microbatches`` microbatches.
2. **Tensor parallelism** (``torch.distributed.tensor.parallel``, Megatron's plan): ``wq``/``wk``/``wv``
   and ``w1``/``w3`` column-wise, ``wo``/``w2`` row-wise, the embedding row-wise and the output head
   column-wise; with sequence parallelism the norms and the residual stream are split along the
   sequence, and the loss is computed on the vocabulary-sharded logits (``loss_parallel``).
3. **FSDP2** (``fully_shard``) per block and on the root, over ``dp_shard`` -- HSDP over
   ``dp_replicate × dp_shard`` when there are replicas.
4. **Mixture of experts** (:mod:`workloads.llama.expert_mesh`): the routed experts split over ``ep`` of the
   data-parallel ranks and their width over ``tp`` as DTensors on a second mesh that FSDP2 leaves alone, the
   token copies exchanged over the ``ep`` group.

Weights: a model of at most :data:`WHOLE_INIT_MAX_PARAMS` parameters is built whole on every rank from the
run's seed and each rank keeps its slice, so every layout starts from exactly the 1-rank model's weights
(which is what makes layouts comparable step for step). A larger one is initialised where each shard
lives (the same distributions, other draws).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from workloads.device import synchronize
from workloads.llama.args import ModelArgs, count_total_params
from workloads.llama.expert_mesh import (
    EXPERT_DIM_FAMILY,
    EXPERT_MESH_DIMS,
    build_expert_mesh,
    distribute_experts,
    parallelize_moe,
)
from workloads.llama.expert_parallel import AllToAllMeter
from workloads.llama.layout import MESH_DIMS, Layout, stage_layers
from workloads.llama.model import SkippedLayer, Transformer, build_model
from workloads.llama.moe import MoE, skew_routers

WHOLE_INIT_MAX_PARAMS = 1_000_000_000


@dataclass
class MeshModel:
    """This rank's part of the model and where it sits on the mesh."""

    model: nn.Module
    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    layout: Layout
    dp_rank: int  # which slice of the global batch this rank trains on
    pp_rank: int
    tp_rank: int
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets): cross-entropy
    schedule: object | None = None  # a torch.distributed.pipelining schedule (pp > 1)
    expert_mesh: object | None = None  # MoE: pp × edp × ep × tp (workloads/llama/expert_mesh.py)
    expert_params: list[nn.Parameter] = dataclasses.field(default_factory=list)  # MoE: the routed experts'
    a2a_meter: AllToAllMeter | None = None  # MoE: the ep all-to-alls' bytes and seconds

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def counts_samples(self) -> bool:
        """One rank per data-parallel slice reports the slice's samples (the harness sums over ranks)."""
        return self.pp_rank == 0 and self.tp_rank == 0

    def group(self, dim: str) -> dist.ProcessGroup | None:
        return self.mesh.get_group(dim) if getattr(self.layout, dim) > 1 else None


def build_mesh(layout: Layout, device: torch.device) -> object:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, tuple(layout.sizes().values()), mesh_dim_names=MESH_DIMS)


def split_stage(model: Transformer, pp: int, pp_rank: int) -> None:
    """Keep only stage ``pp_rank``'s part of ``model`` (in place)."""
    keep = stage_layers(len(model.layers), pp, pp_rank)
    for i in range(len(model.layers)):
        if i not in keep:
            model.layers[i] = SkippedLayer()
    if pp_rank > 0:
        model.tok_embeddings = None
    if pp_rank < pp - 1:
        model.norm = None
        model.output = None


def apply_tensor_parallel(model: Transformer, tp_mesh: object, sequence_parallel: bool) -> None:
    """Megatron's plan with PyTorch's tensor-parallel styles; this rank's logits come out vocabulary-sharded."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if model.output is not None:
        if sequence_parallel:
            top["norm"] = SequenceParallel()
        else:
            _replicate(model.norm, tp_mesh)
        top["output"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=True)
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers:
        if isinstance(block, SkippedLayer):
            continue
        moe = isinstance(block.feed_forward, MoE)
        plan: dict[str, object] = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=stream),
        }
        if not moe:
            plan.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                         "feed_forward.w2": RowwiseParallel(output_layouts=stream)})
        if not sequence_parallel:  # the norms' weights replicated as DTensors too: every parameter is a DTensor
            for norm in (block.attention_norm, block.ffn_norm):
                _replicate(norm, tp_mesh)
        else:
            plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(stream, None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
            })
            if not moe:
                plan["feed_forward"] = PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),))
        parallelize_module(block, tp_mesh, plan)
        if moe:
            parallelize_moe(block.feed_forward, tp_mesh, sequence_parallel)


def _replicate(module: nn.Module, mesh: object) -> None:
    """``module``'s parameters as replicated DTensors, its input and output plain (the same on every rank)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def to_dtensor(_module: nn.Module, inputs: tuple, device_mesh: object) -> tuple:
        return tuple(DTensor.from_local(x, device_mesh, [Replicate()], run_check=False) for x in inputs)

    distribute_module(module, mesh, input_fn=to_dtensor,
                      output_fn=lambda _module, output, _mesh: output.to_local())


def apply_fsdp(model: Transformer, dp_mesh: object, reshard_after_forward: bool,
               ignored: Iterable[nn.Parameter] = ()) -> None:
    """FSDP2 per block and on the root over ``dp_mesh``; ``ignored`` parameters (the routed experts, which differ
    between the dp ranks) stay as they are."""
    from torch.distributed.fsdp import fully_shard

    ignored = set(ignored)
    for block in model.layers:
        if not isinstance(block, SkippedLayer):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                        ignored_params=ignored & set(block.parameters()) or None)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored or None)


def apply_activation_checkpointing(model: Transformer) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.layers):
        if not isinstance(block, SkippedLayer):
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)


@torch.no_grad()
def copy_whole_weights(model: nn.Module, whole: Transformer) -> None:
    """Give each parameter (a DTensor or a plain tensor) its slice of ``whole``'s, and the buffers theirs."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    source = dict(whole.named_parameters())
    for name, param in model.named_parameters():
        full = source[name.replace("_checkpoint_wrapped_module.", "")]
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)
    buffers = dict(whole.named_buffers())
    for name, buffer in model.named_buffers():
        buffer.copy_(buffers[name.replace("_checkpoint_wrapped_module.", "")])


def build(args: ModelArgs, layout: Layout, device: torch.device, seed: int,
          router_init_skew: float = 0.0) -> MeshModel:
    """This rank's part of the model for ``layout``, weights and schedule included (a MoE's routers tilted by
    ``router_init_skew``, :func:`workloads.llama.moe.skew_routers`)."""
    mesh = build_mesh(layout, device)
    expert_mesh = build_expert_mesh(layout, device) if args.n_routed_experts else None
    coords = dict(zip(MESH_DIMS, mesh.get_coordinate(), strict=True))
    dp_rank = coords["dp_replicate"] * layout.dp_shard + coords["dp_shard"]
    loss_fn = vocab_parallel_cross_entropy(mesh["tp"]) if layout.tp > 1 else cross_entropy
    with torch.device("meta"):
        model = Transformer(args)
    if layout.pp > 1:
        split_stage(model, layout.pp, coords["pp"])
    if layout.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], layout.sequence_parallel)
    a2a_meter = AllToAllMeter(device) if expert_mesh is not None else None
    expert_params = distribute_experts(model, expert_mesh, a2a_meter) if expert_mesh is not None else []
    model.to_empty(device=device)
    if count_total_params(args) <= WHOLE_INIT_MAX_PARAMS:
        whole = build_model(args, device, seed)
        if router_init_skew:
            skew_routers(whole, router_init_skew, seed=seed)
        copy_whole_weights(model, whole)
    elif router_init_skew:
        raise ValueError(f"invalid config 'workload.router_init_skew': a model of more than {WHOLE_INIT_MAX_PARAMS} "
                         "parameters on a device mesh is initialised where it lives and its routers cannot be "
                         "tilted; set it to 0")
    else:  # initialised where it lives: DTensor draws follow the global seed
        torch.manual_seed(seed)
        model.init_weights(generator=None)
    if layout.activation_checkpointing:
        apply_activation_checkpointing(model)
    if layout.dp > 1:
        dp_mesh = mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
        # with a pipeline, each microbatch would gather the parameters again: keep them gathered for the step
        apply_fsdp(model, dp_mesh, reshard_after_forward=layout.pp == 1, ignored=expert_params)
    built = MeshModel(model, mesh, layout, dp_rank, coords["pp"], coords["tp"], loss_fn,
                      expert_mesh=expert_mesh, expert_params=expert_params, a2a_meter=a2a_meter)
    if layout.pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stage = PipelineStage(model, coords["pp"], layout.pp, device, group=mesh.get_group("pp"))
        schedule = ScheduleGPipe if layout.pp_schedule == "gpipe" else Schedule1F1B
        built.schedule = schedule(stage, n_microbatches=layout.pp_microbatches, loss_fn=loss_fn)
    return built


def vocab_parallel_cross_entropy(tp_mesh: object) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Mean cross-entropy of vocabulary-sharded logits (this rank's columns), computed without
    gathering them (``loss_parallel``: the caller runs the forward *and* backward inside that context)."""
    from torch.distributed.tensor import DTensor, Shard

    def loss(local_logits_bsv: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
        logits = DTensor.from_local(local_logits_bsv.float(), tp_mesh, [Shard(2)], run_check=False)
        out = F.cross_entropy(logits.flatten(0, 1), targets_bs.flatten())
        return out.full_tensor() if isinstance(out, DTensor) else out

    return loss


def cross_entropy(logits_bsv: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_bsv.float().flatten(0, 1), targets_bs.flatten())


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None) -> None:
    """Clip by the whole model's gradient norm: DTensor gradients' norms are reduced over their mesh,
    and the pipeline stages' squared norms summed."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        key = (p.grad.device_mesh, tuple(p.grad.placements)) if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p.grad)
    device = params[0].grad.device if params else torch.device("cpu")
    squared = torch.zeros((), device=device)
    for grads in groups.values():
        norm = nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = squared + norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(squared, group=pp_group)
    total = squared.sqrt()
    if not math.isfinite(max_norm):
        return
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # each shard scaled where it lives: the tensors may be plain and DTensors on several meshes at once
    for grads in groups.values():
        torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coef)


class CommMeter(TorchDispatchMode):
    """Time and bytes of each mesh dimension's collectives during one step, each collective made blocking.

    Every collective (``c10d`` ops as FSDP2 and the pipeline issue them, ``_c10d_functional`` ops as DTensor
    does) is waited for where it is issued, and its wall time (device synchronised) is charged to the mesh
    dimension whose process group ran it (a mixture of experts' all-to-alls, its token exchanges, to ``ep``).
    The step then has no overlap of communication with computation, so
    a dimension's time is what its communication costs when nothing hides it. The pipeline's sends and
    receives stay asynchronous; ``pp``'s time is how long the stage waits for them (the schedule's own waits,
    ``torch.distributed.pipelining``'s ``_wait_batch_p2p``): the bubble plus the transfers."""

    def __init__(self, mesh: object, layout: Layout, device: torch.device, expert_mesh: object | None = None) -> None:
        super().__init__()
        self.device = device
        self.dims = {mesh.get_group(dim).group_name: _dim_family(dim) for dim in MESH_DIMS
                     if getattr(layout, dim) > 1}
        # a MoE's all-to-alls are the token exchanges (ep), whatever group runs them: the expert mesh's ep group
        # may be the very group of a layout dim over the same ranks
        self.all_to_all_dim = "ep" if expert_mesh is not None and expert_mesh["ep"].size() > 1 else None
        if expert_mesh is not None:  # the expert mesh's other collectives: expert-gradient sums (dp), norms
            for dim in EXPERT_MESH_DIMS:
                if expert_mesh[dim].size() > 1:
                    self.dims.setdefault(expert_mesh.get_group(dim).group_name, EXPERT_DIM_FAMILY[dim])
        self.seconds: dict[str, float] = {}
        self.bytes: dict[str, int] = {}

    def _group_of(self, args: tuple) -> str | None:
        for arg in args:
            if isinstance(arg, str) and arg in self.dims:
                return self.dims[arg]
            if isinstance(arg, torch.ScriptObject):
                try:
                    name = dist.ProcessGroup.unbox(arg).group_name
                except (RuntimeError, TypeError):
                    continue
                if name in self.dims:
                    return self.dims[name]
        return None

    def __enter__(self) -> CommMeter:
        # the pipeline's sends and receives stay asynchronous (1F1B posts both sides before waiting: made
        # blocking, two stages would wait for each other); the time a stage waits for them is timed instead
        from torch.distributed.pipelining import schedules

        self._wait_p2p = getattr(schedules, "_wait_batch_p2p", None)
        if self._wait_p2p is not None:
            def timed_wait(work: list) -> None:
                start = time.perf_counter()
                self._wait_p2p(work)
                synchronize(self.device)
                self.seconds["pp"] = self.seconds.get("pp", 0.0) + time.perf_counter() - start

            schedules._wait_batch_p2p = timed_wait
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        from torch.distributed.pipelining import schedules

        if self._wait_p2p is not None:
            schedules._wait_batch_p2p = self._wait_p2p
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: object, types: tuple, args: tuple = (), kwargs: dict | None = None) -> object:
        if func.namespace not in ("c10d", "_c10d_functional") or "wait" in func.__name__ \
                or "wrap_tensor" in func.__name__:
            return func(*args, **(kwargs or {}))
        dim = self._group_of(args)
        if dim is not None and self.all_to_all_dim is not None and func.__name__.startswith("alltoall"):
            dim = self.all_to_all_dim
        if func.__name__.split(".")[0] in ("send", "recv_", "recv_any_source_"):
            out = func(*args, **(kwargs or {}))
            if dim is not None:
                self.bytes[dim] = self.bytes.get(dim, 0) + sum(t.numel() * t.element_size() for t in _tensors(args))
            return out
        synchronize(self.device)
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional":
            torch.ops._c10d_functional.wait_tensor(out)
        else:
            work = out[-1] if isinstance(out, tuple | list) else out
            if isinstance(work, torch.ScriptObject):
                torch._C._distributed_c10d.Work.unbox(work).wait()
        synchronize(self.device)
        if dim is not None:
            self.seconds[dim] = self.seconds.get(dim, 0.0) + time.perf_counter() - start
            # a collective's size: its whole (gathered, reduced or sent) tensor, the largest it touches
            self.bytes[dim] = self.bytes.get(dim, 0) + max((t.numel() * t.element_size() for t in _tensors(args)),
                                                           default=0)
        return out


def _dim_family(dim: str) -> str:
    return "dp" if dim.startswith("dp") else dim


def _tensors(args: tuple) -> list[torch.Tensor]:
    out = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            out.append(arg)
        elif isinstance(arg, list | tuple):
            out += [t for t in arg if isinstance(t, torch.Tensor)]
    return out


__all__ = ["WHOLE_INIT_MAX_PARAMS", "CommMeter", "MeshModel", "apply_fsdp", "apply_tensor_parallel", "build",
           "build_mesh", "clip_grad_norm", "copy_whole_weights", "cross_entropy", "split_stage",
           "vocab_parallel_cross_entropy"]
