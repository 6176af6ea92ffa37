"""Side-by-side fidelity: the replay judged against its source program in the same process.

Two processes of the same program, minutes apart, differ by up to 44 % in step time on a shared 2-core VM,
so a replay judged against a capture taken in another process measures the machine as much as the replay.
Here the source and its replay run in one process, interleaved in rounds of K samples a side, taking turns a
sample at a time (the order of each pair of turns, and of each round, the other way round to the one before)
— so machine drift lands on both sides alike. The figure is taken within rounds: the median over rounds of
each round's ratio of the two sides' median steps, with a 95 % interval from a bootstrap drawing pairs of
consecutive rounds, one in each order (so drift between rounds does not widen it). Short steps are timed in
batches (a sample lasts at least 20 ms), and the judge adds rounds until the interval's half-width is within
±2.5 % or its time budget (60 s by default) runs out: only then is the figure declared invalid, with the
interval it reached. A replay that did not run every op as captured is never a valid verdict
either. The interleaved timing and its verdict are :mod:`harness.traces.side_by_side`; each side's
memory peak, :mod:`harness.traces.allocator_peaks`.

    from harness.traces.judge import judge
    record = judge(train_step, "traces/mine", model=model)   # capture → generate → side by side

``cobench trace fidelity workload=<name>`` does the same for a registered workload, as one MLflow run.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from harness.config import CobenchConfig, results_root
from harness.distributed import broadcast_from_main, env_dist_info
from harness.files import write_atomic
from harness.platform import device_name
from harness.recording.tracking import Tracker
from harness.running.interrupts import deferred_interrupts, signal_name
from harness.running.runner import (
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
from harness.traces.allocator_peaks import captured_step_peak_bytes, step_memory_peak_bytes
from harness.traces.capture import capture, prepare_source
from harness.traces.side_by_side import (
    HostProbe,
    SideBySide,
    capture_shift_parts,
    cv_pct,
    host_time_probe,
    interleave,
)
from workloads import discover
from workloads.base import RunContext, WorkloadSpec
from workloads.trace_bundle import rank_dirs, read_meta
from workloads.trace_replay.host_time import EventWeights, bundle_weights

MEMORY_STEPS = 8  # each side's peak memory: the most of this many of its own steps (or every captured one)

FIDELITY_FILE = "fidelity.json"
DEFAULT_BUDGET_S = 60.0  # the side-by-side rounds' time budget, by default
CAPTURE_HOST_SHARE = 0.5  # of that budget, what its capture may spend on host-time rounds past MAX_TIMING_ROUNDS
CALIBRATION_SHARE = 0.25  # ... and each of the replay's calibrations on rounds past its 24 (workload.calibration_s)


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
    # the replay's calibrations are measurements its figure rests on, as the capture's host time is: given
    # time to narrow them as the capture is
    options = {"calibration_s": CALIBRATION_SHARE * budget_s if budget_s else 0.0, **(replay_options or {})}
    replay = spec.factory.from_bundle(bundle, ctx, **options)
    replay.setup()
    try:
        dirs = rank_dirs(bundle)
        rank_dir = dirs[min(ctx.rank, len(dirs) - 1)]
        meta = read_meta(rank_dir)
        agree = _rank0_value(ctx.process_group) if ctx.distributed else None
        side = interleave(source_step, replay.step, ctx.device, rounds=rounds, steps_per_round=steps_per_round,
                          warmup=warmup, seed=ctx.seed, budget_s=budget_s, agree=agree,
                          replay_shift_parts_ms=capture_shift_parts(getattr(replay, "replayer", None), seed=ctx.seed),
                          prepare={"replay": replay.restore_values} if hasattr(replay, "restore_values") else None,
                          host=_host_probe(source_step, replay, ctx.device, agree,
                                           bundle_weights(meta)),
                          start_together=(lambda: torch.distributed.barrier(group=ctx.process_group))
                          if ctx.distributed else None)
        # Each captured step at least once, and never fewer than MEMORY_STEPS: a program whose steps differ
        # by chance (LayerDrop skipping a layer, a data-dependent branch) peaks on its largest step, which
        # a few of its own steps can all miss (Wav2Vec2: 7.1 MB in ~1 step of 5, 12.3 MB otherwise).
        memory_steps = max(len(meta.traced_step_times_s), MEMORY_STEPS)
        # Each side's peak over that many of its own steps, measured alike: the program as it goes on, not only
        # the few steps the capture traced (a program peaks on its largest step). Except for a workload that
        # holds its traced batch (its op shapes follow its data): its captured steps' peak (its own steps over
        # fresh batches had its data pipeline's next ones made beside them: seqrec 10.8 MB where its captured
        # steps held 6.8), run again without the execution-trace observer, whose copies of integer inputs
        # are allocations too (captured_step_peak_bytes).
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
    record = _fidelity_record(replay.record, side, source_peak, replay_peak, captured_peak)
    if ctx.rank == 0:
        write_atomic(ctx.work_dir / FIDELITY_FILE, json.dumps(record, indent=2))
    return record


def capture_host_s(budget_s: float | None) -> float:
    """What a judgement's capture may spend in all on host-time rounds past the 32 any capture may run: half the
    judgement's budget (none without one). The replay spends the host time they measure, and what is left of
    their median's uncertainty moves its figure as much (``capture_host_half_width_pct``)."""
    return CAPTURE_HOST_SHARE * budget_s if budget_s else 0.0


