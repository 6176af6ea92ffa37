"""Run one benchmark end to end: platform, process group, workload, repetitions, results.

Order matters for "bad input costs nothing": the config is validated, the workload is built
(its own checks against world size etc.) and the tracking store is reached *before* an MLflow
run exists. From then on the MLflow run always ends FINISHED, FAILED or KILLED with the reason,
and the local run folder (resolved config, fingerprint, MLPerf logs, metrics.json) survives
whatever happens.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from harness.config import CobenchConfig, RunnerConfig, results_root
from harness.cost import with_serving_cost
from harness.distributed import (
    DistInfo,
    PeerWatch,
    broadcast_from_main,
    env_dist_info,
    gather_to_all,
    init_distributed,
    lost_ranks_settled,
    record_rank,
    record_rank_exit,
)
from harness.files import TEMP_PREFIX, write_atomic
from harness.identity import config_hash
from harness.platform import PeakFlops, Platform, discover_platform
from harness.recording.fingerprint import environment_fingerprint
from harness.recording.mlperf_log import MLPerfLogWriter
from harness.recording.tracking import Tracker, TrackingError
from harness.running.interrupts import deferred_interrupts, signal_name
from harness.running.loop import RepetitionState, run_repetition, seed_everything
from harness.running.metrics import benchmark_metrics, mfu_doubt, noise_verdict
from harness.running.progress import step_progress
from workloads import discover
from workloads.base import RunContext, Workload, WorkloadSpec
from workloads.device import empty_cache

logger = logging.getLogger(__name__)


def _not_fx_tracing_notice(record: logging.LogRecord) -> bool:
    """torch.fx's notice that ``is_fx_tracing`` also covers torch.export, logged the first time TorchRec's
    modules ask it (every DLRM and seqrec run): advice to TorchRec's authors, nothing a user can act on."""
    return not record.getMessage().startswith("is_fx_tracing will return true")


logging.getLogger("torch.fx._symbolic_trace").addFilter(_not_fx_tracing_notice)

STATUS_FINISHED, STATUS_FAILED, STATUS_KILLED = "FINISHED", "FAILED", "KILLED"
STATUS_SKIPPED = "SKIPPED"  # a suite's benchmark this platform cannot run; no MLflow run is made


@dataclass
class BenchmarkResult:
    """What a run produced, for the summary table and for callers (suites, tests)."""

    benchmark: str
    workload: str
    platform: str
    status: str
    throughput_unit: str
    run_dir: Path | None  # None: the benchmark never started (SKIPPED)
    run_id: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    losses: list[float] = field(default_factory=list)  # train loss per step: repetition 0, rank 0
    noise: str | None = None  # why the figures are too noisy to trust (tag noisy=1), or None
    mfu_doubt: str | None = None  # why the MFU is not credible (tag mfu_suspect=1), or None
    upload_error: str | None = None  # the store could not take the run: it waits in run_dir (cobench upload)

    def to_json(self) -> str:
        """This result as JSON: how a job on another node (a Hydra launcher's) hands it back."""
        return json.dumps({**dataclasses.asdict(self), "run_dir": str(self.run_dir) if self.run_dir else None})

    @classmethod
    def from_json(cls, text: str) -> BenchmarkResult:
        fields = json.loads(text)
        return cls(**{**fields, "run_dir": Path(fields["run_dir"]) if fields["run_dir"] else None})


RUNS_FOLDER = "runs"  # a results folder's runs: <results>/runs/<time>-<name>-<id>/


