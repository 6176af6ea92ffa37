"""Data-parallel degree: a captured single-process step predicted at ``world`` ranks.

What changes when the same global batch is spread over ``world`` data-parallel ranks (every cobench
workload's ``batch_size`` is global):

- each rank runs the captured step at ``batch_size / world`` — the batch edit of
  :func:`harness.whatif.predict.predict`, re-timed by the calibrated curves;
- ranks that share one host share its cores: a rank gets ``min(threads, cpu_count // world)`` intra-op
  threads (at least one), so its ops are re-timed by curves measured at that thread count (the
  platform edit, with this host's curves at the per-rank threads as the "target");
- DDP's gradient synchronisation — the reducer copying each gradient into its bucket, a bucket all-reduced
  as soon as its gradients are ready (the first, 1 MiB, while backward still runs), the step waiting for
  the last bucket, for the slower rank and for the collective's threads to wake after compute — is
  *measured* at ``world`` ranks on a skeleton of this rank's predicted step (:func:`sync_spec`, timed by
  :mod:`harness.whatif.sync_probe`: the gradients' shapes made at their predicted times between calibrated busy
  compute, with and without the real DDP). On this host that costs several times the collective alone
  (Llama tiny at 2 ranks: 3.0 ms a step, where its 657 KB all-reduced back to back take 0.4 ms).
  Without that timing (another platform, or asked for), the gradients are all-reduced in DDP's buckets
  after the backward pass, each from the collectives benchmark's sweep table (``cobench.collectives.sweep``,
  ``all_reduce`` at that world size, through a latency + bytes / bandwidth fit of its rows) when one is
  given, else from an *assumed* bus bandwidth and latency, which the result states.

DDP's buffer broadcast before every forward is not modelled: cobench's DDP wraps do not make it (Llama's
only buffers are constant RoPE tables; TorchRec's DDP wrapper passes ``broadcast_buffers=False``).

TorchRec's ``DistributedModelParallel`` (DLRM's and seqrec's tables) changes the program at more than one
rank in a way a single-rank capture cannot show: the tables are sharded, the KJT crosses ranks in input
all-to-alls, the looked-up embeddings in an output all-to-all and its backward, a fused optimizer updates the
shards, and every rank waits for the one whose shards are busiest. That stage is *measured*: the workload's
own sharded stage (:meth:`workloads.base.WorkloadBase.sharded_stage`) run alone at ``world`` ranks on the
target (:mod:`harness.whatif.stage_probe`, on the workload's per-rank batches and sharding plan — a component
benchmark, as TorchRec's sharded-module benchmarks are), and it replaces the stage's ops in the single-rank
graph (forward and backward by module scope, the in-backward optimizer by the tables' shapes). Without that
measurement the prediction says the stage is not modelled.

Not modelled: pipeline or tensor parallelism; the sharded stage overlapping dense work (a pipelined
``TrainPipelineSparseDist``: the stage is put on the critical path; in the skeleton its measured time sits
where its ops ran, as busy compute); with the table instead of the skeleton, anything of DDP's
synchronisation beyond the collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.whatif.costmodel import Calibration
from harness.whatif.graph import Graph, Op
from harness.whatif.predict import BATCH_KEY, Change, Prediction, predict, resolved_workload, workload_value

DDP_BUCKET_BYTES = 25 * 2**20
# the DDP settings of cobench's wraps: Llama's own (DDP's defaults) and TorchRec's DefaultDataParallelWrapper's
PLAIN_DDP = {"static_graph": False, "gradient_as_bucket_view": False, "bucket_cap_mb": 25}
TORCHREC_DDP = {"static_graph": True, "gradient_as_bucket_view": True, "bucket_cap_mb": 25}
STAGE_RUN_GAP_MS = 0.2  # the sharded stage's ops closer than this in the step are one stretch of it (one sync point)
_DTYPE_BY_SIZE = {8: "float64", 4: "float32", 2: "bfloat16"}  # a trace's tensors carry their element size
ASSUMED_BUSBW_GBPS = 1.0  # stated when no sweep table is given: a loopback gloo ring on one host, order of magnitude
ASSUMED_LATENCY_US = 50.0
# what a prediction at more than one rank says of a sharded workload whose stage was not measured there
NOT_MODELLED_STAGE = ("TorchRec's DistributedModelParallel shards the embedding tables at more than one rank "
                      "(sharded lookups, input and output all-to-alls, their host work); the single-rank capture "
                      "runs them unsharded and no timing of the sharded stage at this world size was given, so "
                      "this prediction models only the dense part's DDP: expect a large error")


@dataclass
class ShardedStageCost:
    """The sharded stage's measured time per step at ``world`` ranks (:class:`harness.whatif.stage_probe.StageTiming`'s
    record) and the module it replaces in the graph."""

    world: int
    module: str
    ms: float
    source: str  # the timing's file
    timing: dict[str, Any]

    @classmethod
    def from_timing(cls, record: dict[str, Any], source: str) -> ShardedStageCost:
        try:
            return cls(int(record["world_size"]), str(record["module"]), float(record["ms_p50"]), source, record)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{source}: not a sharded-stage timing (made by `torchrun -m "
                             f"harness.whatif.stage_probe`): {err!r}") from err


@dataclass
class GradientSyncCost:
    """What DDP's gradient synchronisation adds to a step at ``world`` ranks, measured on the skeleton of
    the predicted step (:class:`harness.whatif.sync_probe.SyncTiming`'s record, launches pooled)."""

    world: int
    ms: float
    source: str
    timing: dict[str, Any]

    @classmethod
    def from_timing(cls, record: dict[str, Any], source: str) -> GradientSyncCost:
        if isinstance(record, dict) and "sync_ms" in record and "job_ddp_ms_p50" not in record:
            raise ValueError(f"{source}: a gradient-sync timing of each rank's own median (an earlier cobench); the "
                             "prediction is of the job's step (the slowest rank's at each step): time it again with "
                             "`torchrun -m harness.whatif.sync_probe`")
        try:
            return cls(int(record["world_size"]), float(record["sync_ms"]), source, record)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{source}: not a gradient-sync timing (made by `torchrun -m harness.whatif.sync_probe`): "
                             f"{err!r}") from err

    def check(self, spec: dict[str, Any]) -> None:
        """Refuse a timing of another skeleton than ``spec`` (other gradients, another world size)."""
        mine = (len(spec["gradients"]), spec_bytes(spec), int(spec["world_size"]))
        theirs = (self.timing.get("gradients"), self.timing.get("gradient_bytes"), self.world)
        if mine != theirs:
            raise ValueError(f"{self.source}: timed for {theirs[0]} gradients of {theirs[1]} bytes at {theirs[2]} "
                             f"ranks; this prediction's step has {mine[0]} of {mine[1]} bytes at {mine[2]}: time the "
                             "skeleton this prediction writes (`torchrun -m harness.whatif.sync_probe "
                             "PREDICTION.json`)")


