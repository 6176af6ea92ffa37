"""Jagged batches under a batch or length change: attention in length buckets, re-drawn from the data.

A jagged sequence model (seqrec) pads attention *within* power-of-two length buckets: one group of ops
per bucket present in the batch (pad, attention, unpad, and their backward), each sized by the bucket's
history count ``n``, its longest history ``L`` (attention is quadratic in it) and its tokens ``T``.
Doubling the batch does not double those ops: more buckets are present (each with its own fixed cost and
Python between ops), and the longest history of a bucket grows — a capture at twice the batch had 4 more
buckets over 2 layers and 5.1× the attention time. One captured step cannot show that; the data can.
So, when the captured workload's config can say what its batches are:

1. the graph's bucket groups are found from its forward attention ops (``q = [n, heads, L, d]``): every
   op of the same module with a step-made tensor ``[n, L, ...]`` or ``[n, heads, L]`` belongs to bucket
   ``(n, L)``, and its 2-D tensors ``[T, ...]`` carry the bucket's tokens;
2. the batches a run trains on at the captured batch size and at the new one — the workload's own
   (``train_lengths(seed)``: the benchmark's data is drawn from the run seed, which the capture records),
   else drawn from its length distribution — are costed bucket by bucket: a bucket's ops re-timed from
   the captured group of the same power-of-two bucket (else the nearest: a bucket the capture did not
   have is a clone of its neighbour) at the batch's ``(n, L, T)``, plus the group's host gaps, plus the
   step's other ops at the batch's tokens;
3. the batch whose cost is the median of its side's stands for that side — a step time is a median —
   and its buckets' times replace the captured groups' in the edited graph (the unchanged side: in the
   correction that takes the graph's own replay error out).

The step's other ops follow the batch as before (:mod:`.predict`), with the step's tokens those of the
median batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.whatif.graph import Graph, Op, TensorUse

DRAWS = 201  # batches drawn per side (odd: the median is one of them)
RUN_BATCHES = 101  # at most this many of the run's own batches (it cycles through them all)
SEED = 20260519


@dataclass
class BucketGroup:
    """The captured ops of one length bucket (all layers): its signature and each op's time and gap."""

    count: int  # n: histories in the bucket
    longest: int  # L: padded length
    tokens: int | None  # T: the bucket's real tokens (None: not seen in a 2-D tensor)
    ops: list[Op] = field(default_factory=list)

    @property
    def index(self) -> int:
        return (self.longest - 1).bit_length()


class _Batches:
    """The batches whose lengths a side is costed on: the run's own training batches where the workload can
    draw them (``train_lengths(seed, count)``, the run seed recorded at capture; the benchmark cycles through
    them; the first :data:`RUN_BATCHES`), else :data:`DRAWS` batches drawn from its length distribution
    (``lengths()``)."""

    def __init__(self, config: Any, seed: Any):
        self.source, self.batches = "", []
        if config is None:
            return
        draw = getattr(config, "train_lengths", None)
        if callable(draw) and isinstance(seed, int):
            self.batches = [np.asarray(b) for b in draw(seed, RUN_BATCHES)]
            self.source = f"the run's first {len(self.batches)} training batches (seed {seed})"
            return
        lengths = getattr(config, "lengths", None)
        if callable(lengths):
            distribution, rng = lengths(), np.random.default_rng(SEED)
            self.source = f"{DRAWS} batches drawn from the length distribution (seed {SEED})"
            self.batches = [distribution.sample(config.batch_size, rng) for _ in range(DRAWS)]


def find_groups(graph: Graph, heads: int | None) -> list[BucketGroup]:
    """The graph's attention bucket groups (empty when its attention is not bucketed: a dense model has
    one ``[B, h, S, d]`` attention per layer, which the batch edit already resizes)."""
    attention = [op for op in graph.ops if op.category == "attention" and not op.backward and op.inputs
                 and len(op.inputs[0].shape) == 4 and not op.inputs[0].persistent]
    modules = {op.module for op in attention}
    if len(attention) <= len(modules):  # one attention per layer: not bucketed
        return []
    signatures: dict[tuple[int, int], BucketGroup] = {}
    for op in attention:
        n, h, length, _ = op.inputs[0].shape
        if heads is not None and h != heads:
            return []
        signatures.setdefault((n, length), BucketGroup(n, length, None))
    for op in graph.ops:
        if op.module not in modules:
            continue
        for (n, length), group in signatures.items():
            if any(_bucket_dim(u, n, length) is not None for u in (*op.inputs, *op.outputs)):
                group.ops.append(op)
                if group.tokens is None:
                    group.tokens = next((u.shape[0] for u in (*op.inputs, *op.outputs)
                                         if not u.persistent and len(u.shape) == 2 and u.shape[0] != n), None)
                break
    return [g for g in signatures.values() if g.ops]


def _bucket_dim(use: TensorUse, n: int, length: int) -> int | None:
    """Where a tensor of bucket ``(n, L)`` holds ``L``: ``[n, L, ...]`` → 1, ``[n, h, L, ...]`` → 2."""
    shape = use.shape
    if use.persistent or len(shape) < 3 or shape[0] != n:
        return None
    if len(shape) >= 4 and shape[2] == length:
        return 2
    if len(shape) == 3 and shape[2] == length and shape[1] != length:
        return 2  # [n, heads, L]: the attention's log-sum-exp
    if shape[1] == length:
        return 1
    return None


def _resized(use: TensorUse, group: BucketGroup, n: int, length: int, tokens: int) -> TensorUse:
    shape = list(use.shape)
    if use.persistent:
        return use
    at = _bucket_dim(use, group.count, group.longest)
    if at is not None:
        shape[0], shape[at] = n, length
    elif len(shape) == 2 and group.tokens is not None and shape[0] == group.tokens:
        shape[0] = tokens
    elif len(shape) == 1 and shape[0] == group.count + 1:  # the bucket's offsets
        shape[0] = n + 1
    else:
        return use
    return TensorUse(tuple(shape), use.itemsize, use.persistent)


