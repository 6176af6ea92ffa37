"""Every benchmark of a suite under one MLflow parent run (``cobench suite NAME``: :func:`suite.launch.suite_main`).

All benchmark configs are composed and validated before the first one runs, so a typo in the
tenth benchmark costs nothing. Each benchmark becomes a child run of the suite's parent run. A
benchmark this platform cannot run (e.g. a CUDA-only codec on a CPU) is SKIPPED with its reason;
the others still run. A generated trace benchmark (an entry with ``capture:``) is captured from
its source workload on this platform, and its replay judged side by side with the source in one
process (:mod:`harness.traces.judge`): its run holds the replay's speed and the fidelity figures.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from harness.config import CobenchConfig, SuiteBenchmark, SuiteConfig, compose_config, results_root, to_run_config
from harness.distributed import env_dist_info
from harness.recording.tracking import Tracker
from harness.running.interrupts import deferred_interrupts, signal_name
from harness.running.runner import (
    STATUS_FAILED,
    STATUS_FINISHED,
    STATUS_KILLED,
    STATUS_SKIPPED,
    BenchmarkResult,
    connect_tracker,
    join_process_group,
    open_workload,
    run_benchmark,
)
from harness.traces.judge import judge_benchmark
from workloads import discover
from workloads.base import PlatformUnsupported

CAPTURE_STEPS, CAPTURE_WARMUP, CAPTURE_BASELINE = 3, 10, 50
Derived = Callable[[dict[str, float]], dict[str, float]]  # a run's extra metrics from its own (deltas)


@dataclass
class Plan:
    """One benchmark of a suite, validated: its config and, for a generated benchmark, its source's."""

    name: str
    cfg: CobenchConfig
    source: CobenchConfig | None = None  # the workload to capture and judge beside (entries with `capture:`)
    rounds: int = 10
    round_steps: int = 10
    budget_s: float = 60.0
    skip: str | None = None  # why this platform cannot run it (the benchmark is SKIPPED), or None


@dataclass
class SuiteOutcome:
    results: list[BenchmarkResult]
    wall_s: float
    suite: SuiteConfig
    parent_run_id: str | None
    tracker: Tracker | None


def suite_level(overrides: list[str]) -> list[str]:
    """The overrides that apply to the suite's own config: workload.* ones are for the benchmarks'
    workloads, not the default one (`suite dlrm_codecs workload.preset=a2a` must not be read as llama's)."""
    return [o for o in overrides if not o.lstrip("+~").startswith("workload")]


def plan_suite(name: str, overrides: list[str]) -> tuple[CobenchConfig, list[Plan]]:
    """The suite's config and each benchmark's validated plan, before anything runs.

    Every config is composed and every workload built once against this platform and launch (the
    process group is joined here): a benchmark this platform cannot run is planned SKIPPED with the
    reason; any other error is bad input and raises ValueError naming the benchmark.
    """
    base = to_run_config(compose_config([f"suite={name}", *suite_level(overrides)]))
    if base.suite is None:
        raise ValueError(f"suite {name!r} is empty: conf/suite/{name}.yaml needs name and benchmarks")
    joined = join_process_group(base)
    chosen = [b for b in base.suite.benchmarks if not base.suite.only or b.name in base.suite.only]
    for override in overrides:  # a workload.* override must fit some benchmark: a typo fits none
        key = _workload_key(override)
        if key is not None and not any(key in _workload_fields(w) for b in chosen for w in _workloads_of(b)):
            names = sorted({w for b in chosen for w in _workloads_of(b)})
            raise ValueError(f"invalid config 'workload.{key}': no benchmark of suite {name!r} has this key "
                             f"(its workloads: {', '.join(names)}; `cobench list` shows their keys)")
    plans = []
    for bench in chosen:
        try:
            plan = _plan(name, bench, overrides, base)
            checked = plan.source if plan.source is not None else plan.cfg
            open_workload(checked, results_root(base), joined).workload.teardown()
        except PlatformUnsupported as err:
            plan.skip = str(err)
        except ValueError as err:
            raise ValueError(f"suite {name!r}, benchmark {bench.name!r}: {err}") from err
        plans.append(plan)
    return base, plans