def sync_spec(graph: Graph, local: Prediction, world: int, threads: int, replaced: frozenset[int] = frozenset(),
              stage_ms: float = 0.0, layers: int | None = None, sharded: bool = False) -> dict[str, Any]:
    """The skeleton of one rank's predicted step that :func:`harness.whatif.sync_probe.time_gradient_sync` times: the
    gradients DDP reduces (shape, dtype) in the order backward makes them, each at the time the edited step
    makes it (``local``'s op ends), and the step's length. The sharded stage's ops (``replaced``, timed apart:
    ``stage_ms``) are put back where they ran, in proportion to their captured time. ``layers``: a layer-count
    change (``layers`` of the captured count), whose new layers' gradients are made with the captured ones.
    ``collectives_ms``: where each stretch of the stage begins (its all-to-alls make the ranks wait for each
    other there, with or without DDP)."""
    stage_us = sum(op.dur_us for op in graph.ops if op.id in replaced)
    captured = local.inputs["captured"].get("layers")
    before, gradients, ready, collectives = 0.0, [], [], []
    at, last_stage_end = 0.0, None
    reduced = {op.id for op in ddp_gradients(graph, replaced)}
    for op in graph.ops:
        start = at  # where the op starts in the edited step (the previous op's end), the stage put back
        if op.id in replaced:
            if last_stage_end is None or start - last_stage_end > STAGE_RUN_GAP_MS:
                collectives.append(start)  # a stretch of the stage begins: its all-to-alls keep the ranks in step
            before += op.dur_us
        at = local.end_ms[op.id] + (stage_ms * before / stage_us if stage_us else 0.0)
        if op.id in replaced:
            last_stage_end = at
        if op.id not in reduced:
            continue
        grad = op.inputs[0]
        copies = 1
        if layers is not None and captured and op.layer is not None:  # new layer j is captured layer j mod n
            copies = len(range(op.layer[1], layers, captured))
        for _ in range(copies):
            gradients.append([list(grad.shape), _DTYPE_BY_SIZE.get(grad.itemsize, "float32")])
            ready.append(at)
    return {"world_size": world, "threads_per_rank": threads, "step_ms": local.predicted_step_ms + stage_ms,
            "gradients": gradients, "ready_ms": ready, "collectives_ms": collectives,
            "ddp": TORCHREC_DDP if sharded else PLAIN_DDP, "workload": graph.workload}


