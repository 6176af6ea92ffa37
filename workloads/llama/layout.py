"""How the Llama workload's ranks are laid out: ``workload.parallel`` and the checks on it.

A layout names five sizes whose product (without ``ep``) is the world size, the order of the dims on
the device mesh being ``pp × dp_replicate × dp_shard × tp`` (the innermost, ``tp``, the one that talks
most, on neighbouring ranks -- the GPUs of one node):

- ``tp``: tensor parallelism (Megatron): attention heads and feed-forward columns split over ``tp``
  ranks, the norms sequence-parallel;
- ``pp``: pipeline parallelism: the layers split into ``pp`` stages as evenly as they go (where ``pp`` does
  not divide them, the last and first stages, which also hold the output head and the token embedding,
  get one layer fewer: :func:`stage_layers`), each batch cut into microbatches run by a GPipe or 1F1B
  schedule;
- ``dp_shard``: FSDP2 shards parameters, gradients and optimizer state over these ranks;
- ``dp_replicate``: replicas of a sharded group (HSDP when ``dp_shard > 1``, plain replication when 1);
- ``ep`` (MoE only): the routed experts split over ``ep`` of the data-parallel ranks (each expert's width also
  over ``tp``: :mod:`workloads.llama.expert_mesh`); a MoE is not split into pipeline stages.

:func:`resolve_layout` checks a layout against the model, the batch and the world size before any
process group exists, so a layout that cannot work exits 2 naming its numbers. Both the workload
(:mod:`workloads.llama.parallel`, which builds it) and the layout planner use it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from workloads.base import invalid_config
from workloads.llama.args import ModelArgs

PP_SCHEDULES = ("gpipe", "1f1b")
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost first


@dataclass
class ParallelConfig:
    """``workload.parallel``. All sizes 1 (the default): every rank holds the whole model, and
    ``workload.parallelism`` (DDP or FSDP2 over all ranks) and ``workload.expert_parallel`` decide."""

    dp_replicate: int = 1  # data-parallel replicas, each a whole FSDP group (HSDP with dp_shard > 1)
    dp_shard: int = -1  # FSDP2 shards over these ranks; -1: the ranks the other dims leave
    tp: int = 1  # tensor parallel: heads and feed-forward columns split, norms sequence-parallel
    pp: int = 1  # pipeline stages: the layers split as evenly as they go (see stage_layers)
    ep: int = 1  # MoE: routed experts split over this many data-parallel ranks
    pp_schedule: str = "1f1b"  # gpipe | 1f1b (torch.distributed.pipelining)
    pp_microbatches: int | None = None  # microbatches per step and pipeline; None: 2 * pp
    sequence_parallel: bool = True  # with tp: norms and residual stream split along the sequence
    activation_checkpointing: bool = False  # recompute each block's activations in the backward


@dataclass(frozen=True)
class Layout:
    """A checked layout: every size resolved (``dp_shard`` filled in)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 1
    sequence_parallel: bool = True
    activation_checkpointing: bool = False

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def on_mesh(self) -> bool:
        """True when the layout needs the device mesh (tensor, pipeline or replicated-shard parallelism)."""
        return self.tp > 1 or self.pp > 1 or self.dp_replicate > 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits on the mesh (ranks fill it row-major, as ``init_device_mesh`` lays them out)."""
        coords = {}
        for dim in reversed(MESH_DIMS):
            size = getattr(self, dim)
            coords[dim], rank = rank % size, rank // size
        return {dim: coords[dim] for dim in MESH_DIMS}

    def dp_rank(self, rank: int) -> int:
        """The slice of the global batch ``rank`` trains on."""
        coords = self.coordinates(rank)
        return coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]

    def sizes(self) -> dict[str, int]:
        return {dim: getattr(self, dim) for dim in MESH_DIMS}

    def describe(self) -> str:
        """``dp_shard 2 × tp 2``: the dims larger than 1 (``1 rank`` when none is)."""
        dims = [f"{dim} {size}" for dim, size in self.sizes().items() if size > 1]
        if self.ep > 1:
            dims.append(f"ep {self.ep}")
        return " × ".join(dims) or "1 rank"


def _product(sizes: dict[str, int]) -> str:
    return " × ".join(f"{dim} {size}" for dim, size in sizes.items())


def resolve_layout(parallel: ParallelConfig, world_size: int, args: ModelArgs, batch_size: int, seq_len: int,
                   grad_accum_steps: int = 1) -> Layout:
    """Check ``parallel`` against the world size, the model and the batch; raise ``ValueError``
    (``invalid config 'workload.parallel...'``) naming the numbers that do not fit."""
    key = "parallel"
    for dim in ("dp_replicate", "tp", "pp", "ep"):
        if getattr(parallel, dim) < 1:
            raise invalid_config(f"{key}.{dim}", f"got {getattr(parallel, dim)}, must be >= 1")
    if parallel.dp_shard < 1 and parallel.dp_shard != -1:
        raise invalid_config(f"{key}.dp_shard", f"got {parallel.dp_shard}, must be >= 1 (or -1: the ranks left)")
    if parallel.pp_schedule not in PP_SCHEDULES:
        raise invalid_config(f"{key}.pp_schedule",
                             f"got {parallel.pp_schedule!r}, allowed values: {', '.join(PP_SCHEDULES)}")
    others = parallel.dp_replicate * parallel.tp * parallel.pp
    dp_shard = parallel.dp_shard
    if dp_shard == -1:
        if world_size % others:
            raise invalid_config(key, f"dp_replicate {parallel.dp_replicate} × tp {parallel.tp} × pp {parallel.pp} "
                                      f"= {others} does not divide the world size {world_size}")
        dp_shard = world_size // others
    sizes = {"pp": parallel.pp, "dp_replicate": parallel.dp_replicate, "dp_shard": dp_shard, "tp": parallel.tp}
    if others * dp_shard != world_size:
        raise invalid_config(key, f"{_product(sizes)} = {others * dp_shard} ranks, but the world size is "
                                  f"{world_size}; make the product equal it (dp_shard=-1 takes the ranks left)")
    microbatches = parallel.pp_microbatches if parallel.pp_microbatches is not None else 2 * parallel.pp
    layout = Layout(parallel.dp_replicate, dp_shard, parallel.tp, parallel.pp, parallel.ep, parallel.pp_schedule,
                    microbatches if parallel.pp > 1 else 1, parallel.sequence_parallel,
                    parallel.activation_checkpointing)
    check_model_fits(layout, args, batch_size, seq_len, grad_accum_steps)
    return layout


@functools.cache
def stage_layers(n_layers: int, pp: int, stage: int) -> range:
    """The layers pipeline stage ``stage`` of ``pp`` holds: ``ceil(n_layers / pp)`` each, except that where ``pp``
    does not divide ``n_layers`` the stages at the ends, the last first (it also holds the output head and the
    loss, the first the token embedding), hold one fewer -- Llama 3 405B's 126 layers on 16 stages: 7, then
    fourteen of 8, then 7."""
    if not 0 <= stage < pp <= n_layers:
        raise ValueError(f"stage {stage} of {pp}: needs 0 <= stage < pp <= n_layers ({n_layers})")
    per = -(-n_layers // pp)
    short = per * pp - n_layers  # stages holding per - 1 layers, taken from the ends inwards
    ends = [i // 2 if i % 2 else pp - 1 - i // 2 for i in range(short)]  # last, first, second last, ...
    sizes = [per - (s in ends) for s in range(pp)]
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])


@functools.cache
def stage_of_layer(n_layers: int, pp: int) -> tuple[int, ...]:
    """Each layer's pipeline stage (:func:`stage_layers`), by layer index."""
    return tuple(stage for stage in range(pp) for _ in stage_layers(n_layers, pp, stage))


