"""What-if prediction: a captured step's graph, edited for a new configuration, replayed by the scheduler.

Edits (all applied to the graph of :mod:`.graph`, none runs the model):

- ``n_layers`` (and the other workloads' repeated-layer counts): the layers' ops — forward by module
  scope, backward by their forward op, per-parameter optimizer work by parameter share — are cloned
  (on one host thread: their time and host gaps counted ``new / old`` times);
- ``batch_size`` / ``seq_len``: every tensor that does not live across steps has its leading dimension
  equal to the captured batch×sequence, batch or sequence rescaled; each op is re-timed by the
  calibrated curve (:mod:`.costmodel`) at its new FLOPs (GEMM, attention) or bytes (the rest), relative
  to the curve at its captured size; parameters, optimizer state and host gaps stay — a jagged batch's
  length buckets (seqrec) are costed on the batches the run trains on instead (:mod:`.jagged`);
- ``calibration``: another platform's curves: every op re-timed by the ratio of the target's curve to
  this platform's at the same size.

Naive linear scaling (the step × the factor of the change) is returned beside every prediction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from harness.whatif.costmodel import Calibration, Curve
from harness.whatif.graph import Graph, Op, TensorUse, schedule
from harness.whatif.jagged import jagged_edit

# the config key of each workload's repeated layers, and of batch and sequence length
LAYER_KEYS = {"llama": "n_layers", "seqrec": "num_layers", "dlrm": "dcn_num_layers"}
BATCH_KEY, SEQ_KEYS = "batch_size", ("seq_len", "max_len")
FLOP_CATEGORIES = ("gemm", "attention")
FIXED_CATEGORIES = ("view",)
# an op at a size where the curve's work above its fixed cost is below this share of that cost is in the
# curve's flat region: how the curve's work grows from there is noise (a 0.04 µs difference scaled a
# 5 µs pad 14x), so such an op goes by the curves' ratio
FLAT = 0.5


@dataclass
class Change:
    """What to predict for: a new value per supported key (``None``: as captured)."""

    layers: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    calibration: Calibration | None = None

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in (("layers", self.layers), ("batch_size", self.batch_size),
                                  ("seq_len", self.seq_len)) if v is not None} | \
            ({"calibration": self.calibration.platform} if self.calibration else {})


@dataclass
class Prediction:
    predicted_step_ms: float
    unchanged_step_ms: float  # the graph replayed as captured
    measured_step_ms: float  # the capture's plain step
    naive_step_ms: float  # measured step × the change's factor
    breakdown_ms: dict[str, float]
    inputs: dict[str, Any] = field(default_factory=dict)
    replay_reference_ms: float | None = None  # what the unchanged replay is judged against (Graph's)
    end_ms: dict[int, float] = field(default_factory=dict)  # each op's end in the edited step (by op id)

    def to_json(self) -> dict[str, Any]:
        against = self.replay_reference_ms or self.measured_step_ms
        return {"predicted_step_ms": self.predicted_step_ms, "unchanged_step_ms": self.unchanged_step_ms,
                "measured_step_ms": self.measured_step_ms, "replay_reference_ms": against,
                "unchanged_error_pct": 100.0 * (self.unchanged_step_ms / against - 1.0),
                "naive_step_ms": self.naive_step_ms, "breakdown_ms": self.breakdown_ms, "inputs": self.inputs}


def resolved_workload(graph: Graph) -> dict[str, Any]:
    """The captured workload's config with what its preset decided filled in (a workload config with a
    ``shape()`` — DLRM's, seqrec's — resolves batch, layers and lengths there)."""
    import dataclasses

    raw = dict(graph.config.get("workload") or {})
    config = graph.workload_config()
    try:
        shape = config.shape() if hasattr(config, "shape") else None
    except Exception:  # noqa: BLE001 - a config this version cannot read: the raw values are what there is
        return raw
    if shape is not None and dataclasses.is_dataclass(shape):
        raw.update({k: v for k, v in dataclasses.asdict(shape).items() if v is not None and raw.get(k) is None})
    return raw


def workload_value(values: dict[str, Any], *keys: str) -> int | None:
    """The first of ``keys`` whose value in ``values`` (a workload config) is an integer; None if none is."""
    for key in keys:
        if isinstance(values.get(key), int):
            return int(values[key])
    return None


def _token_dim(graph: Graph) -> int | None:
    """The leading dimension of the first embedding lookup's output: the tokens (or samples) of the step,
    which for jagged sequences is neither batch nor batch × length."""
    for op in graph.ops:
        if op.category == "embedding" and not op.backward and op.outputs and op.outputs[0].shape:
            return op.outputs[0].shape[0]
    return None


@dataclass(frozen=True)
class Resize:
    """How a batch/sequence change resizes the step's tensors (:func:`dimension_factors`).

    ``factors``: a captured dimension size → its factor (batch × sequence, batch, sequence, the step's
    token count; factor 1 for those that stay). ``batch``: the batch factor alone. ``fixed_shapes``: the
    shapes of tensors that live across steps (parameters, optimizer state): a tensor the step makes in
    such a shape (a gradient) does not follow the batch."""

    factors: dict[int, float] = field(default_factory=dict)
    batch: float = 1.0
    fixed_shapes: frozenset[tuple[int, ...]] = frozenset()
    combined: tuple[int, ...] = ()  # the sizes that carry batch and sequence at once (tokens, B·S)
    single: tuple[int, ...] = ()  # the batch and the sequence sizes

    def __bool__(self) -> bool:
        return bool(self.factors)


def _rescaled(use: TensorUse, resize: Resize) -> TensorUse:
    """A tensor the step made, resized: the first dimension equal to the step's tokens or batch × sequence
    scaled by both factors; else the first equal to the batch and the first equal to the sequence, each
    by its own (never a second dimension of the same size: seqrec's batch of 32 is also its width).

    Under a batch change, a tensor the step made whose leading dimension is of no known size — a jagged
    batch's length bucket (``[histories in the bucket, heads, longest, d]``), rows of Σ(length − 1)
    targets, a chunk of a loop over the tokens — has that dimension scaled by the batch factor instead:
    how many histories fall into a bucket, how many targets or chunks there are, grows with the batch in
    expectation, unless the tensor is in a parameter's shape or transposed (a gradient, ``W.t()``). A
    known size wins over a parameter's shape (tiny Llama's 512 tokens of width 64 are the shape of its
    512 × 64 embedding table: the activations are what matters).
    Tensors that live across steps (parameters, optimizer state) stay."""
    if use.persistent:
        return use
    factors = resize.factors
    shape = list(use.shape)
    if resize.batch != 1.0 and shape and shape[0] > 1 and shape[0] not in factors:
        if use.shape in resize.fixed_shapes:  # a gradient, W.t(): not data
            return use
        # the data's own leading dimension, of no known size: the batch goes there (not to a later
        # dimension that happens to equal it)
        shape[0] = round(shape[0] * resize.batch)
        return TensorUse(tuple(shape), use.itemsize, use.persistent)
    found = 0
    for sizes, at_most in ((resize.combined, 1), (resize.single, 2)):  # B·S (or the tokens) covers B and S
        for size in sorted(sizes, reverse=True):
            if size in shape and found < at_most:
                shape[shape.index(size)] = round(size * factors[size])
                found += 1
        if found:
            break
    return TensorUse(tuple(shape), use.itemsize, use.persistent)


def _flops(op: Op, inputs: list[TensorUse]) -> float:
    """FLOPs of a GEMM-like op from its input shapes: ``A[..., M, K] @ B[..., K, N]`` → 2·|A|·N (addmm's
    bias first: its last two operands); attention ``q[..., S, E]``, ``k[..., S_k, E]`` → 4·|q|·S_k."""
    mats = [u for u in inputs if len(u.shape) >= 2]
    if op.category == "attention" and len(mats) >= 2:
        return 4.0 * math.prod(mats[0].shape) * mats[1].shape[-2]
    if len(mats) >= 2:
        a, b = mats[-2], mats[-1]
        return 2.0 * math.prod(a.shape) * b.shape[-1]
    return float(sum(math.prod(u.shape) for u in inputs))


def _bytes(uses: list[TensorUse]) -> float:
    return float(sum(math.prod(u.shape) * u.itemsize for u in uses))


def retimed(op: Op, resize: Resize, here: Calibration, there: Calibration | None) -> float:
    """``op``'s time with its tensors resized by ``resize`` (and on ``there``'s platform when
    given); an op of a fixed category, or without tensors, keeps its captured time."""
    if op.category in FIXED_CATEGORIES or not (op.inputs or op.outputs):
        return op.dur_us
    old = [*op.inputs, *op.outputs]
    new = [_rescaled(u, resize) for u in old]
    batch_factor = resize.batch
    if op.category == "embedding" and batch_factor != 1.0:
        # a lookup's index lists and pooled rows follow the batch whatever their length (multi-hot)
        new = [u if u.persistent or not u.shape or u.shape[0] != v.shape[0] else
               TensorUse((round(u.shape[0] * batch_factor), *u.shape[1:]), u.itemsize, u.persistent)
               for u, v in zip(new, old, strict=True)]
    return retimed_at(op, new[:len(op.inputs)], new[len(op.inputs):], here, there)


def retimed_at(op: Op, inputs: list[TensorUse], outputs: list[TensorUse], here: Calibration,
               there: Calibration | None) -> float:
    """``op``'s time with these input and output shapes (and on ``there``'s platform when given)."""
    if op.category in FIXED_CATEGORIES or not (op.inputs or op.outputs):
        return op.dur_us
    target = there or here
    if op.category in FLOP_CATEGORIES:
        before, after = _flops(op, op.inputs), _flops(op, inputs)
        curve_here, curve_there = here.gemm, target.gemm
    else:
        before, after = _bytes([*op.inputs, *op.outputs]), _bytes([*inputs, *outputs])
        curve_here, curve_there = here.memory, target.memory
        if op.category == "embedding":
            # a lookup (and its backward) works per looked-up row, linearly — TorchRec's planner costs a shard's
            # lookups the same way, bytes of rows over bandwidth. What resizes is the ids, offsets, rows and
            # their gradients; the table, or the table-shaped gradient a dense backward fills, is touched only
            # at those rows. (DLRM tiny, 2x batch: the backward took 2.03x; the bytes of all its tensors, the
            # 5000-row gradient included, grew 1.1x, and the streaming add's curve 1.2x over the rows' bytes.)
            moved = [(a, b) for a, b in zip([*op.inputs, *op.outputs], [*inputs, *outputs], strict=True)
                     if a.shape != b.shape]
            if moved:
                rows_before, rows_after = _bytes([a for a, _ in moved]), _bytes([b for _, b in moved])
                if rows_before > 0:
                    fixed = min(op.dur_us, here.memory.times_us[0])
                    platform = target.memory.at(after) / here.memory.at(after) if there is not None else 1.0
                    return (fixed + (op.dur_us - fixed) * rows_after / rows_before) * platform
    if before <= 0 or after <= 0:
        return op.dur_us
    return _scaled(op.dur_us, curve_here, curve_there, before, after)


def _scaled(dur_us: float, here: Curve, there: Curve, before: float, after: float) -> float:
    """An op's time at a new size (and platform): its fixed cost — the curve's smallest point, what any
    call costs — plus its work, scaled as the curve's own work above that fixed cost scales.

    An op in the curve's flat region (work above the fixed cost under :data:`FLAT` of it at the op's size)
    goes by the ratio of the curves. Without the split, a slow kernel on small tensors (a kernel taking 2 ms
    on 200 KB, where the calibrating add takes 2 µs, mostly fixed cost) would grow only as much as the add
    does."""
    fixed_here, fixed_there = here.times_us[0], there.times_us[0]
    work_before = here.at(before) - fixed_here
    if work_before <= FLAT * fixed_here or dur_us <= fixed_here:
        return dur_us * there.at(after) / here.at(before)
    return fixed_there + (dur_us - fixed_here) * (there.at(after) - fixed_there) / work_before


def dimension_factors(graph: Graph, change: Change, token_factor: float | None = None) -> tuple[Resize, float]:
    """How ``change`` resizes the captured step's tensors (:class:`Resize`, as :func:`predict` places it),
    and the batch × sequence factor. ``token_factor``: how the step's tokens grow when that is not
    batch × sequence (a jagged batch: by the batches the run trains on, :mod:`.jagged`)."""
    values = resolved_workload(graph)
    batch, seq = workload_value(values, BATCH_KEY), workload_value(values, *SEQ_KEYS)
    fb = change.batch_size / batch if change.batch_size and batch else 1.0
    fs = change.seq_len / seq if change.seq_len and seq else 1.0
    factors: dict[int, float] = {}
    if fb != 1.0 or fs != 1.0 or token_factor not in (None, 1.0):
        tokens = _token_dim(graph)
        if tokens and tokens not in (batch, seq):
            factors[tokens] = fb * fs if token_factor is None else token_factor
            if batch and tokens > batch and tokens - batch not in (batch, seq):  # next-item targets: Σ(L − 1)
                factors[tokens - batch] = (tokens * factors[tokens] - batch * fb) / (tokens - batch)
        if batch and seq:
            factors.setdefault(batch * seq, fb * fs)
        if batch:
            factors.setdefault(batch, fb)
        if seq:
            factors.setdefault(seq, fs)
    fixed = {u.shape for op in graph.ops for u in (*op.inputs, *op.outputs) if u.persistent}
    fixed = frozenset(fixed | {shape[::-1] for shape in fixed if len(shape) == 2})
    combined = tuple(k for k in factors if k not in (batch, seq))
    return Resize(factors, fb, fixed, combined, tuple(k for k in (batch, seq) if k in factors)), fb * fs


def predict(graph: Graph, change: Change, calibration: Calibration,
            without: frozenset[int] = frozenset()) -> Prediction:
    """The step time of ``graph``'s program under ``change``, on ``calibration``'s platform unless the
    change names another; the ops ``without`` names (ids) are taken out of the edited step with their host
    time (a part the caller costs another way)."""
    unchanged = schedule(graph)
    naive = 1.0
    values = resolved_workload(graph)
    batch, seq = workload_value(values, BATCH_KEY), workload_value(values, *SEQ_KEYS)
    if change.batch_size and not batch:
        raise ValueError(f"the capture's config has no workload.{BATCH_KEY}: a batch change cannot be placed")
    if change.seq_len and not seq:
        raise ValueError(f"the capture's config has no workload.{'/'.join(SEQ_KEYS)}: a sequence change cannot "
                         "be placed")
    jagged = None
    if (change.batch_size or change.seq_len) and batch:

        def rest(edited: bool, token_factor: float, skip: set[int]) -> float:
            resize, _ = dimension_factors(graph, change if edited else Change(), token_factor)
            there = change.calibration if edited else None
            return sum(retimed(op, resize, calibration, there) + op.gap_us for op in graph.ops if op.id not in skip)

        jagged = jagged_edit(
            graph, batch, change.batch_size or batch, change.seq_len if values.get("max_len") == seq else None,
            workload_value(values, "num_heads", "n_heads"), _token_dim(graph),
            lambda op, i, o: retimed_at(op, i, o, calibration, None),
            lambda op, i, o: retimed_at(op, i, o, calibration, change.calibration), rest)
    resize, batch_factor = dimension_factors(graph, change, jagged.edited_token_factor if jagged else None)
    naive *= batch_factor
    durations: dict[int, float] = {}
    gaps: dict[int, float] = {}
    for op in graph.ops:
        dur = retimed(op, resize, calibration, change.calibration) if (resize or change.calibration) else op.dur_us
        durations[op.id] = dur
    reference = unchanged
    if jagged:  # the length buckets, re-drawn from the data: the captured batch's stand-in and the new one
        at_draw, _ = dimension_factors(graph, Change(), jagged.unchanged_token_factor)
        reference = schedule(graph, {op.id: retimed(op, at_draw, calibration, None) for op in graph.ops}
                             | jagged.unchanged, jagged.unchanged_gaps)
        durations.update(jagged.edited)
        gaps.update(jagged.edited_gaps)
    layers, stack = None, None
    if change.layers is not None:
        stack, layers = graph.assign_layers(workload_value(values, LAYER_KEYS.get(graph.workload, "")))
        scale = change.layers / layers
        naive *= scale
        for op in graph.ops:
            if op.layer is not None:
                durations[op.id] *= scale
                gaps[op.id] = gaps.get(op.id, op.gap_us) * scale
            elif op.layer_share < 1.0:  # work over every parameter: the layers' share of it grows
                durations[op.id] *= (1.0 - op.layer_share) + op.layer_share * scale
    for op_id in without:
        durations[op_id], gaps[op_id] = 0.0, 0.0
    edited = schedule(graph, durations, gaps)
    # the graph replays the captured step within its own error; that error is taken out of the edited
    # figure the same way (the edited step × measured / unchanged; with re-drawn buckets, the unchanged
    # graph at the captured batch's representative draw, so both sides stand for a median batch)
    correction = graph.measured_step_ms * 1e3 / reference["step_us"]
    breakdown = {f"compute_{k}": v * correction / 1e3 for k, v in edited["compute_us"].items()}
    breakdown["host"] = edited["host_us"] * correction / 1e3
    breakdown["idle"] = edited["idle_us"] * correction / 1e3
    inputs = {"workload": graph.workload,
              "captured": {"layers": layers, "layer_stack": stack, "batch_size": batch, "seq_len": seq},
              "change": change.describe(), "ops": len(graph.ops), "platform": calibration.platform,
              "tracer_cost_us_per_event": list(graph.tracer_cost_us)}
    if jagged:
        inputs["jagged_buckets"] = jagged.inputs
    return Prediction(edited["step_us"] * correction / 1e3, unchanged["step_us"] / 1e3, graph.measured_step_ms,
                      graph.measured_step_ms * naive, breakdown, inputs, graph.replay_reference_ms,
                      {i: t * correction / 1e3 for i, t in edited["end_us"].items()})
