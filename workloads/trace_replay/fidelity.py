"""How faithfully a replay reproduces its source, measured on every replay.

The reference iteration time is the source's step time measured *without* instrumentation (the
profiler inflates it, see :mod:`harness.traces.capture`); for a partial spec (a selected subgraph) it is
that time × the selected ops' share of the captured op time, × ``repeat``. Per-op and per-category
comparisons use shares and ranks, which the profiler's inflation of the source durations leaves
roughly intact, rather than absolute times.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from workloads.trace_replay.records import SpecRecord

FIDELITY_FILE = "fidelity.json"


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0
        i = j + 1
    return ranks


def pearson(x: list[float], y: list[float]) -> float:
    if len(x) < 3:
        return math.nan
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=False))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def spearman(x: list[float], y: list[float]) -> float:
    return pearson(_ranks(x), _ranks(y))


def _cv_pct(values: list[float]) -> float:
    """Coefficient of variation (%): how much the step times it is judged on move on their own."""
    return 100.0 * statistics.stdev(values) / statistics.fmean(values) if len(values) > 1 else math.nan


def _reference_times(spec: SpecRecord, rank: int, reference_times_ms: list[float] | None) -> list[float]:
    times = spec.source.step_times_ms
    return reference_times_ms or times[min(rank, len(times) - 1)]


def reference_step_ms(spec: SpecRecord, rank: int, reference_times_ms: list[float] | None = None) -> float:
    """What one replayed step should take: the source's plain step time, scaled to the selection."""
    full = _median(_reference_times(spec, rank, reference_times_ms))
    rank_spec = spec.ranks[min(rank, len(spec.ranks) - 1)]
    if spec.full_step:
        return full
    captured = statistics.fmean(s.ops_dur_us for s in rank_spec.steps) or math.nan
    per_step: dict[int, float] = defaultdict(float)
    for op in rank_spec.ops:
        per_step[op.step] += op.dur_us or 0.0
    selected = statistics.fmean(per_step.values()) if per_step else 0.0
    return full * selected / captured * spec.repeat


def unfaithful_reason(ops: list[Any], errors: dict[int, str], divergent: dict[int, str]) -> str:
    """Why the replay is not the program (ops that failed, ops that made other shapes), naming the ops and
    their share of the captured op time; empty when every op ran as captured."""
    total = sum(op.dur_us or 0.0 for op in ops) or math.nan
    parts = []
    for label, found in (("failed", errors), ("made other shapes than captured", divergent)):
        if not found:
            continue
        by_name: dict[str, list[int]] = defaultdict(list)
        for index in found:
            by_name[ops[index].name].append(index)
        share = 100.0 * sum(ops[i].dur_us or 0.0 for i in found) / total
        named = ", ".join(f"{name} x{len(idx)} ({found[idx[0]]})" for name, idx in sorted(by_name.items()))
        parts.append(f"{len(found)} ops {label}, {share:.1f} % of the op time: {named}")
    return "; ".join(parts)


def nonfinite_note(count: int) -> str:
    """What a replay whose carried state went NaN or infinite says of itself (``count`` such tensors); empty
    when there are none. Its ops then ran on other values than the program's, at speeds of their own: a CPU's
    square root of NaN or negative floats is many times slower than of the program's (:mod:`.tensors`)."""
    if not count:
        return ""
    return (f"{count} of the tensors the replay carries across steps (parameters, optimiser state, inputs) held "
            f"NaN or infinity after its steps: its ops ran on other values than the program's (a value the "
            f"capture recorded wrongly or matched to another tensor); its time may not be the program's")


UNREPRESENTATIVE_PCT = 5.0  # traced steps this far from the program's own in ops a step are not its steps


def steps_unlike(traced: float, program: float) -> bool:
    """Whether traced steps that ran ``traced`` ops a step, at the mean, are unlike the program's steps that ran
    ``program``: apart by more than :data:`UNREPRESENTATIVE_PCT`."""
    return abs(100.0 * (traced / program - 1.0)) > UNREPRESENTATIVE_PCT


def unrepresentative_reason(steps: Sequence[Any]) -> str:
    """Why the captured steps are not the program's own: they ran more or fewer ops a step (as the profiler
    saw them) than the program's steps timed at capture, by more than :data:`UNREPRESENTATIVE_PCT`;
    empty when they ran as many, or where the bundle did not count them."""
    counted = [s for s in steps if s.kineto_ops > 0 and s.program_kineto_ops > 0]
    if not counted:
        return ""
    traced, program = statistics.fmean(s.kineto_ops for s in counted), counted[0].program_kineto_ops
    if not steps_unlike(traced, program):
        return ""
    return (f"the captured steps ran {traced:.0f} ops a step where the program's steps ran {program:.0f} (the "
            f"mean of those timed at capture): its steps differ by chance (a layer dropped at random, a "
            f"data-dependent path), and these are not its typical ones; capture more steps (--steps)")


def _category_shares(ops: list[Any], op_times_s: dict[int, list[float]]
                     ) -> tuple[dict[str, dict[str, float]], list[tuple[float, float]]]:
    """Per category, the share of the captured op time vs the share of the replayed op time; and the
    (captured µs, replayed µs) of every op timed on both sides."""
    orig_cat: dict[str, float] = defaultdict(float)
    replay_cat: dict[str, float] = defaultdict(float)
    pairs = []
    for i, op in enumerate(ops):
        orig_cat[op.category] += op.dur_us or 0.0
        if i in op_times_s:
            replay_us = 1e6 * min(op_times_s[i])
            replay_cat[op.category] += replay_us
            if op.dur_us:
                pairs.append((op.dur_us, replay_us))
    orig_total, replay_total = sum(orig_cat.values()) or 1.0, sum(replay_cat.values()) or 1.0
    categories = {
        c: {"source_share": orig_cat[c] / orig_total, "replay_share": replay_cat.get(c, 0.0) / replay_total,
            "source_us": orig_cat[c], "replay_us": replay_cat.get(c, 0.0)}
        for c in sorted(set(orig_cat) | set(replay_cat))
    }
    return categories, pairs