def check_model_fits(layout: Layout, args: ModelArgs, batch_size: int, seq_len: int,
                     grad_accum_steps: int = 1) -> None:
    """The divisibility a layout needs from the model and the batch (``ValueError`` naming the numbers)."""
    key = "parallel"
    tp, pp = layout.tp, layout.pp
    if tp > 1:
        for name, value in (("n_heads", args.n_heads), ("n_kv_heads", args.kv_heads),
                            ("the feed-forward width", args.hidden_dim), ("vocab_size", args.vocab_size)):
            if value % tp:
                raise invalid_config(f"{key}.tp", f"{name} {value} is not divisible by tp {tp}: tensor parallelism "
                                                  f"splits it evenly over the tp ranks")
        if args.n_routed_experts and args.moe_hidden_dim % tp:
            raise invalid_config(f"{key}.tp", f"the experts' width {args.moe_hidden_dim} is not divisible by tp {tp}")
        if layout.sequence_parallel and seq_len % tp:
            raise invalid_config(f"{key}.tp", f"seq_len {seq_len} is not divisible by tp {tp} (sequence parallelism "
                                              f"splits the sequence); change seq_len or set "
                                              f"workload.parallel.sequence_parallel=false")
    if pp > 1:
        if args.n_routed_experts:
            raise invalid_config(f"{key}.pp", f"pp {pp} with a mixture of experts: its layers are not split into "
                                              "pipeline stages; use pp = 1 (ep, tp, dp_shard and dp_replicate "
                                              "combine with it)")
        if args.n_layers < pp:
            raise invalid_config(f"{key}.pp", f"{args.n_layers} layers cannot be split into {pp} stages: each stage "
                                              f"needs at least one layer (use pp <= {args.n_layers})")
        if layout.pp_microbatches < pp:
            raise invalid_config(f"{key}.pp_microbatches",
                                 f"{layout.pp_microbatches} microbatches for {pp} stages: a pipeline needs at least "
                                 f"one microbatch per stage (use >= {pp}; more shrinks the bubble)")
        if grad_accum_steps != 1:
            raise invalid_config("grad_accum_steps", f"got {grad_accum_steps}: with pp > 1 the pipeline's "
                                                     "microbatches accumulate the gradients (pp_microbatches)")
    if batch_size % layout.dp:
        raise invalid_config("batch_size", f"{batch_size} sequences cannot be split over {layout.dp} data-parallel "
                                           f"ranks (dp_replicate {layout.dp_replicate} × dp_shard {layout.dp_shard})")
    local = batch_size // layout.dp
    if pp > 1 and local % layout.pp_microbatches:
        raise invalid_config(f"{key}.pp_microbatches", f"the data-parallel rank's batch of {local} sequences is not "
                                                       f"divisible into {layout.pp_microbatches} microbatches")
    if layout.ep > 1:
        if not args.n_routed_experts:
            raise invalid_config(f"{key}.ep", f"got {layout.ep}, but preset's model has no experts (ep is for MoE)")
        if args.n_routed_experts % layout.ep:
            raise invalid_config(f"{key}.ep", f"{args.n_routed_experts} experts cannot be split evenly over ep "
                                              f"{layout.ep} ranks; use an ep that divides {args.n_routed_experts}")
        if layout.dp % layout.ep:
            raise invalid_config(f"{key}.ep", f"ep {layout.ep} must divide the data-parallel ranks "
                                              f"({layout.dp}): the experts are split over ranks that see "
                                              "different tokens")


__all__ = ["MESH_DIMS", "PP_SCHEDULES", "Layout", "ParallelConfig", "check_model_fits", "resolve_layout"]