def _host_probe(source_step: Callable[[], Any], replay: Any, device: torch.device,
                agree: Callable[[Any], Any] | None, weights: EventWeights | None) -> HostProbe | None:
    """What measures each side's host time and op time again while they are judged, where the replay spends
    the capture's host time (None where it spends none, or the capture measured none); ``agree``: see
    :func:`~harness.traces.side_by_side.host_time_probe`; ``weights``: the profiler's cost by kind of event
    the capture measured, which the program's steps are split by as the capture split them (the replay's
    are split alike, as its calibrations split them)."""
    replayer, replay_step = getattr(replay, "replayer", None), replay.step
    if replayer is None or not getattr(replayer, "host_gaps", False) or not replayer.gap_samples_us:
        return None
    replayed = {op.name for op in replayer.ops}
    return HostProbe(host_time_probe(source_step, device, replayed, agree=agree, weights=weights),
                     host_time_probe(replay_step, device, replayed, prepare=getattr(replay, "restore_values", None),
                                     agree=agree),
                     capture_ms=statistics.median(replayer.gap_samples_us) / 1e3,
                     spun_ms=1e3 * replayer.runner.spun_s(), scale=lambda: _speed_scale(replayer),
                     autograd_ms=1e3 * replayer.spent_grad_ops_per_step * replayer.autograd_s)


def _speed_scale(replayer: Any) -> float:
    """The median scale the replay has spent its host time at so far (1 where it reads no host speed)."""
    speed = replayer.runner.speed
    return statistics.median(speed.scales) if speed is not None and speed.scales else 1.0


def _fidelity_record(replay_record: dict[str, Any], side: SideBySide, source_peak: int, replay_peak: int,
                     captured_peak: int | None) -> dict[str, Any]:
    """The replay workload's record with the side-by-side judgement of time and memory in place of the
    cross-process one (kept, for reference, under ``cross_process_against_capture``)."""
    record = copy.deepcopy(replay_record)
    cross = {k: record["metrics"].pop(k) for k in ("time_error_pct", "time_error_signed_pct", "reference_step_ms",
                                                   "reference_step_cv_pct", "replay_step_ms", "replay_step_cv_pct")
             if k in record["metrics"]}
    # a replay that did not run every op as captured, or of steps unlike the program's, is no verdict on time
    for key, what in (("unfaithful", "the replay is not the program"), ("unrepresentative", "not the program's steps")):
        if record.get(key):
            side.fidelity_valid = False
            side.invalid_reason = "; ".join(r for r in (f"{what}: {record[key]}", side.invalid_reason) if r)
    if record.get("nonfinite") and record["nonfinite"] not in side.notes:
        side.notes.append(record["nonfinite"])
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
    if captured_peak is not None:  # for reference: the traced steps' own (captured_step_peak_bytes)
        record["metrics"]["captured_step_peak_mb"] = captured_peak / 2**20
    record["judgement"] = "side_by_side"
    drawn = ("source_ms", "replay_ms", "replay_shift_ms", "replay_shift_parts_ms", "host")
    record["side_by_side"] = {k: v for k, v in asdict(side).items() if k not in drawn}
    record["side_by_side"]["source_ms"], record["side_by_side"]["replay_ms"] = side.source_ms, side.replay_ms
    record["cross_process_against_capture"] = cross  # for reference: what the old judgement said
    return record


def _rank0_value(group: Any) -> Callable[[Any], Any]:
    def agree(value: Any) -> Any:
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0, group=group)
        return box[0]

    return agree


def judge(step: Callable[[], Any], out_dir: str | Path, *, device: torch.device | str | None = None,
          model: torch.nn.Module | None = None, rounds: int = 10, steps_per_round: int = 10, warmup: int = 5,
          capture_steps: int = 3, baseline_steps: int = 20, source: str = "program",
          replay_options: dict[str, Any] | None = None, verbose: bool = True,
          budget_s: float | None = DEFAULT_BUDGET_S) -> dict[str, Any]:
    """Capture ``step`` (your callable running one training step), generate its spec, and judge the replay
    side by side with ``step`` in this process (see :mod:`harness.traces.judge`).

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
                 source=source, model=model, announce=False, host_rounds_s=capture_host_s(budget_s)) as cap:
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
            f"memory {m.get('memory_error_pct', math.nan):+.1f} %: {verdict}"
            + "".join(f" ({note})" for note in side.get("notes", [])))


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
        source.capture(bundle, steps=capture_steps, warmup=warmup, baseline_steps=baseline_steps, announce=False,
                       host_rounds_s=capture_host_s(budget_s))
        if ctx.distributed:
            torch.distributed.barrier()  # every rank's bundle is written
        # A workload whose op shapes follow its data held its traced batch through the capture, and the replay
        # runs that batch's shapes: the source steps it too while judged, or each side would run other work
        # (seqrec's steps ran 15–32 ms, p10 to p90, over fresh batches; the replay of its traced one 16–22).
        hold = getattr(source.workload, "hold_batch", None)
        if hold is not None:
            hold(True)  # nothing ran since the capture: the batch it hands out last is the traced one
        try:
            record = judge_bundle(source.workload.step, bundle, ctx, rounds=rounds, steps_per_round=steps_per_round,
                                  warmup=warmup, budget_s=budget_s, hold_batch=hold)
        finally:
            if hold is not None:
                hold(False)
        result.metrics = dict(record["metrics"])
        replay_rounds = [statistics.median(r) for r in record["side_by_side"]["replay_ms"]]
        result.metrics["throughput"] = 1e3 / result.metrics["replay_step_ms"]
        result.metrics["throughput_cv"] = cv_pct(replay_rounds) / 100.0
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