def buckets_of(lengths: np.ndarray) -> dict[int, tuple[int, int, int]]:
    """A batch's power-of-two buckets (the model's ``attention_buckets``): index → (n, longest, tokens)."""
    out: dict[int, tuple[int, int, int]] = {}
    for length in lengths.tolist():
        k = (int(length) - 1).bit_length()
        n, longest, tokens = out.get(k, (0, 0, 0))
        out[k] = (n + 1, max(longest, int(length)), tokens + int(length))
    return out


@dataclass
class JaggedEdit:
    """The bucket groups' times for a representative batch at the captured and the new batch size, and
    that batch's tokens against the captured step's (the rest of the step follows them)."""

    unchanged: dict[int, float]  # op id → µs at the captured batch size's representative draw
    edited: dict[int, float]
    unchanged_gaps: dict[int, float]
    edited_gaps: dict[int, float]
    unchanged_token_factor: float
    edited_token_factor: float
    inputs: dict[str, Any]


Retime = Callable[[Op, list[TensorUse], list[TensorUse]], float]
Rest = Callable[[bool, float, set[int]], float]  # (edited side?, token factor, bucket op ids) → µs of the others


def jagged_edit(graph: Graph, batch: int, new_batch: int, new_max_len: int | None, heads: int | None,
                tokens: int | None, retime_here: Retime, retime_target: Retime, rest: Rest) -> JaggedEdit | None:
    """Bucket-aware times for a batch (and max length) change, or None where the graph's attention is not
    bucketed or the workload has no length distribution. ``tokens``: the captured step's tokens.
    ``retime_*(op, new_inputs, new_outputs)``: the op's time at new shapes by the calibrated curves, on
    this platform (the unchanged side, set against the measured step) and on the target (the edited side);
    ``rest(edited, token_factor, bucket_op_ids)``: the time of the step's other ops (and their gaps) for a
    batch of ``token_factor`` × the captured tokens, what ranks the draws together with their buckets."""
    groups = find_groups(graph, heads)
    if not groups or not tokens:
        return None
    seed = graph.config.get("seed")
    before = _Batches(graph.workload_config(), seed)
    after = _Batches(graph.workload_config({"batch_size": new_batch} | ({"max_len": new_max_len} if new_max_len
                                                                         else {})), seed)
    if not before.batches or not after.batches:
        return None
    by_index: dict[int, BucketGroup] = {}
    for group in sorted(groups, key=lambda g: g.count):  # the largest capture of each bucket is its template
        by_index[group.index] = group
    indices = sorted(by_index)
    memo: dict[tuple, dict[int, float]] = {}
    bucket_ops = {op.id for g in groups for op in g.ops}

    def group_times(k: int, n: int, longest: int, real: int,
                    retime: Retime) -> tuple[BucketGroup, dict[int, float]]:
        template = by_index.get(k) or by_index[min(indices, key=lambda i: (abs(i - k), -i))]
        key = (id(retime), template.index, n, longest, real)
        if key not in memo:
            memo[key] = {op.id: retime(op, [_resized(u, template, n, longest, real) for u in op.inputs],
                                       [_resized(u, template, n, longest, real) for u in op.outputs])
                         for op in template.ops}
        return template, memo[key]

    def side(batches: _Batches, size: int, edited: bool) -> tuple[dict[int, float], dict[int, float], float,
                                                                   dict[str, Any]]:
        retime = retime_target if edited else retime_here
        draws = []
        for lengths in batches.batches:
            buckets = buckets_of(lengths)
            cost = 0.0
            for k, (n, longest, real) in buckets.items():
                template, times = group_times(k, n, longest, real, retime)
                cost += sum(times.values()) + sum(op.gap_us for op in template.ops)
            draws.append([cost, int(lengths.sum()), buckets])
        # the rest of the step by the draw's tokens: exact at five quantiles, interpolated between
        grid = np.unique(np.quantile([d[1] for d in draws], [0.0, 0.25, 0.5, 0.75, 1.0]).round())
        rest_at = [rest(edited, t / tokens, bucket_ops) for t in grid]
        for d in draws:
            d[0] += float(np.interp(d[1], grid, rest_at))
        draws.sort(key=lambda d: d[0])
        _, real_tokens, buckets = draws[len(draws) // 2]
        durations = {op.id: 0.0 for g in groups for op in g.ops}
        gaps = dict(durations)
        for k, (n, longest, real) in buckets.items():
            template, times = group_times(k, n, longest, real, retime)
            for op in template.ops:
                durations[op.id] += times[op.id]
                gaps[op.id] += op.gap_us
        record = {"batch_size": size, "batches": batches.source, "tokens": real_tokens,
                  "buckets": {f"<={2 ** k}": list(v) for k, v in sorted(buckets.items())},
                  "step_ms_p10_p50_p90": [round(draws[int(q * (len(draws) - 1))][0] / 1e3, 3)
                                          for q in (0.1, 0.5, 0.9)]}
        return durations, gaps, real_tokens / tokens, record

    unchanged, unchanged_gaps, unchanged_factor, record_before = side(before, batch, False)
    edited, edited_gaps, edited_factor, record_after = side(after, new_batch, True)
    inputs = {"captured_groups": [[g.count, g.longest, g.tokens, len(g.ops)] for g in groups],
              "captured_tokens": tokens,
              "representative_draw": {"captured": record_before, "changed": record_after}}
    return JaggedEdit(unchanged, edited, unchanged_gaps, edited_gaps, unchanged_factor, edited_factor, inputs)