def _workload_key(override: str) -> str | None:
    """``x`` for a ``workload.x[.y]=v`` override (not ``workload=NAME``), else None."""
    head = override.lstrip("+~").split("=", 1)[0]
    return head.split(".")[1] if head.startswith("workload.") else None


def _workload_fields(workload: str) -> set[str]:
    return {f.name for f in dataclasses.fields(discover()[workload].config_class)}


def _workloads_of(bench: SuiteBenchmark) -> list[str]:
    """The workloads a suite entry builds: its own, and the source it captures."""
    sources = [o.split("=", 1)[1] for o in bench.capture or [] if o.startswith("workload=")]
    return [bench.workload, *sources]


def _fitting(overrides: list[str], workload: str) -> list[str]:
    """The user's overrides for one benchmark: not the suite's own (suite.*), and a workload.* key only
    where that workload has it (`suite smoke workload.train_batches=2` is for the training workloads)."""
    fields = _workload_fields(workload)
    return [o for o in overrides if not o.lstrip("+~").startswith("suite")
            and (_workload_key(o) is None or _workload_key(o) in fields)]


def _plan(suite: str, bench: SuiteBenchmark, overrides: list[str], base: CobenchConfig) -> Plan:
    bench_overrides = [f"workload={bench.workload}", *bench.overrides, *_fitting(overrides, bench.workload)]
    if bench.capture is None:
        return Plan(bench.name, to_run_config(compose_config(bench_overrides)))
    source = to_run_config(compose_config([*bench.capture, *_fitting(overrides, _workloads_of(bench)[-1])]))
    if discover()[source.workload.name].replays_bundle:
        raise ValueError(f"suite {suite!r}, benchmark {bench.name!r}: capture: must name a source workload")
    bundle = results_root(base) / "traces" / suite / bench.name  # validated now; judged in the run's folder
    cfg = to_run_config(compose_config([*bench_overrides, f"workload.spec={bundle / 'spec.json'}"]))
    return Plan(bench.name, cfg, source, bench.rounds, bench.round_steps, bench.budget_s)


def run_one(plan: Plan, suite: str, parent_id: str | None, tracker: Tracker | None,
            derived: Derived) -> BenchmarkResult:
    """One benchmark of the suite: SKIPPED with the plan's reason, judged against its source (a generated
    benchmark) or run; ``derived`` adds its extra metrics (the deltas to the baseline)."""
    cfg = plan.cfg
    if plan.skip is not None:
        return BenchmarkResult(plan.name, cfg.workload.name, cfg.platform.name, STATUS_SKIPPED, "-", None,
                               error=plan.skip)
    if plan.source is not None:
        return judge_benchmark(plan.source, benchmark=plan.name, rounds=plan.rounds,
                               steps_per_round=plan.round_steps, warmup=CAPTURE_WARMUP,
                               capture_steps=CAPTURE_STEPS, baseline_steps=CAPTURE_BASELINE, suite=suite,
                               parent_run_id=parent_id, tracker=tracker, connect=False, budget_s=plan.budget_s)
    return run_benchmark(cfg, benchmark=plan.name, suite=suite, parent_run_id=parent_id, tracker=tracker,
                         connect=False, derived=derived)


def baseline_deltas(suite: SuiteConfig, results: list[BenchmarkResult]) -> dict[str, dict[str, float]]:
    """``{benchmark: {"<metric>_delta": value − baseline's}}`` for every finished benchmark."""
    by_name = {r.benchmark: r for r in results if r.status == STATUS_FINISHED}
    baseline = by_name.get(suite.baseline or "")
    if baseline is None:
        return {}
    deltas: dict[str, dict[str, float]] = {}
    for result in by_name.values():
        if result is baseline:
            continue
        deltas[result.benchmark] = {
            f"{m}_delta": result.metrics[m] - baseline.metrics[m]
            for m in suite.delta_metrics
            if m in result.metrics and m in baseline.metrics
        }
    return deltas