def spec_bytes(spec: dict[str, Any]) -> int:
    sizes = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
    return sum(math.prod(shape) * sizes.get(dtype, 4) for shape, dtype in spec["gradients"])


def stage_ops(graph: Graph, module: str) -> frozenset[int]:
    """The sharded stage's ops in a single-rank graph: every op of ``module`` or a module under it (backward
    ops through their forward op), and the gradient accumulation and in-backward optimizer updates of the
    stage's parameters (ops under an ``AccumulateGrad`` scope reading a persistent tensor of a table's
    shape: the tables are the persistent tensors the stage's forward reads)."""
    inside = {op.id for op in graph.ops if op.module and (op.module == module or op.module.startswith(module + "."))}
    tables = {u.shape for op in graph.ops if op.id in inside and not op.backward for u in op.inputs if u.persistent}
    updates = {op.id for op in graph.ops if any("AccumulateGrad" in s for s in op.scopes)
               and any(u.persistent and u.shape in tables for u in op.inputs)}
    return frozenset(inside | updates)


def gradient_bytes(graph: Graph, without: frozenset[int] = frozenset()) -> int:
    """Bytes of the gradients the autograd engine accumulates in a step (one per dense parameter):
    what DDP all-reduces (:func:`ddp_gradients`)."""
    return sum(math.prod(op.inputs[0].shape) * op.inputs[0].itemsize for op in ddp_gradients(graph, without))


@dataclass
class AllReduceCost:
    """Time of one all-reduce of ``n`` bytes at a world size: ``latency_us + n / bandwidth`` (Hockney's α–β
    model), fitted to a sweep table's measured rows, or assumed."""

    world: int
    source: str  # the table's path, or "assumed"
    sizes: list[float]
    times_us: list[float]
    busbw_gbps: float | None = None
    latency_us: float | None = None

    def __post_init__(self) -> None:
        self._alpha_us, self._us_per_byte = fit_latency_bandwidth(self.sizes, self.times_us) if self.sizes \
            else (0.0, 0.0)

    def at(self, nbytes: float) -> float:
        if self.world <= 1 or nbytes <= 0:
            return 0.0
        if not self.sizes:
            moved = 2.0 * (self.world - 1) / self.world * nbytes  # a ring's bus traffic per rank
            return (self.latency_us or 0.0) + moved / ((self.busbw_gbps or 1.0) * 1e3)
        return self._alpha_us + self._us_per_byte * nbytes

    def describe(self) -> dict[str, Any]:
        if self.sizes:
            fitted = [self._alpha_us + self._us_per_byte * n for n in self.sizes]
            residuals = [100.0 * (f / t - 1.0) for f, t in zip(fitted, self.times_us, strict=True)]
            return {"source": self.source, "world_size": self.world, "points": len(self.sizes),
                    "fit": "latency + bytes / bandwidth, least squares in relative error over the table's p50s",
                    "latency_us": self._alpha_us,
                    "algbw_gbps": 1e-3 / self._us_per_byte if self._us_per_byte else None,
                    "fit_residual_pct": [min(residuals), max(residuals)]}
        return {"source": "assumed", "world_size": self.world, "busbw_gbps": self.busbw_gbps,
                "latency_us": self.latency_us}