def new_run_dir(root: Path, name: str) -> str:
    """A fresh folder name for this run's files (created only once the run really starts)."""
    return str(root / RUNS_FOLDER / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{uuid.uuid4().hex[:6]}")


def results_root_of(run_dir: Path) -> Path:
    """The results folder a run folder made by :func:`new_run_dir` lives in."""
    return Path(run_dir).parent.parent


@dataclass
class OpenedWorkload:
    """What running and capturing share before a step runs: the platform, this process's place in
    the process group, the run context and the workload ``cfg`` names, built against that context."""

    platform: Platform
    dist: DistInfo
    ctx: RunContext
    spec: WorkloadSpec
    workload: Workload


def join_process_group(cfg: CobenchConfig) -> tuple[Platform, DistInfo]:
    """This process's platform, and its place in the process group (joined once per process)."""
    platform = discover_platform(cfg.platform, env_dist_info().local_rank)
    return platform, init_distributed(platform.device, cfg.platform.dist_backend)


def open_workload(cfg: CobenchConfig, work_dir: Path,
                  joined: tuple[Platform, DistInfo] | None = None) -> OpenedWorkload:
    """Build the workload ``cfg`` names on this platform (:func:`join_process_group`, unless ``joined`` already).

    The workload's constructor checks its config against the context (world size, device):
    :class:`~workloads.base.PlatformUnsupported` when this platform cannot run it, ValueError when
    the config is wrong; nothing is written and no run exists yet.
    """
    platform, dist_info = joined or join_process_group(cfg)
    ctx = RunContext(
        device=platform.device,
        seed=cfg.seed,
        rank=dist_info.rank,
        world_size=dist_info.world_size,
        process_group=torch.distributed.group.WORLD if dist_info.enabled else None,
        deterministic=cfg.deterministic,
        work_dir=work_dir,
        device_name=platform.device_name,
        warmup_steps=cfg.runner.warmup_steps,
    )
    spec = discover()[cfg.workload.name]
    return OpenedWorkload(platform, dist_info, ctx, spec, spec.factory(cfg.workload, ctx))


@contextmanager
def set_up_workload(cfg: CobenchConfig, work_dir: Path) -> Iterator[OpenedWorkload]:
    """The workload ``cfg`` names, opened (:func:`open_workload`), seeded and set up for the ``with`` block, and
    torn down after it whatever happens: how a probe measures one thing of a workload outside a run."""
    opened = open_workload(cfg, work_dir)
    seed_everything(cfg.seed, cfg.deterministic)
    opened.workload.setup()
    try:
        yield opened
    finally:
        opened.workload.teardown()


def connect_tracker(cfg: CobenchConfig) -> Tracker | None:
    """Rank 0 opens the tracking store; every rank learns whether that worked."""
    error, tracker = None, None
    if env_dist_info().is_main and cfg.tracking.enabled:
        try:
            tracker = Tracker.connect(cfg.tracking, results_root(cfg))
        except TrackingError as err:
            error = str(err)
    error = broadcast_from_main(error)
    if error:
        raise TrackingError(error)
    return tracker


def run_benchmark(
    cfg: CobenchConfig,
    *,
    benchmark: str | None = None,
    suite: str = "",
    parent_run_id: str | None = None,
    tracker: Tracker | None = None,
    connect: bool = True,
    derived: Callable[[dict[str, float]], dict[str, float]] | None = None,
) -> BenchmarkResult:
    """Run ``cfg`` (already validated) and return its result; raises ValueError on bad input.

    ``derived``: metrics computed from the finished run's (e.g. a suite's deltas against its
    baseline), logged with them before the run is closed.

    ``tracker``: an open store (a suite's); else, with ``connect``, one is opened here (on rank 0;
    every rank must pass the same ``connect``, since connecting is collective).

    KeyboardInterrupt propagates after the MLflow run is closed as KILLED.
    """
    name = benchmark or cfg.workload.name
    derived = with_serving_cost(derived, cfg.platform.cost)  # cost per token, where the platform declares it
    joined = join_process_group(cfg)
    run_dir = Path(broadcast_from_main(new_run_dir(results_root(cfg), name) if joined[1].is_main else None))
    opened = open_workload(cfg, run_dir, joined)  # validates against the context before any run exists
    platform, dist_info = opened.platform, opened.dist
    if tracker is None and connect:
        tracker = connect_tracker(cfg)
    main = dist_info.is_main
    if main:
        run_dir.mkdir(parents=True)
    if dist_info.enabled:
        torch.distributed.barrier()  # ctx.work_dir exists before any rank uses it
        record_rank(run_dir, dist_info.rank)
    result = BenchmarkResult(name, opened.spec.name, platform.name, STATUS_FINISHED, opened.workload.throughput_unit,
                             run_dir)
    peak = _open_benchmark_run(cfg, result, opened, tracker, suite, parent_run_id) if main else None

    repetitions: list[list[RepetitionState]] = []
    unfinished: list[RepetitionState] = []  # the repetition under way, if any

    def close_failed(reason: str) -> None:
        _finish(result, tracker, repetitions, unfinished, peak, STATUS_FAILED, reason, runner=cfg.runner)

    # the main rank closes the run itself should a peer die while it is stuck where no signal reaches it
    watch = PeerWatch(run_dir, close_failed).start() if dist_info.enabled and main else None
    try:
        _run_repetitions(cfg, opened, name, repetitions, unfinished)
    except KeyboardInterrupt as err:
        # A second signal (torchrun's SIGTERM after the user's, or after a peer died) waits until the run
        # is closed: it must not cut the look at the peers, nor leave the run to be closed as KILLED.
        with deferred_interrupts():
            if watch is not None and not watch.claim():
                raise
            status, reason = STATUS_KILLED, f"interrupted by {signal_name(err)}"
            if dist_info.enabled:
                record_rank_exit(run_dir, dist_info.rank, reason)
                lost = lost_ranks_settled(run_dir)
                if lost:  # torchrun stops the survivors of a rank that died: the run failed, not cancelled
                    status = STATUS_FAILED
                    reason = f"{', '.join(lost)} died (no longer running) during the run; then this rank was {reason}"
            _finish(result, tracker, repetitions, unfinished, peak, status, reason, runner=cfg.runner)
        raise
    except Exception as err:  # noqa: BLE001 - any failure must end the run FAILED, with its reason
        # torchrun SIGTERMs this rank right after a peer died, often while this rank is here, having
        # seen its collective fail: the signal waits until the run is closed FAILED, then propagates.
        with deferred_interrupts():
            if watch is not None and not watch.claim():
                return result
            reason = f"{type(err).__name__}: {err}"
            lost = lost_ranks_settled(run_dir) if dist_info.enabled else []
            if lost:  # a collective failed because a peer died: say which, first
                reason = f"{', '.join(lost)} died (no longer running) during the run; this rank saw: {reason}"
            if main:
                write_atomic(run_dir / "error.txt", traceback.format_exc())
            close_failed(reason)
        return result
    finally:
        if watch is not None:
            watch.stop()
    if watch is None or watch.claim():
        _finish(result, tracker, repetitions, [], peak, STATUS_FINISHED, None, derived, runner=cfg.runner,
                peak_again=lambda: platform.peak_flops_measured_again(opened.workload.compute_dtype))
    return result


def _open_benchmark_run(cfg: CobenchConfig, result: BenchmarkResult, opened: OpenedWorkload, tracker: Tracker | None,
                        suite: str, parent_run_id: str | None) -> PeakFlops | None:
    """Open the run (main rank) with the peak FLOP/s it is measured against; returns that peak."""
    peak = opened.platform.peak_flops(opened.workload.compute_dtype)
    tags = {**(peak.tags() if peak else {"peak_flops_source": "unknown"}),
            **opened.workload.run_tags()}  # e.g. a replay's source and portability
    open_run(cfg, result, opened.platform, opened.dist.world_size, tracker, tags=tags, suite=suite,
             parent_run_id=parent_run_id)
    if tracker is not None and peak is not None and peak.value:
        tracker.log_metrics(result.run_id, {"peak_flops": peak.value})
    return peak


def _run_repetitions(cfg: CobenchConfig, opened: OpenedWorkload, name: str,
                     repetitions: list[list[RepetitionState]], unfinished: list[RepetitionState]) -> None:
    """Every repetition on a fresh workload (seed ``seed + i``), one MLPerf log each: each finished one's
    every rank's state lands in ``repetitions``; ``unfinished`` holds the one under way, for a run cut short."""
    ctx, spec, workload, platform = opened.ctx, opened.spec, opened.workload, opened.platform
    main = opened.dist.is_main
    run_dir = ctx.work_dir
    total_steps = cfg.runner.repetitions * (cfg.runner.warmup_steps + cfg.runner.steps)
    with step_progress(f"{name} on {platform.name}", total_steps,
                       enabled=main and cfg.runner.progress) as advance:
        for rep in range(cfg.runner.repetitions):
            rep_ctx = dataclasses.replace(ctx, seed=cfg.seed + rep)
            if rep > 0:
                workload = spec.factory(cfg.workload, rep_ctx)
            writer = MLPerfLogWriter(run_dir / f"mllog_rep{rep}.txt") if main else None
            state = RepetitionState(repetition=rep)
            unfinished[:] = [state]
            try:
                run_repetition(workload, cfg, rep_ctx, writer, state, platform.name, advance)
            finally:
                workload.teardown()
                if ctx.is_accelerator:  # the next repetition (or a sweep's next run) starts with the memory free
                    gc.collect()
                    empty_cache(ctx.device)
                if writer is not None:
                    writer.close()
            repetitions.append(gather_to_all(state))
            unfinished.clear()


@deferred_interrupts()  # signals wait until the run folder and the store tell one story
def _finish(
    result: BenchmarkResult,
    tracker: Tracker | None,
    repetitions: list[list[RepetitionState]],
    unfinished: list[RepetitionState],
    peak: PeakFlops | None,
    status: str,
    reason: str | None,
    derived: Callable[[dict[str, float]], dict[str, float]] | None = None,
    *,
    runner: RunnerConfig,
    peak_again: Callable[[], PeakFlops] | None = None,
) -> None:
    """Compute metrics from whatever was measured, write them locally, close the MLflow run (before
    its artifacts are uploaded, the slow part). ``peak_again``: measures the peak once more, for a run
    whose MFU came out above what its platform credibly reaches."""
    result.status, result.error = status, reason
    measured = repetitions + ([unfinished] if unfinished and unfinished[0].step_times_s else [])
    peak_tags: dict[str, str] = {}
    if measured:
        result.metrics = benchmark_metrics(measured, result.throughput_unit, peak.value if peak else None)
        if peak is not None and peak_again is not None and result.metrics.get("mfu", 0.0) > peak.mfu_ceiling:
            # A measured peak is a lower bound: taken while other work held the cores (OpenMP threads that
            # lose their core stall every GEMM thread at its barrier) it read a sixth of the CPU's, and a
            # tiny llama run's 16 % MFU read 105 %. The run itself says so: the peak is measured again, now.
            peak = peak_again()
            peak_tags = peak.tags()
            result.metrics = benchmark_metrics(measured, result.throughput_unit, peak.value)
        if peak is not None and peak.value:
            result.metrics["peak_flops"] = peak.value
        result.losses = list(measured[0][0].losses)  # the trajectory users (and qualify) compare
    if derived is not None and status == STATUS_FINISHED:
        result.metrics.update(derived(result.metrics))
    if measured:
        result.noise = noise_verdict(result.metrics, runner.noise_step_cv_max, runner.noise_rep_cv_max)
        result.metrics["noisy"] = float(result.noise is not None)
        if peak is not None and "mfu" in result.metrics:
            result.mfu_doubt = mfu_doubt(result.metrics, peak.mfu_ceiling, peak.conditions.get("doubt"))
            result.metrics["mfu_suspect"] = float(result.mfu_doubt is not None)
    if not env_dist_info().is_main:
        return
    first = measured[0][0] if measured else None
    record = {"status": status, "error": reason, "metrics": result.metrics, "losses": result.losses,
              "quality_history": [[n, q] for n, q in first.quality_history] if first else [],
              "noise": result.noise, "mfu_doubt": result.mfu_doubt, **({"peak_tags": peak_tags} if peak_tags else {})}
    write_and_publish(result, tracker, record)


def open_run(cfg: CobenchConfig, result: BenchmarkResult, platform: Platform, world_size: int,
             tracker: Tracker | None, *, tags: dict | None = None, params: dict | None = None, suite: str = "",
             parent_run_id: str | None = None) -> dict:
    """Open a run (main rank): its folder ``result.run_dir`` with ``config.yaml`` and ``fingerprint.json``,
    and, with a store, its MLflow run (``result.run_id``) with the tags every run carries plus ``tags``,
    and ``params`` (default: the whole config). Every kind of run opens here and ends in
    :func:`write_and_publish`; returns the environment fingerprint."""
    run_dir = result.run_dir
    assert run_dir is not None, "a run that opens has a folder"
    c_hash = config_hash(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    fingerprint = environment_fingerprint(platform, c_hash, world_size)
    write_atomic(run_dir / "fingerprint.json", json.dumps(fingerprint, indent=2))
    if tracker is not None:
        every = {"benchmark": result.benchmark, "workload": result.workload, "suite": suite,
                 "platform": platform.name, "device_name": platform.device_name, "git_sha": fingerprint["git_sha"],
                 "git_dirty": fingerprint["git_dirty"], "torch_version": torch.__version__, "config_hash": c_hash,
                 "throughput_unit": result.throughput_unit, "world_size": world_size, "nodes": fingerprint["nodes"]}
        result.run_id = tracker.start_run(cfg.run_name or result.benchmark, {**every, **(tags or {})}, parent_run_id)
        tracker.log_params(result.run_id, params if params is not None
                           else OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
    return fingerprint


def write_and_publish(result: BenchmarkResult, tracker: Tracker | None, record: dict) -> None:
    """Write the run folder's ``metrics.json`` (``record``: status, error, metrics ...), then record it in
    the MLflow run (:func:`publish`); if the store is away, the folder says so and keeps everything for
    ``cobench upload``. Every kind of run ends here, the fidelity judgement's included."""
    if tracker is not None and result.run_id is not None:
        record["mlflow"] = {"uri": tracker.uri, "experiment_id": tracker.experiment_id, "run_id": result.run_id}
    record.setdefault("logged_at_ms", int(time.time() * 1000))  # one timestamp: publishing again adds no rows
    write_atomic(result.run_dir / "metrics.json", json.dumps(record, indent=2))
    if tracker is None or result.run_id is None:
        return
    try:
        publish(tracker, result.run_dir)
    except Exception as err:  # noqa: BLE001 - the store went away or refused: the run folder keeps everything
        result.upload_error = tracker.failure(err)
        write_atomic(result.run_dir / UPLOAD_PENDING, json.dumps({"error": result.upload_error}, indent=2))
        logger.warning("could not record %s in MLflow (%s); everything is in %s: upload it later with "
                       "`cobench upload %s`", result.benchmark, result.upload_error, result.run_dir, result.run_dir)


UPLOAD_PENDING = "upload_pending.json"  # in a run folder: the store did not get the run; `cobench upload`


def publish(tracker: Tracker, run_dir: Path) -> None:
    """Record a closed run folder in its MLflow run: metrics, curves, tags, the end status, then the
    files (the run is closed before its artifacts are uploaded, the slow part). Used at the end of
    every run and by ``cobench upload`` for runs whose store was away."""
    record = json.loads((run_dir / "metrics.json").read_text())
    run_id = record["mlflow"]["run_id"]
    # the record's own timestamp on every value: a publish interrupted and done again (`cobench upload`, twice
    # at once even) rewrites identical rows, which MLflow's store keeps once
    at_ms = record.get("logged_at_ms")
    tracker.log_metrics(run_id, record["metrics"], timestamp_ms=at_ms)
    if record.get("noise"):
        tracker.set_tags(run_id, {"noisy": "1", "noise_reason": record["noise"]})
    if record.get("mfu_doubt"):
        tracker.set_tags(run_id, {"mfu_suspect": "1", "mfu_suspect_reason": record["mfu_doubt"]})
    if record.get("peak_tags"):  # the peak measured again at the run's end: the conditions of the figure used
        tracker.set_tags(run_id, record["peak_tags"])
    if record.get("losses"):
        tracker.log_series(run_id, "train_loss", record["losses"], timestamp_ms=at_ms)
    for samples_count, quality in record.get("quality_history", []):
        tracker.log_metrics(run_id, {f"{k}_curve": v for k, v in quality.items()}, step=samples_count,
                            timestamp_ms=at_ms)
    tracker.end_run(run_id, record["status"], record.get("error"))
    for path in sorted(run_dir.iterdir()):  # files; folders (a fidelity run's trace bundle) stay local
        if path.is_file() and path.name != UPLOAD_PENDING and not path.name.startswith(TEMP_PREFIX):
            tracker.log_artifact(run_id, path)
    (run_dir / UPLOAD_PENDING).unlink(missing_ok=True)