def compute_fidelity(
    spec: SpecRecord,
    rank: int,
    replay_step_times_s: list[float],
    op_times_s: dict[int, list[float]],
    errors: dict[int, str],
    *,
    reference_times_ms: list[float] | None = None,
    replay_peak_memory_bytes: int = 0,
    replay_device_type: str = "cpu",
    reference_peak_memory_bytes: int = 0,
    reference_device_type: str | None = None,
    portability: bool = False,
    host_gaps: bool = False,
    divergent: dict[int, str] | None = None,
) -> dict[str, Any]:
    """The fidelity record (``fidelity.json``) and its headline metrics.

    Memory is judged against a reference bundle's peak where one is given (captured on the replay's
    platform), else against the source's; and only where both peaks come from the same meter (process RSS
    on a CPU, the allocator's peak on an accelerator; ``MemoryMeter``)."""
    rank_spec = spec.ranks[min(rank, len(spec.ranks) - 1)]
    ops = rank_spec.ops
    reference_ms = reference_step_ms(spec, rank, reference_times_ms)
    replay_ms = 1e3 * _median(replay_step_times_s)
    signed = 100.0 * (replay_ms - reference_ms) / reference_ms if reference_ms > 0 else math.nan

    total_dur = sum(op.dur_us or 0.0 for op in ops)
    ran = [i for i in range(len(ops)) if i not in errors]
    ran_dur = sum(ops[i].dur_us or 0.0 for i in ran)

    categories, pairs = _category_shares(ops, op_times_s)
    distance = 0.5 * sum(abs(v["source_share"] - v["replay_share"]) for v in categories.values())
    logs = [(math.log(a), math.log(max(b, 1e-3))) for a, b in pairs if a > 0]

    if reference_times_ms:  # judged against a reference bundle, as the record's "reference" says
        source_peak, source_device = reference_peak_memory_bytes, reference_device_type
    else:
        peaks = spec.source.peak_memory_bytes
        source_peak = peaks[min(rank, len(peaks) - 1)] if peaks else 0
        source_device = spec.source.platform.get("device_type")
    same_meter = source_device is None or (source_device == "cpu") == (replay_device_type == "cpu")
    metrics = {
        "time_error_pct": abs(signed),
        "time_error_signed_pct": signed,
        "replay_step_ms": replay_ms,
        "reference_step_ms": reference_ms,
        # the noise of both sides: an error below these is not a difference this platform can show
        "reference_step_cv_pct": _cv_pct(_reference_times(spec, rank, reference_times_ms)),
        "replay_step_cv_pct": _cv_pct(replay_step_times_s),
        "op_coverage_pct": 100.0 * len(ran) / len(ops),
        "time_coverage_pct": 100.0 * ran_dur / total_dur if total_dur > 0 else math.nan,
        "ops_per_step": len(ops) / max(len(rank_spec.steps), 1),
        "ops_failed": float(len(errors)),
        "ops_divergent": float(len(divergent or {})),
        "category_distance": distance,
        "op_time_spearman": spearman([a for a, _ in logs], [b for _, b in logs]),
        "op_time_pearson_log": pearson([a for a, _ in logs], [b for _, b in logs]),
        "replay_peak_memory_mb": replay_peak_memory_bytes / 2**20,
        "source_peak_memory_mb": source_peak / 2**20,
        "portability": float(portability),
        # the program's own host time per step as measured at capture, which the replay spends between ops
        # (0: ops back to back)
        "host_gap_ms": statistics.fmean(s.host_gap_us for s in rank_spec.steps) / 1e3
        if host_gaps and rank_spec.steps else 0.0,
    }
    if source_peak and replay_peak_memory_bytes and same_meter:
        metrics["memory_error_pct"] = 100.0 * (replay_peak_memory_bytes - source_peak) / source_peak
    record = {
        "metrics": metrics,
        "reference": "reference bundle" if reference_times_ms else "source bundle (plain, uninstrumented steps)",
        # a replay alone is judged against step times measured in another process (the capture's or a
        # reference bundle's); `cobench trace fidelity` judges side by side in one process instead
        "judgement": "portability" if portability else "cross_process",
        "categories": categories,
        "failed_ops": [{"index": i, "name": ops[i].name, "schema": ops[i].schema, "error": err}
                       for i, err in sorted(errors.items())],
        "divergent_ops": [{"index": i, "name": ops[i].name, "schema": ops[i].schema, "difference": why}
                          for i, why in sorted((divergent or {}).items())],
        "unfaithful": unfaithful_reason(ops, errors, divergent or {}),
        "unrepresentative": unrepresentative_reason(rank_spec.steps),
        "source": {"workload": spec.source.workload, "run_id": spec.source.run_id,
                   "platform": spec.source.platform, "world_size": spec.source.world_size},
        "options": spec.options,
    }
    if not same_meter:
        meter = {True: "process RSS", False: "the allocator's peak"}
        record["memory_unmeasured"] = (
            f"no memory error: the {'reference' if reference_times_ms else 'source'}'s peak on "
            f"{source_device} is {meter[source_device == 'cpu']}, the replay's on {replay_device_type} "
            f"{meter[replay_device_type == 'cpu']}; judge against a capture on this device "
            f"(workload.reference_bundle=)")
    return record