def fit_latency_bandwidth(sizes: list[float], times_us: list[float]) -> tuple[float, float]:
    """(α µs, β µs per byte) minimising Σ ((α + β·n_i) / t_i − 1)²: every size weighs alike, whatever its time.
    A sweep's points are single p50s, each of which a shared host can throw off (a 16 KB all-reduce measured
    slower than a 256 KB one); the fit rides over such a point where interpolating between neighbours would
    follow it. α and β are kept non-negative (a one-point table: all latency)."""
    if len(sizes) == 1:
        return times_us[0], 0.0
    # normal equations of the linear least squares [1/t, n/t] · (α, β) ≈ 1
    a11 = sum(1 / t**2 for t in times_us)
    a12 = sum(n / t**2 for n, t in zip(sizes, times_us, strict=True))
    a22 = sum(n * n / t**2 for n, t in zip(sizes, times_us, strict=True))
    b1 = sum(1 / t for t in times_us)
    b2 = sum(n / t for n, t in zip(sizes, times_us, strict=True))
    det = a11 * a22 - a12 * a12
    alpha, beta = (a22 * b1 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det
    if beta < 0:  # no growth with size: all latency
        return b1 / a11, 0.0
    if alpha < 0:  # no fixed cost: all bandwidth
        return 0.0, b2 / a22
    return alpha, beta


def allreduce_cost(world: int, table: Path | None, busbw_gbps: float = ASSUMED_BUSBW_GBPS,
                   latency_us: float = ASSUMED_LATENCY_US) -> AllReduceCost:
    """All-reduce times at ``world`` ranks from a sweep table (its ``all_reduce`` rows at that world size),
    else the stated assumption. A table without such rows is refused, naming it and what it has."""
    if table is None:
        return AllReduceCost(world, "assumed", [], [], busbw_gbps, latency_us)
    from workloads.collectives.table import read_sweep_table

    rows = read_sweep_table(table)
    mine = sorted((r for r in rows if r.collective == "all_reduce" and r.world_size == world), key=lambda r: r.bytes)
    if not mine:
        have = sorted({(r.collective, r.world_size) for r in rows})
        raise ValueError(f"{table}: no all_reduce rows at world size {world} (it has {have}); measure them with "
                         f"`torchrun --nproc-per-node {world} -m suite.cli run workload=collectives "
                         "workload.collective=all_reduce`")
    return AllReduceCost(world, str(table), [float(r.bytes) for r in mine], [float(r.time_us_p50) for r in mine])


def threads_per_rank(graph: Graph, world: int) -> tuple[int, int]:
    """(captured intra-op threads, threads a rank gets when ``world`` ranks share the capture's host)."""
    threads = int(graph.platform.get("num_threads") or 1)
    cores = int(graph.platform.get("cpu_count") or threads)
    return threads, max(1, min(threads, cores // world))


def bucket_sizes(nbytes: int) -> list[int]:
    """DDP's gradient buckets for ``nbytes`` of gradients (full ones, then the rest)."""
    full, rest = divmod(nbytes, DDP_BUCKET_BYTES)
    return [DDP_BUCKET_BYTES] * full + ([rest] if rest else [])


def rank_change(graph: Graph, world: int, change: Change, rank_calibration: Calibration | None) -> Change:
    """What one of ``world`` data-parallel ranks runs: ``change`` with the global batch split, on the
    per-rank curves. A capture of several ranks, or a batch the ranks cannot share, is refused."""
    captured_world = int(graph.platform.get("world_size") or 1)
    if captured_world != 1:
        raise ValueError(f"the capture ran {captured_world} ranks: a data-parallel change starts from a "
                         "single-rank capture (capture with one process)")
    batch = workload_value(resolved_workload(graph), BATCH_KEY)
    if batch is None:
        raise ValueError(f"the capture's config has no workload.{BATCH_KEY}: a data-parallel change cannot "
                         "split the batch")
    global_batch = change.batch_size or batch
    if global_batch % world:
        raise ValueError(f"workload.{BATCH_KEY}={global_batch} is not divisible by world_size={world}: "
                         f"use a multiple of {world}")
    return Change(layers=change.layers, batch_size=global_batch // world if world > 1 else change.batch_size,
                  seq_len=change.seq_len, calibration=change.calibration or rank_calibration)


def predict_data_parallel(graph: Graph, world: int, calibration: Calibration, change: Change | None = None,
                          rank_calibration: Calibration | None = None,
                          allreduce: AllReduceCost | None = None, stage: ShardedStageCost | None = None,
                          sharded: bool = False, sync: GradientSyncCost | None = None) -> Prediction:
    """``graph``'s step at ``world`` data-parallel ranks (with ``change``'s other edits, its batch the
    global one). ``rank_calibration``: curves at the threads a rank gets (None: as captured). ``sharded``:
    the workload has a TorchRec sharded stage; ``stage``: its time measured at ``world`` ranks, which
    replaces the stage's ops (None: the prediction says the stage is not modelled). ``sync``: DDP's gradient
    synchronisation measured on this prediction's skeleton (``inputs.data_parallel.sync_spec``); None: the
    gradients' all-reduce from ``allreduce`` after backward."""
    change = change or Change()
    if stage is not None and stage.world != world:
        raise ValueError(f"{stage.source}: the sharded stage was timed at {stage.world} ranks, not {world}")
    replaced = stage_ops(graph, stage.module) if stage is not None and world > 1 else frozenset()
    if stage is not None and world > 1 and not replaced:
        raise ValueError(f"{stage.source}: the capture has no ops of module {stage.module!r} (a timing of another "
                         "workload?)")
    local = predict(graph, rank_change(graph, world, change, rank_calibration), calibration, replaced)
    allreduce = allreduce or allreduce_cost(world, None)
    grads = gradient_bytes(graph, replaced)
    if change.layers is not None and local.inputs["captured"].get("layers"):
        # the layers' gradients grow with them (their share of the accumulated gradients)
        share = _layer_gradient_share(graph)
        grads = round(grads * ((1 - share) + share * change.layers / local.inputs["captured"]["layers"]))
    buckets = bucket_sizes(grads)
    stage_ms = stage.ms if replaced else 0.0
    threads, rank_threads = threads_per_rank(graph, world)
    spec = sync_spec(graph, local, world, rank_threads, replaced, stage_ms, change.layers, sharded) \
        if world > 1 else None
    if sync is not None and world > 1:
        sync.check(spec)
        comm_ms = sync.ms
    else:
        comm_ms = sum(allreduce.at(b) for b in buckets) / 1e3 if world > 1 else 0.0
    breakdown = dict(local.breakdown_ms)
    breakdown["communication"] = breakdown.get("communication", 0.0) + comm_ms
    if replaced:
        breakdown["sharded_stage"] = stage_ms
    global_batch = change.batch_size or local.inputs["captured"]["batch_size"]
    inputs = dict(local.inputs)
    inputs["data_parallel"] = {"world_size": world, "global_batch_size": global_batch,
                               "batch_per_rank": global_batch // world, "threads_captured": threads,
                               "threads_per_rank": rank_threads, "gradient_bytes": grads,
                               "buckets": len(buckets), "allreduce": allreduce.describe()}
    if sync is not None and world > 1:
        inputs["data_parallel"] |= {
            "gradient_sync_ms": comm_ms, "gradient_sync": {
                "source": sync.source, "how": "DDP on a skeleton of this step (its gradients at their predicted "
                                              "times between calibrated compute) minus the skeleton without DDP, "
                                              f"at {world} ranks", "timing": sync.timing}}
    else:
        inputs["data_parallel"] |= {"allreduce_ms": comm_ms,
                                    "overlap": "none assumed: the all-reduce follows the backward pass",
                                    "not_modelled_sync": "DDP's synchronisation beyond the collective (the reducer, "
                                                         "waiting for the slower rank and the collective's threads)"}
    if spec is not None:
        inputs["data_parallel"]["sync_spec"] = spec
    if replaced:
        inputs["data_parallel"]["sharded_stage"] = {
            "source": stage.source, "module": stage.module, "measured_ms": stage_ms, "ops_replaced": len(replaced),
            "timing": stage.timing, "overlap": "none assumed: the stage is on the critical path"}
    elif world > 1 and sharded:
        inputs["data_parallel"]["not_modelled"] = NOT_MODELLED_STAGE
    return Prediction(local.predicted_step_ms + comm_ms + stage_ms, local.unchanged_step_ms,
                      local.measured_step_ms, local.naive_step_ms, breakdown, inputs, local.replay_reference_ms,
                      local.end_ms)


def _layer_gradient_share(graph: Graph) -> float:
    held = {"layers": 0, "rest": 0}
    for op in ddp_gradients(graph):
        held["layers" if op.layer is not None else "rest"] += math.prod(op.inputs[0].shape)
    total = held["layers"] + held["rest"]
    return held["layers"] / total if total else 0.0


def _accumulates(op: Op) -> bool:
    """The op that hands a parameter its gradient (first accumulation: detach; later ones: add_/copy_) — not
    an optimizer's own work run inside the accumulation (an in-backward optimizer's step counter, its weight
    decay)."""
    return bool(op.inputs) and op.name in ("aten::detach", "aten::add_", "aten::copy_") \
        and any("AccumulateGrad" in s for s in op.scopes) and not any("Optimizer.step" in s for s in op.scopes)


def ddp_gradients(graph: Graph, without: frozenset[int] = frozenset()) -> list:
    """The accumulations of the gradients DDP all-reduces, in the order backward makes them: every parameter's
    but those an optimizer updates inside backward (TorchRec's fused tables: DDP leaves them out) and those of
    the ops ``without`` names (a sharded stage's)."""
    in_backward = {u.shape for op in graph.ops if any("AccumulateGrad" in s for s in op.scopes)
                   and any("Optimizer.step" in s for s in op.scopes) for u in op.inputs if u.persistent and u.shape}
    return [op for op in graph.ops
            if _accumulates(op) and op.id not in without and op.inputs[0].shape not in in_backward]
