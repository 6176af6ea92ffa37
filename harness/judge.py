"""Side-by-side fidelity: the replay judged against its source program in the same process.

Two processes of the same program, minutes apart, differ by up to 44 % in step time on a shared
2-core VM, so a replay judged against a capture taken in another process measures the machine as
much as the replay. Here the source and its replay run in one process, interleaved in rounds —
source K steps, replay K steps, the order alternating every round — so machine drift lands on both
sides alike. The figure is the ratio of the two sides' median step times, with a 95 % interval
from a bootstrap over rounds (each round's pair is resampled together, so drift between rounds
does not widen it). Short steps are timed in batches (a sample lasts at least 20 ms), and the judge
adds rounds until the interval's half-width is within ±2.5 % or its time budget (60 s by default)
runs out: only then is the figure declared invalid, with the interval it reached. A replay that did
not run every op as captured is never a valid verdict either.

    from harness.judge import judge
    record = judge(train_step, "traces/mine", model=model)   # capture → generate → side by side

``cobench trace fidelity workload=<name>`` does the same for a registered workload, as one MLflow run.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch.profiler import ProfilerActivity, profile, supported_activities

from harness.capture import capture, prepare_source
from harness.config import CobenchConfig, results_root
from harness.distributed import broadcast_from_main, env_dist_info
from harness.files import write_atomic
from harness.interrupts import deferred_interrupts, signal_name
from harness.platform import device_name, synchronize
from harness.runner import (
    STATUS_FAILED,
    STATUS_FINISHED,
    STATUS_KILLED,
    BenchmarkResult,
    connect_tracker,
    join_process_group,
    new_run_dir,
    open_run,
    write_and_publish,
)
from harness.tracking import Tracker
from workloads import discover
from workloads.base import RunContext, WorkloadSpec
from workloads.trace_bundle import KINETO_FILE, STEP_ANNOTATION, rank_dirs, read_json, read_meta

FIDELITY_FILE = "fidelity.json"
# A verdict needs the 95 % interval of the replay ÷ source ratio within ±TARGET_HALF_WIDTH_PCT: the judge
# adds rounds until it is, or until its time budget runs out (then, and only then, no verdict).
TARGET_HALF_WIDTH_PCT = 2.5
MIN_VALID_ROUNDS = 5  # a bootstrap over fewer rounds gives an interval too narrow to believe
DEFAULT_BUDGET_S = 60.0  # the side-by-side rounds' time budget, by default
MAX_ROUNDS = 400
MIN_SAMPLE_MS = 20.0  # a sample times enough consecutive steps to last this long: timer and sync costs vanish
BOOTSTRAP_SAMPLES = 2000
# c10::DeviceType codes, as the profiler's memory events name devices (others: any non-CPU event)
_C10_DEVICE_TYPES = {"cpu": 0, "cuda": 1, "xpu": 12, "mps": 13, "privateuseone": 20}


@dataclass
class SideBySide:
    """Interleaved step times of the source and its replay, round by round (ms per step), and the verdict.

    Each value is one sample: ``batch`` consecutive steps timed together, divided by ``batch``.
    """

    source_ms: list[list[float]]
    replay_ms: list[list[float]]
    order: list[str]  # which side went first in each round
    batch: int = 1  # steps per timed sample
    target_half_width_pct: float = TARGET_HALF_WIDTH_PCT
    budget_s: float | None = None  # None: a fixed number of rounds
    elapsed_s: float = 0.0  # what the rounds took
    budget_exhausted: bool = False
    # bootstrap draws of how much a replay step would move were the capture's host time and the replay's
    # own call cost measured again (ms; see capture_shift_draws): the interval covers them too
    replay_shift_ms: list[float] | None = None
    capture_half_width_pct: float = 0.0  # that alone, as a half-width of the figure
    time_error_signed_pct: float = math.nan
    time_error_pct: float = math.nan
    time_error_ci_low_pct: float = math.nan
    time_error_ci_high_pct: float = math.nan
    source_step_ms: float = math.nan
    replay_step_ms: float = math.nan
    source_round_cv_pct: float = math.nan
    replay_round_cv_pct: float = math.nan
    fidelity_valid: bool = False
    invalid_reason: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def half_width_pct(self) -> float:
        return (self.time_error_ci_high_pct - self.time_error_ci_low_pct) / 2

    def summarise(self, seed: int = 0) -> SideBySide:
        """Fill in the figures from the step times."""
        source = [t for r in self.source_ms for t in r]
        replay = [t for r in self.replay_ms for t in r]
        self.source_step_ms, self.replay_step_ms = statistics.median(source), statistics.median(replay)
        ratio = self.replay_step_ms / self.source_step_ms
        self.time_error_signed_pct = 100.0 * (ratio - 1.0)
        self.time_error_pct = abs(self.time_error_signed_pct)
        low, high = bootstrap_ratio_interval(self.source_ms, self.replay_ms, seed=seed, shift_ms=self.replay_shift_ms)
        if self.replay_shift_ms:
            shifts = sorted(100.0 * d / self.replay_step_ms for d in self.replay_shift_ms)
            last = len(shifts) - 1
            self.capture_half_width_pct = (shifts[int(0.975 * last)] - shifts[int(0.025 * last)]) / 2
        self.time_error_ci_low_pct, self.time_error_ci_high_pct = 100.0 * (low - 1.0), 100.0 * (high - 1.0)
        self.source_round_cv_pct = _cv_pct([statistics.median(r) for r in self.source_ms])
        self.replay_round_cv_pct = _cv_pct([statistics.median(r) for r in self.replay_ms])
        reasons = []
        if len(self.order) < MIN_VALID_ROUNDS:
            reasons.append(f"{len(self.order)} rounds are too few for an interval (at least {MIN_VALID_ROUNDS}: "
                           f"--rounds)")
        if not self.half_width_pct <= self.target_half_width_pct:
            spent = (f" after {len(self.order)} rounds in {self.elapsed_s:.0f} s, the budget spent "
                     f"(--budget-s {self.budget_s:.0f})" if self.budget_s is not None else
                     f" after {len(self.order)} rounds (--rounds)")
            reasons.append(f"the 95 % interval is ±{self.half_width_pct:.1f} % (> ±{self.target_half_width_pct:g} %)"
                           f"{spent}: the source's round medians vary {self.source_round_cv_pct:.1f} %"
                           + (f", and re-measuring the capture's host time and the replay's call cost alone moves "
                              f"it ±{self.capture_half_width_pct:.1f} %" if self.replay_shift_ms else "")
                           + "; a larger budget or a quieter machine narrows it")
        self.fidelity_valid = not reasons
        self.invalid_reason = "; ".join(reasons)
        return self

    def metrics(self) -> dict[str, float]:
        return {
            "time_error_pct": self.time_error_pct,
            "time_error_signed_pct": self.time_error_signed_pct,
            "time_error_ci_low_pct": self.time_error_ci_low_pct,
            "time_error_ci_high_pct": self.time_error_ci_high_pct,
            "time_error_ci_pct": self.half_width_pct,
            "source_step_ms": self.source_step_ms,
            "replay_step_ms": self.replay_step_ms,
            "reference_step_ms": self.source_step_ms,
            "source_round_cv_pct": self.source_round_cv_pct,
            "replay_round_cv_pct": self.replay_round_cv_pct,
            "fidelity_valid": float(self.fidelity_valid),
            "judgement_rounds": float(len(self.order)),
            "judgement_batch_steps": float(self.batch),
            "judgement_elapsed_s": self.elapsed_s,
            "capture_half_width_pct": self.capture_half_width_pct,
            **({"judgement_budget_s": self.budget_s} if self.budget_s is not None else {}),
        }


def bootstrap_ratio_interval(source_ms: list[list[float]], replay_ms: list[list[float]], *, seed: int = 0,
                             samples: int = BOOTSTRAP_SAMPLES, level: float = 0.95,
                             shift_ms: list[float] | None = None) -> tuple[float, float]:
    """95 % interval of median(replay) ÷ median(source), resampling whole rounds (pairs stay together);
    ``shift_ms``: draws of what re-measuring the capture would add to a replay step, one per sample."""
    rng = random.Random(seed)
    rounds = len(source_ms)
    ratios = []
    for b in range(samples):
        picked = [rng.randrange(rounds) for _ in range(rounds)]
        source = [t for i in picked for t in source_ms[i]]
        replay = [t for i in picked for t in replay_ms[i]]
        shift = shift_ms[b % len(shift_ms)] if shift_ms else 0.0
        ratios.append((statistics.median(replay) + shift) / statistics.median(source))
    ratios.sort()
    tail = (1.0 - level) / 2
    return ratios[int(tail * (samples - 1))], ratios[int(math.ceil((1.0 - tail) * (samples - 1)))]


def interleave(source_step: Callable[[], Any], replay_step: Callable[[], Any], device: torch.device, *,
               rounds: int = 10, steps_per_round: int = 10, warmup: int = 3, seed: int = 0,
               budget_s: float | None = None, target_half_width_pct: float = TARGET_HALF_WIDTH_PCT,
               batch: int | None = None, agree: Callable[[Any], Any] | None = None,
               replay_shift_ms: list[float] | None = None,
               prepare: dict[str, Callable[[], Any]] | None = None) -> SideBySide:
    """Run both sides in alternating rounds of ``steps_per_round`` samples each, timed device-synchronised.

    A sample is ``batch`` consecutive steps timed together (default: as many as last
    :data:`MIN_SAMPLE_MS`, from the warm-up steps' times), so that short steps are not lost in the
    timer's and the synchronisation's own cost. With ``budget_s``, ``rounds`` is the least: more are
    added until the interval's half-width is within ``target_half_width_pct`` or the rounds have
    taken ``budget_s`` (the figure is then reported as reached, and not valid). ``agree``: under
    torchrun, returns rank 0's value of what it is given, so that every rank runs the same batch and
    rounds (the steps hold collectives). ``replay_shift_ms``: see :func:`capture_shift_draws`.
    ``prepare``: side name → called before that side's samples of each round, untimed (the replay puts
    its carried state back as it was made: the replay workload's ``restore_values``).
    """
    agree = agree or (lambda value: value)
    if rounds < 2 or steps_per_round < 1 or warmup < 0:
        raise ValueError(f"side-by-side needs rounds >= 2, steps per round >= 1, warmup >= 0; got rounds={rounds}, "
                         f"steps per round={steps_per_round}, warmup={warmup}")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"the judgement's time budget must be > 0 s, got {budget_s}")
    sides = {"source": source_step, "replay": replay_step}
    warm_ms = []
    for step in sides.values():  # both warm: caches, allocator, lazy init
        for _ in range(warmup):
            warm_ms.append(_timed(step, device, 1))
    if batch is None:
        typical = statistics.median(warm_ms[len(warm_ms) // 4:]) if warm_ms else MIN_SAMPLE_MS
        batch = agree(max(1, min(1000, math.ceil(MIN_SAMPLE_MS / max(typical, 1e-3)))))
    times: dict[str, list[list[float]]] = {"source": [], "replay": []}
    order: list[str] = []
    started = time.perf_counter()

    def run_round() -> None:
        first, second = ("source", "replay") if len(order) % 2 == 0 else ("replay", "source")
        order.append(first)
        for name in (first, second):
            if name in (prepare or {}):
                prepare[name]()
            times[name].append([_timed(sides[name], device, batch) for _ in range(steps_per_round)])

    for _ in range(rounds):
        run_round()
    side = SideBySide(times["source"], times["replay"], order, batch=batch, budget_s=budget_s,
                      target_half_width_pct=target_half_width_pct, replay_shift_ms=replay_shift_ms)
    side.elapsed_s = time.perf_counter() - started
    side.summarise(seed)
    while budget_s is not None:
        per_round = side.elapsed_s / len(order)
        # a quarter more rounds at a time (the bootstrap is recomputed each time), within the budget;
        # every rank follows rank 0's decision (its own interval may differ)
        done = side.half_width_pct <= target_half_width_pct or len(order) >= MAX_ROUNDS
        exhausted = side.elapsed_s + per_round > budget_s
        more = max(1, min(max(2, len(order) // 4), int((budget_s - side.elapsed_s) / per_round),
                          MAX_ROUNDS - len(order)))
        done, exhausted, more = agree((done, exhausted, more))
        if done:
            break
        if exhausted:
            side.budget_exhausted = True
            break
        for _ in range(more):
            run_round()
        side.elapsed_s = time.perf_counter() - started
        side.summarise(seed)
    return side


def _timed(step: Callable[[], Any], device: torch.device, batch: int) -> float:
    """Milliseconds per step over ``batch`` consecutive steps, device-synchronised before and after."""
    synchronize(device)
    started = time.perf_counter()
    for _ in range(batch):
        step()
    synchronize(device)
    return 1e3 * (time.perf_counter() - started) / batch


def replay_workload_spec() -> WorkloadSpec:
    """The registered workload that replays trace bundles (found by its property, not its name)."""
    found = [spec for spec in discover().values() if spec.replays_bundle]
    if len(found) != 1:
        raise RuntimeError(f"expected exactly one registered workload that replays bundles, found "
                           f"{[s.name for s in found]}")
    return found[0]


def judge_bundle(source_step: Callable[[], Any], bundle: Path, ctx: RunContext, *, rounds: int, steps_per_round: int,
                 warmup: int, replay_options: dict[str, Any] | None = None,
                 budget_s: float | None = DEFAULT_BUDGET_S,
                 hold_batch: Callable[[bool], None] | None = None) -> dict[str, Any]:
    """Generate the bundle's spec, replay it beside ``source_step`` and return the fidelity record.

    The record is the replay workload's own (coverage, categories, per-op figures) with the
    side-by-side time judgement in place of the cross-process one; it is written to
    ``ctx.work_dir/fidelity.json``. ``hold_batch``: given for a workload that held its traced batch
    through the capture; its memory is then judged on its captured steps.
    """
    spec = replay_workload_spec()
    replay = spec.factory.from_bundle(bundle, ctx, **(replay_options or {}))
    replay.setup()
    try:
        side = interleave(source_step, replay.step, ctx.device, rounds=rounds, steps_per_round=steps_per_round,
                          warmup=warmup, seed=ctx.seed, budget_s=budget_s,
                          agree=_rank0_value(ctx.process_group) if ctx.distributed else None,
                          replay_shift_ms=capture_shift_draws(getattr(replay, "replayer", None), seed=ctx.seed),
                          prepare={"replay": replay.restore_values} if hasattr(replay, "restore_values") else None)
        rank_dir = rank_dirs(bundle)[min(ctx.rank, len(rank_dirs(bundle)) - 1)]
        memory_steps = len(read_meta(rank_dir).traced_step_times_s)  # each captured step once
        # Each side's peak over as many of its own steps as were captured, measured alike. Not the captured
        # steps' own allocator events: under the execution-trace observer, the copies it makes of integer
        # inputs (recorded data, value ranges) are allocations too — a GCN's edge indices added 83 % there.
        # Except for a workload that held its traced batch through the capture (its op shapes follow its
        # data): its next steps would be other batches, with its data pipeline's next ones being made
        # beside them (seqrec: 10.8 MB where its captured steps held 6.8), so its captured steps it is.
        captured_peak = captured_step_peak_bytes(rank_dir, ctx.device)
        if hold_batch is not None and captured_peak is not None:
            source_peak = captured_peak
        else:
            source_peak = step_memory_peak_bytes(source_step, ctx.device, memory_steps)
        replay_peak = step_memory_peak_bytes(replay.step, ctx.device, memory_steps)
        replay.observe_step_times([t / 1e3 for r in side.replay_ms for t in r])
        replay.extra_metrics()  # coverage, categories, per-op timing: this rank's record (rank 0 writes it)
    finally:
        replay.teardown()
    path = ctx.work_dir / FIDELITY_FILE
    record = copy.deepcopy(replay.record)
    cross = {k: record["metrics"].pop(k) for k in ("time_error_pct", "time_error_signed_pct", "reference_step_ms",
                                                   "reference_step_cv_pct", "replay_step_ms", "replay_step_cv_pct")
             if k in record["metrics"]}
    if record.get("unfaithful"):  # a replay that did not run every op as captured is no verdict on time
        side.fidelity_valid = False
        side.invalid_reason = "; ".join(r for r in (f"the replay is not the program: {record['unfaithful']}",
                                                    side.invalid_reason) if r)
    record["metrics"].update(side.metrics())
    for category, shares in record.get("categories", {}).items():  # replay's share − source's, in points
        record["metrics"][f"category_error_pp_{category}"] = 100.0 * (shares["replay_share"] - shares["source_share"])
    # Memory, side by side: what one step allocates at its peak over what it started with (the
    # allocator's own accounting, per side), on top of what lives across steps. The replay synthesises
    # exactly the storages the steps read but did not make (parameters, optimiser state, inputs), so
    # that part is the same on both sides; the process-wide peak (RSS) would hold both sides at once.
    static = record["metrics"].get("replay_static_mb", 0.0) * 2**20
    record["metrics"].update({
        "source_step_peak_mb": source_peak / 2**20,
        "replay_step_peak_mb": replay_peak / 2**20,
        "source_peak_memory_mb": (static + source_peak) / 2**20,
        "replay_peak_memory_mb": (static + replay_peak) / 2**20,
        "memory_error_pct": 100.0 * (replay_peak - source_peak) / (static + source_peak)
        if static + source_peak > 0 else math.nan,
    })
    if captured_peak is not None:  # for reference: the capture's own copies included
        record["metrics"]["captured_step_peak_mb"] = captured_peak / 2**20
    record["judgement"] = "side_by_side"
    record["side_by_side"] = {k: v for k, v in asdict(side).items()
                              if k not in ("source_ms", "replay_ms", "replay_shift_ms")}
    record["side_by_side"]["source_ms"], record["side_by_side"]["replay_ms"] = side.source_ms, side.replay_ms
    record["cross_process_against_capture"] = cross  # for reference: what the old judgement said
    if ctx.rank == 0:
        write_atomic(path, json.dumps(record, indent=2))
    return record


def capture_shift_draws(replayer: Any, *, seed: int = 0, samples: int = BOOTSTRAP_SAMPLES) -> list[float] | None:
    """Bootstrap draws (ms) of how far a replay step would move were its two measured inputs measured again.

    A replay spends the program's host time per step, measured once at capture (the median of the
    Kineto-alone steps), less its own cost per op call, measured once at setup (the median of its
    calibration steps). Two judgements of one program differ mostly by these two medians. Each draw
    resamples both sets of measurements: the median gap moves the step by as much; the median call cost
    moves it the other way, once per op. None when the replay spends no host gaps.
    """
    if replayer is None or not getattr(replayer, "host_gaps", False):
        return None
    gaps, calls = list(replayer.gap_samples_us), list(replayer.call_samples_s)
    if len(gaps) < 2 and len(calls) < 2:
        return None
    ops = statistics.fmean(len(step) for step in replayer.sequence)
    gap, call = (statistics.median(gaps) if gaps else 0.0), replayer.call_s
    rng = random.Random(seed + 1)
    draws = []
    for _ in range(samples):
        g = statistics.median(rng.choices(gaps, k=len(gaps))) if len(gaps) > 1 else gap
        c = statistics.median(rng.choices(calls, k=len(calls))) if len(calls) > 1 else call
        draws.append(((g - gap) - ops * 1e6 * (c - call)) / 1e3)
    return draws


def _rank0_value(group: Any) -> Callable[[Any], Any]:
    def agree(value: Any) -> Any:
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0, group=group)
        return box[0]

    return agree


def _memory_totals(events: list, device: torch.device) -> list[tuple[float, float, float]]:
    """(time, bytes, the allocator's running total after it) of the profiler's memory events for ``device``."""
    device_type = _C10_DEVICE_TYPES.get(device.type)
    return [(float(e["ts"]), float(e["args"].get("Bytes", 0)), float(e["args"]["Total Allocated"])) for e in events
            if isinstance(e, dict) and e.get("name") == "[memory]" and isinstance(e.get("args"), dict)
            and "Total Allocated" in e["args"] and isinstance(e.get("ts"), int | float)
            and (e["args"].get("Device Type") == device_type if device_type is not None
                 else e["args"].get("Device Type") != 0)]


def captured_step_peak_bytes(rank_dir: Path, device: torch.device) -> int | None:
    """The most memory one captured step held beyond what it started with, from the capture's own allocator
    events (its Kineto trace); None when the bundle has none."""
    events = read_json(rank_dir / KINETO_FILE, "Kineto trace").get("traceEvents", [])
    totals = _memory_totals(events, device)
    steps = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
             if isinstance(e, dict) and e.get("ph") == "X" and str(e.get("name", "")).startswith(STEP_ANNOTATION)
             and isinstance(e.get("ts"), int | float) and isinstance(e.get("dur"), int | float)]
    peaks = []
    for start, end in steps:
        inside = [(b, t) for ts, b, t in totals if start <= ts <= end]
        if inside:
            before = inside[0][1] - inside[0][0]  # the running total when the step began
            peaks.append(max(0.0, max(t for _, t in inside) - before))
    return int(max(peaks)) if peaks else None


def step_memory_peak_bytes(step: Callable[[], Any], device: torch.device, steps: int = 1) -> int:
    """The most memory ``steps`` calls of ``step`` hold at once beyond what was allocated before them.

    Read from the profiler's memory events (the allocator's running total of what was allocated
    since profiling began, for ``device``): no RSS, so another side's tensors in the same process
    do not count.
    """
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda" and ProfilerActivity.CUDA in supported_activities():
        activities.append(ProfilerActivity.CUDA)
    synchronize(device)
    with profile(activities=activities, profile_memory=True) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    with tempfile.TemporaryDirectory(prefix="cobench-memory-") as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return int(max([0.0, *(total for _, _, total in _memory_totals(events, device))]))


def _cv_pct(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    return 100.0 * statistics.stdev(values) / statistics.fmean(values)


def judge(step: Callable[[], Any], out_dir: str | Path, *, device: torch.device | str | None = None,
          model: torch.nn.Module | None = None, rounds: int = 10, steps_per_round: int = 10, warmup: int = 5,
          capture_steps: int = 3, baseline_steps: int = 20, source: str = "program",
          replay_options: dict[str, Any] | None = None, verbose: bool = True,
          budget_s: float | None = DEFAULT_BUDGET_S) -> dict[str, Any]:
    """Capture ``step`` (your callable running one training step), generate its spec, and judge the replay
    side by side with ``step`` in this process (see :mod:`harness.judge`).

    Returns the fidelity record, also written to ``<out_dir>/fidelity.json``; its ``metrics`` hold
    ``time_error_pct`` (signed: ``time_error_signed_pct``) with its 95 % interval, ``fidelity_valid``
    and the replay's coverage and per-category figures. ``replay_options``: settings of the replay
    workload (e.g. ``{"trust_spec": True}`` for a program that uses its own op library). ``verbose``:
    print the verdict line (with the reason when it is not valid) to stderr. ``rounds`` is the least
    number of rounds: more are added until the interval is within ±2.5 % or ``budget_s`` runs out
    (None: exactly ``rounds``).
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    out_dir = Path(out_dir)
    with capture(out_dir, steps=capture_steps, warmup=warmup, baseline_steps=baseline_steps, device=device,
                 source=source, model=model, announce=False) as cap:
        while not cap.done:
            with cap.step():
                step()
    distributed = torch.distributed.is_initialized()  # under torchrun: each rank judges its own rank
    ctx = RunContext(device=device, seed=0, work_dir=out_dir, device_name=device_name(device),
                     rank=torch.distributed.get_rank() if distributed else 0,
                     world_size=torch.distributed.get_world_size() if distributed else 1,
                     process_group=torch.distributed.group.WORLD if distributed else None)
    record = judge_bundle(step, out_dir, ctx, rounds=rounds, steps_per_round=steps_per_round, warmup=warmup,
                          replay_options=replay_options, budget_s=budget_s)
    if verbose:
        print(verdict_line(source, record), file=sys.stderr)
    return record


