"""``cobench suite NAME``: run every benchmark of a suite under one MLflow parent run.

All benchmark configs are composed and validated before the first one runs, so a typo in the
tenth benchmark costs nothing. Each benchmark becomes a child run of the suite's parent run.
"""

from __future__ import annotations

import time

from harness.config import CobenchConfig, compose_config, to_run_config
from harness.distributed import env_dist_info
from harness.runner import (
    STATUS_FAILED,
    STATUS_FINISHED,
    STATUS_KILLED,
    BenchmarkResult,
    connect_tracker,
    run_benchmark,
)


def plan_suite(name: str, overrides: list[str]) -> tuple[CobenchConfig, list[tuple[str, CobenchConfig]]]:
    """The suite's config and each benchmark's validated config; raises ValueError on bad input."""
    base = to_run_config(compose_config([f"suite={name}", *overrides]))
    if base.suite is None:
        raise ValueError(f"suite {name!r} is empty: conf/suite/{name}.yaml needs name and benchmarks")
    plans = []
    for bench in base.suite.benchmarks:
        bench_overrides = [f"workload={bench.workload}", *bench.overrides, *overrides]
        plans.append((bench.name, to_run_config(compose_config(bench_overrides))))
    return base, plans


def run_suite(name: str, overrides: list[str]) -> tuple[list[BenchmarkResult], float]:
    """Run suite ``name``; returns the results and the suite's wall time in seconds."""
    base, plans = plan_suite(name, overrides)
    assert base.suite is not None
    tracker = connect_tracker(base)
    main = env_dist_info().is_main
    parent_id = None
    if tracker is not None and main:
        tags = {"suite": name, "suite_version": base.suite.version, "kind": "suite"}
        parent_id = tracker.start_run(f"suite-{name}", tags)
    started = time.perf_counter()
    results: list[BenchmarkResult] = []
    try:
        for bench_name, cfg in plans:
            results.append(
                run_benchmark(cfg, benchmark=bench_name, suite=name, parent_run_id=parent_id, tracker=tracker)
            )
    except KeyboardInterrupt:
        if parent_id:
            tracker.end_run(parent_id, STATUS_KILLED, "KeyboardInterrupt: interrupted by the user")
        raise
    wall_s = time.perf_counter() - started
    if parent_id:
        failed = [r.benchmark for r in results if r.status != STATUS_FINISHED]
        metrics = {"suite_wall_s": wall_s, "benchmarks_failed": float(len(failed))}
        for r in results:
            if "throughput" in r.metrics:
                metrics[f"{r.benchmark}.throughput"] = r.metrics["throughput"]
        tracker.log_metrics(parent_id, metrics)
        if results:
            tracker.set_tags(parent_id, {"platform": results[0].platform})
        reason = f"failed benchmarks: {', '.join(failed)}" if failed else None
        tracker.end_run(parent_id, STATUS_FAILED if failed else STATUS_FINISHED, reason)
    return results, wall_s