# how a suite's plans run: (suite, plans, parent run, tracker, each benchmark's Derived, results to append to)
Execute = Callable[[str, list[Plan], str | None, Tracker | None, Callable[[str], Derived], list[BenchmarkResult]],
                   None]


def run_here(suite: str, plans: list[Plan], parent_id: str | None, tracker: Tracker | None,
             deltas_of: Callable[[str], Derived], results: list[BenchmarkResult]) -> None:
    """The benchmarks one after the other in this process (or this torchrun launch)."""
    for plan in plans:
        results.append(run_one(plan, suite, parent_id, tracker, deltas_of(plan.name)))


def run_suite(base: CobenchConfig, plans: list[Plan], execute: Execute | None = None) -> SuiteOutcome:
    """Run a planned suite (:func:`plan_suite`): its results, wall time, config and MLflow parent run.

    ``execute`` runs the plans (default :func:`run_here`; :func:`suite.launch.run_on_launcher` submits
    them as jobs); the parent run is opened before and always closed after, FAILED or KILLED with the
    reason when something went wrong."""
    suite = base.suite
    assert suite is not None
    name = suite.name
    tracker = connect_tracker(base)
    main = env_dist_info().is_main
    parent_id = None
    if tracker is not None and main:
        tags = {"suite": name, "suite_version": suite.version, "kind": "suite"}
        parent_id = tracker.start_run(f"suite-{name}", tags)
    started = time.perf_counter()
    results: list[BenchmarkResult] = []
    # The baseline runs first, so each other benchmark's deltas against it are logged with its run.
    ordered = sorted(plans, key=lambda plan: plan.name != suite.baseline)

    def deltas_of(name: str) -> Derived:
        def derived(metrics: dict[str, float]) -> dict[str, float]:
            probe = BenchmarkResult(name, "", "", STATUS_FINISHED, "", None, metrics=metrics)
            return baseline_deltas(suite, [*results, probe]).get(name, {})
        return derived

    try:
        (execute or run_here)(name, ordered, parent_id, tracker, deltas_of, results)
    except KeyboardInterrupt as err:
        if parent_id and tracker is not None:
            with deferred_interrupts():
                tracker.end_run(parent_id, STATUS_KILLED, f"interrupted by {signal_name(err)}")
        raise
    except Exception as err:  # the parent never stays RUNNING: it ends FAILED with the reason, then the error goes on
        if parent_id and tracker is not None:
            with deferred_interrupts():
                tracker.end_run(parent_id, STATUS_FAILED, f"{type(err).__name__}: {err}")
        raise
    wall_s = time.perf_counter() - started
    deltas = baseline_deltas(suite, results)
    if parent_id and tracker is not None:
        with deferred_interrupts():
            _close_parent(tracker, parent_id, results, deltas, wall_s)
    return SuiteOutcome(results, wall_s, suite, parent_id, tracker)


def _close_parent(tracker: Tracker, parent_id: str, results: list[BenchmarkResult],
                  deltas: dict[str, dict[str, float]], wall_s: float) -> None:
    failed = [r.benchmark for r in results if r.status not in (STATUS_FINISHED, STATUS_SKIPPED)]
    metrics = {"suite_wall_s": wall_s, "benchmarks_failed": float(len(failed)),
               "benchmarks_skipped": float(sum(r.status == STATUS_SKIPPED for r in results))}
    for r in results:
        if "throughput" in r.metrics:
            metrics[f"{r.benchmark}.throughput"] = r.metrics["throughput"]
        metrics.update({f"{r.benchmark}.{k}": v for k, v in deltas.get(r.benchmark, {}).items()})
    tracker.log_metrics(parent_id, metrics)
    if results:
        tracker.set_tags(parent_id, {"platform": results[0].platform})
    reason = f"failed benchmarks: {', '.join(failed)}" if failed else None
    tracker.end_run(parent_id, STATUS_FAILED if failed else STATUS_FINISHED, reason)