def verdict_line(name: str, record: dict[str, Any]) -> str:
    """One line for the console: the figure with its interval, and the verdict with its reason."""
    m, side = record["metrics"], record["side_by_side"]
    verdict = "valid" if side["fidelity_valid"] else f"NOT VALID: {side['invalid_reason']}"
    return (f"{name}: replay {m['time_error_signed_pct']:+.1f} % [{m['time_error_ci_low_pct']:+.1f}, "
            f"{m['time_error_ci_high_pct']:+.1f}] vs the program, op coverage {m['op_coverage_pct']:.1f} %, "
            f"memory {m.get('memory_error_pct', math.nan):+.1f} %: {verdict}")


def judge_benchmark(cfg: CobenchConfig, *, benchmark: str | None = None, rounds: int = 10, steps_per_round: int = 10,
                    warmup: int = 5, capture_steps: int = 3, baseline_steps: int = 20, suite: str = "",
                    parent_run_id: str | None = None, tracker: Tracker | None = None,
                    connect: bool = True, budget_s: float | None = DEFAULT_BUDGET_S) -> BenchmarkResult:
    """``cobench trace fidelity``: capture the workload ``cfg`` names, replay it beside itself, log one run.

    The MLflow run (tags ``workload=generated``, ``source_workload``, ``fidelity_judgement=
    side_by_side``) holds the side-by-side figures, the replay's coverage and categories, and the run
    folder's ``fidelity.json``; it ends FINISHED, FAILED or KILLED with the reason like any run.
    """
    name = benchmark or f"{cfg.workload.name}_fidelity"
    root = results_root(cfg)
    join_process_group(cfg)
    run_dir = Path(broadcast_from_main(new_run_dir(root, name) if env_dist_info().is_main else None))
    bundle = run_dir / "bundle"
    source = prepare_source(cfg, bundle)  # validates the workload before any run exists
    ctx = dataclasses.replace(source.ctx, work_dir=run_dir)
    if tracker is None and connect:
        tracker = connect_tracker(cfg)
    main = ctx.rank == 0
    result = BenchmarkResult(name, replay_workload_spec().name, source.platform.name, STATUS_FINISHED,
                             "iterations/s", run_dir)
    if main:
        judge_params = {"rounds": rounds, "steps_per_round": steps_per_round, "budget_s": budget_s, "warmup": warmup,
                        "capture_steps": capture_steps, "baseline_steps": baseline_steps}
        open_run(cfg, result, source.platform, ctx.world_size, tracker, suite=suite, parent_run_id=parent_run_id,
                 tags={"source_workload": cfg.workload.name, "fidelity_judgement": "side_by_side"},
                 params={"judge": judge_params, **OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)})
    if ctx.distributed:
        torch.distributed.barrier()
    status, reason = STATUS_FINISHED, None
    try:
        source.capture(bundle, steps=capture_steps, warmup=warmup, baseline_steps=baseline_steps, announce=False)
        if ctx.distributed:
            torch.distributed.barrier()  # every rank's bundle is written
        record = judge_bundle(source.workload.step, bundle, ctx, rounds=rounds, steps_per_round=steps_per_round,
                              warmup=warmup, budget_s=budget_s,
                              hold_batch=getattr(source.workload, "hold_batch", None))
        result.metrics = dict(record["metrics"])
        replay_rounds = [statistics.median(r) for r in record["side_by_side"]["replay_ms"]]
        result.metrics["throughput"] = 1e3 / result.metrics["replay_step_ms"]
        result.metrics["throughput_cv"] = _cv_pct(replay_rounds) / 100.0
        result.metrics["step_time_ms_p50"] = result.metrics["replay_step_ms"]
        if not record["side_by_side"]["fidelity_valid"] and tracker is not None and result.run_id:
            tracker.set_tags(result.run_id, {"fidelity_invalid_reason": record["side_by_side"]["invalid_reason"]})
    except KeyboardInterrupt as err:
        status, reason = STATUS_KILLED, f"interrupted by {signal_name(err)}"
        raise
    except Exception as err:  # noqa: BLE001 - any failure ends the run FAILED, with its reason
        status, reason = STATUS_FAILED, f"{type(err).__name__}: {err}"
        if main:
            write_atomic(run_dir / "error.txt", traceback.format_exc())
    finally:
        with deferred_interrupts():  # the run folder and the store tell one story
            source.workload.teardown()
            result.status, result.error = status, reason
            if main:
                write_and_publish(result, tracker, {"status": status, "error": reason, "metrics": result.metrics})
    return result
