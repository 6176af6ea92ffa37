"""The program's own host time between its ops: measured from Kineto-alone steps, spread over a step's gaps.

A capture runs some steps under Kineto alone (far cheaper than the execution-trace observer) and
plain steps beside them; :func:`kineto_host_gaps` takes the profiler's cost out of a step's time
outside the replayed ops, and :func:`place_host_gaps` spreads the median over the gaps between a
step's ops (``gap_us``, ``tail_gap_us``) in proportion to the gaps the traced steps show. The
replay measures its own host time per op call with the same :func:`kineto_host_gaps`.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from typing import Any

from workloads.trace_bundle import BundleMeta
from workloads.trace_replay.parse import BundleTrace, KinetoEvent, KinetoTrace, step_index


def kineto_host_gaps(timing: KinetoTrace, plain_us: dict[int | None, float],
                     replayed: Callable[[str], bool] | None = None) -> dict[int, float]:
    """Host time outside the replayed ops per annotated step (``cobench_step#<k>`` → µs), profiler removed.

    Under Kineto a step's main thread is either inside an op the replay runs (the top-most event whose
    name ``replayed`` accepts; every op when None) or not: Python, and framework work that is not an
    op of its own, such as the autograd engine's ``evaluate_function`` wrappers around backward ops
    (their self time is the program's host time: the replay calls the ops inside them directly).
    The profiler's own cost is about the same for every op event, c = (Kineto step − plain step) ÷
    the step's op events, and it lands outside the event it records (the timestamps are taken inside
    its callbacks): each event that is not inside a replayed op adds c to the host time; nested
    events add theirs inside their parent. The program's own host time is therefore the time outside
    replayed ops − those events × c. ``plain_us`` gives the uninstrumented step time per step index
    (the ``None`` key for every step).
    """
    ops = _by_start(timing)
    gaps: dict[int, float] = {}
    for step in timing.steps:
        index = step_index(step)
        plain = plain_us.get(index, plain_us.get(None))
        every, outside, busy, _ = _walk_step(ops, step, replayed)
        if step.dur > 0 and every and plain is not None:
            per_event = max(0.0, step.dur - plain) / every
            gaps[index] = max(0.0, step.dur - busy - outside * per_event)
    return gaps


def replayed_op_counts(timing: KinetoTrace, replayed: Callable[[str], bool] | None = None) -> dict[int, int]:
    """How many ops the replay runs in each annotated step (step index → count), as the profiler saw them:
    the top-most events on the step's thread whose name ``replayed`` accepts (every op when None)."""
    ops = _by_start(timing)
    return {step_index(step): _walk_step(ops, step, replayed)[3] for step in timing.steps}


COLLECTIVE = re.compile(r"^(c10d|_c10d_functional|c10d_functional)::")


def replayed_op_time(timing: KinetoTrace, replayed: Callable[[str], bool] | None = None) -> dict[int, float]:
    """The time inside the replayed ops in each annotated step (step index → µs), collectives left out:
    how fast this machine ran the ops then, which the replay sets against its own (a collective's time is
    mostly waiting for the other ranks; what it calls inside is left out with it)."""
    ops = _by_start(timing)
    times: dict[int, float] = {}
    for step in timing.steps:
        _, _, busy, _ = _walk_step(ops, step, replayed)
        _, _, waiting, _ = _walk_step(ops, step, lambda name: COLLECTIVE.match(name) is not None and
                                      (replayed is None or replayed(name)))
        times[step_index(step)] = busy - waiting
    return times


def _by_start(timing: KinetoTrace) -> list[KinetoEvent]:
    return sorted(timing.cpu_ops, key=lambda e: (e.ts, -e.dur))  # parents before their children: the longer first


def _walk_step(ops: list[KinetoEvent], step: KinetoEvent,
               replayed: Callable[[str], bool] | None) -> tuple[int, int, float, int]:
    """One step's events: (every event in it, the step thread's events not inside a replayed op, the time
    inside replayed ops (µs), the replayed ops among the second)."""
    start, dur, tid = step.ts, step.dur, step.tid
    busy, covered_until, outside, every, ran = 0.0, start, 0, 0, 0
    for e in ops:
        if e.ts < start or e.ts >= start + dur:
            continue
        every += 1
        if e.tid != tid or e.ts < covered_until:
            continue  # another thread's, or inside a replayed op already counted
        outside += 1
        if replayed is None or replayed(e.name):
            busy += e.dur
            covered_until = e.ts + e.dur
            ran += 1
    return every, outside, busy, ran


def _plain_by_round(meta: BundleMeta, plain: list[float]) -> dict[int | None, float]:
    """Each Kineto-alone step's plain reference (µs): the median of its own round's plain steps where the
    bundle records its rounds (a machine drifting between rounds then moves both alike), else of all."""
    timing, rounds = meta.timing_step_times_s, meta.timing_rounds
    every: dict[int | None, float] = {None: 1e6 * statistics.median(plain)}
    if rounds < 1 or not timing or len(timing) % rounds or len(plain) % rounds or plain is not \
            meta.timing_plain_step_times_s:
        return every
    measured, per_round = len(timing) // rounds, len(plain) // rounds
    return every | {i: 1e6 * statistics.median(plain[(i // measured) * per_round:(i // measured + 1) * per_round])
                    for i in range(len(timing))}


def measured_host_gaps(trace: BundleTrace, replayed: set[str]) -> tuple[float | None, list[float]]:
    """The program's host time per step outside the ``replayed`` ops (µs; the median, None without
    Kineto-alone steps) and the per-step measurements it is the median of."""
    if trace.timing is None:
        return None, []
    # plain steps of the same minutes as the Kineto ones where the bundle has them (older bundles: the
    # baseline's, taken before the traced phase)
    plain = trace.meta.timing_plain_step_times_s or trace.meta.step_times_s
    samples = list(kineto_host_gaps(trace.timing, _plain_by_round(trace.meta, plain), replayed.__contains__).values())
    return (statistics.median(samples) if samples else None), samples


def place_host_gaps(ops: list[dict[str, Any]], steps: list[dict[str, Any]], per_step_us: float | None) -> None:
    """Spread the measured host time per step over the gaps between ops (``gap_us`` before each op,
    ``tail_gap_us`` after a step's last), in proportion to the gaps the traced steps show."""
    for step in steps:
        members = [op for op in ops if op["step"] == step["index"]]
        main_tid = members[0]["tid"] if members else None
        start, end = step["ts_us"], step["ts_us"] + 1e3 * step["traced_ms"]
        weights, previous_end = [], start
        for op in members:
            if op["tid"] != main_tid or op["ts_us"] is None:
                weights.append(0.0)  # another thread's gaps (e.g. CUDA's backward) overlap the main one's
                continue
            weights.append(max(0.0, op["ts_us"] - previous_end))
            previous_end = max(previous_end, op["ts_us"] + (op["dur_us"] or 0.0))
        tail = max(0.0, end - previous_end)
        total = sum(weights) + tail
        scale = (per_step_us or 0.0) / total if total > 0 else 0.0
        for op, weight in zip(members, weights, strict=True):
            op["gap_us"] = weight * scale
        step["tail_gap_us"] = tail * scale
        step["host_gap_us"] = per_step_us or 0.0
