"""``cobench qualify``: run the qualification suite and judge the platform against its gates.

    cobench qualify [--gates FILE] [--golden FILE] [--suite NAME] [OVERRIDES]   → PASS (0) / FAIL (1)
    cobench qualify --record-golden [--runs N] [--golden FILE] [OVERRIDES]       → new golden reference

Gates and golden references are data (``conf/gates/<platform>.yaml``, ``conf/golden/<platform>.yaml``,
see :mod:`suite.gates`). Everything is checked before the suite runs — a platform without gates, a
missing golden, a golden recorded for another suite version or another configuration — and
refused with exit 2: there is no PASS by default. The verdict (``verdict.json``, ``verdict.md``)
goes to ``<results_dir>/qualify/<time>-<platform>/`` and onto the suite's MLflow parent run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from harness.cli import EXIT_FAILED, EXIT_OK
from harness.config import CONF_DIR, CobenchConfig, results_root
from harness.distributed import env_dist_info
from harness.identity import config_hash
from harness.running.runner import STATUS_FINISHED, join_process_group
from suite.gates import (
    GateError,
    GateResult,
    GatesFile,
    evaluate,
    load_gates,
    load_golden,
    median_trajectory,
    write_golden,
)
from suite.runner import Plan, SuiteOutcome, plan_suite, run_suite


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cobench qualify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default="qualify", help="the suite to run (default: qualify)")
    parser.add_argument("--gates", type=Path, help="gates file (default conf/gates/<platform>.yaml)")
    parser.add_argument("--golden", type=Path, help="golden reference (default: the one the gates file names)")
    parser.add_argument("--record-golden", action="store_true",
                        help="run the suite and record its results as the golden reference (trusted runs)")
    parser.add_argument("--runs", type=int, default=1,
                        help="with --record-golden: run the suite N times; the golden is their median (default 1)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. platform=cpu")
    return parser


def _benchmark_hash(plan: Plan) -> str:
    """What a golden reference is valid for: the benchmark's configuration (its source's, for a replay,
    whose spec path moves with the results folder)."""
    return config_hash(plan.source if plan.source is not None else plan.cfg)


def _gates_for(base: CobenchConfig, plans: list[Plan], suite: str, path: Path | None) -> tuple[str, GatesFile]:
    platform = join_process_group(base)[0].name
    path = path or CONF_DIR / "gates" / f"{platform}.yaml"
    if not path.is_file():
        raise GateError(f"platform {platform!r} has no gates: {path} does not exist; write one (see "
                        f"conf/gates/cpu.yaml) or pass --gates FILE")
    gates = load_gates(path, CONF_DIR)
    if gates.suite != suite:
        raise GateError(f"{path} gates suite {gates.suite!r}, not {suite!r}")
    names = [p.name for p in plans]
    ungated = [n for n in names if n not in gates.benchmarks]
    unknown = [n for n in gates.benchmarks if n not in names]
    if ungated or unknown:
        raise GateError(f"{path} does not match suite {suite!r}: ungated benchmarks {ungated}, "
                        f"unknown benchmarks {unknown} (suite has {names})")
    return platform, gates


def _check_golden(golden: dict[str, Any], path: Path, suite: str, version: int, plans: list[Plan]) -> None:
    if golden.get("suite") != suite or golden.get("suite_version") != version:
        raise GateError(f"{path} was recorded for suite {golden.get('suite')!r} version "
                        f"{golden.get('suite_version')}, this is {suite!r} version {version}: re-record it")
    for plan in plans:
        entry = golden["benchmarks"].get(plan.name)
        if entry is None:
            raise GateError(f"{path} has no golden entry for benchmark {plan.name!r}: re-record it")
        if entry.get("config_hash") != _benchmark_hash(plan):
            raise GateError(f"{path}: benchmark {plan.name!r} was recorded with another configuration "
                            f"(config_hash {entry.get('config_hash')} vs {_benchmark_hash(plan)}); "
                            f"re-record it or drop the overrides that changed it")


def _record(outcomes: list[SuiteOutcome], plans: list[Plan], platform: str, path: Path) -> int:
    """The golden reference: per benchmark, the median over the recorded runs (throughput, its cv and,
    point by point, the loss trajectory), with every run's throughput beside it."""
    failed = sorted({r.benchmark for o in outcomes for r in o.results if r.status != STATUS_FINISHED})
    if failed:
        print(f"cobench qualify: not recording a golden reference: benchmarks did not finish: {failed}",
              file=sys.stderr)
        return EXIT_FAILED
    runs = [{r.benchmark: r for r in o.results} for o in outcomes]

    def entry(plan: Plan) -> dict[str, Any]:
        results = [by_name[plan.name] for by_name in runs]
        throughputs = [r.metrics["throughput"] for r in results]
        return {
            "config_hash": _benchmark_hash(plan),
            "throughput": statistics.median(throughputs),
            "throughput_unit": results[0].throughput_unit,
            "throughput_cv": statistics.median(r.metrics.get("throughput_cv", 0.0) for r in results),
            "throughput_runs": throughputs,
            "train_loss": median_trajectory([r.losses for r in results]),
        }

    suite = outcomes[0].suite
    golden = {
        "platform": platform,
        "suite": suite.name,
        "suite_version": suite.version,
        "recorded": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "source_run_id": ",".join(o.parent_run_id for o in outcomes if o.parent_run_id),
        "torch_version": str(torch.__version__),
        "runs": len(outcomes),
        "benchmarks": {plan.name: entry(plan) for plan in plans},
    }
    write_golden(path, golden)
    print(f"golden reference for {platform!r} ({len(outcomes)} run(s), medians) written to {path}")
    return EXIT_OK


def _markdown(verdict: dict[str, Any]) -> str:
    lines = [f"# Qualification of `{verdict['platform']}`: **{verdict['verdict']}**", "",
             f"Suite `{verdict['suite']}` v{verdict['suite_version']}, gates `{verdict['gates_file']}`, "
             f"golden `{verdict['golden_file']}`, {verdict['wall_s']:.0f} s, MLflow parent run "
             f"`{verdict['parent_run_id']}`.", "",
             f"{verdict['gates_passed']} of {verdict['gates_passed'] + verdict['gates_failed']} gates passed.", "",
             "| benchmark | gate | result | measured | required | detail |", "|---|---|---|---|---|---|"]
    for g in verdict["gates"]:
        lines.append(f"| {g['benchmark']} | {g['gate']} | {'PASS' if g['passed'] else '**FAIL**'} | "
                     f"{g['measured_text']} | {g['required_text']} | {g['detail']} |")
    return "\n".join(lines) + "\n"


def _print(verdict: dict[str, Any], results: list[GateResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"qualification of {verdict['platform']}: {verdict['verdict']}")
    for column in ("benchmark", "gate", "result", "measured", "required"):
        table.add_column(column)
    for g in results:
        table.add_row(g.benchmark, g.gate, "PASS" if g.passed else "[bold red]FAIL[/]", g.measured_text,
                      g.required_text)
    Console(width=160).print(table)


def _judge(outcome: SuiteOutcome, plans: list[Plan], gates: GatesFile, golden: dict[str, Any],
           golden_path: Path, platform: str, base: CobenchConfig) -> int:
    by_name = {r.benchmark: r for r in outcome.results}
    results: list[GateResult] = []
    for plan in plans:
        r = by_name[plan.name]
        results += evaluate(plan.name, gates.benchmarks[plan.name], r.status, r.error, r.metrics,
                            r.losses, golden["benchmarks"].get(plan.name))
    failed = [g for g in results if not g.passed]
    verdict = {
        "verdict": "FAIL" if failed else "PASS",
        "platform": platform,
        "suite": outcome.suite.name,
        "suite_version": outcome.suite.version,
        "gates_file": str(gates.path),
        "golden_file": str(golden_path),
        "parent_run_id": outcome.parent_run_id,
        "wall_s": outcome.wall_s,
        "gates_passed": len(results) - len(failed),
        "gates_failed": len(failed),
        # numbers (measured, bound, comparison), and the same as text for people
        "gates": [asdict(g) | {"measured_text": g.measured_text, "required_text": g.required_text} for g in results],
    }
    out = results_root(base) / "qualify" / f"{time.strftime('%Y%m%d-%H%M%S')}-{platform}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "verdict.json").write_text(json.dumps(verdict, indent=2))
    (out / "verdict.md").write_text(_markdown(verdict))
    tracker = outcome.tracker
    if tracker is not None and outcome.parent_run_id:
        tracker.set_tags(outcome.parent_run_id, {"verdict": verdict["verdict"], "qualification": "true"})
        tracker.log_metrics(outcome.parent_run_id, {"gates_failed": float(len(failed)),
                                                    "gates_passed": float(verdict["gates_passed"])})
        for name in ("verdict.json", "verdict.md"):
            tracker.log_artifact(outcome.parent_run_id, out / name)
    _print(verdict, results)
    for g in failed:
        print(f"FAIL {g.benchmark} {g.gate}: measured {g.measured_text}, required {g.required_text}"
              + (f" ({g.detail})" if g.detail else ""), file=sys.stderr)
    print(f"verdict {verdict['verdict']}: {out / 'verdict.md'}")
    return EXIT_FAILED if failed else EXIT_OK


def _qualify(ns: argparse.Namespace) -> int:
    base, plans = plan_suite(ns.suite, ns.overrides)
    platform, gates = _gates_for(base, plans, ns.suite, ns.gates)
    golden_path = ns.golden or gates.golden
    golden = None
    if not ns.record_golden:
        golden = load_golden(golden_path)
        assert base.suite is not None
        _check_golden(golden, golden_path, ns.suite, base.suite.version, plans)
    if ns.runs < 1 or (ns.runs > 1 and not ns.record_golden):
        raise GateError(f"--runs {ns.runs}: takes N >= 1, with --record-golden (the golden is the median of N runs)")
    outcomes = [run_suite(base, plans) for _ in range(ns.runs if ns.record_golden else 1)]
    if not env_dist_info().is_main:
        return EXIT_OK
    if ns.record_golden:
        return _record(outcomes, plans, platform, golden_path)
    outcome = outcomes[0]
    assert golden is not None
    return _judge(outcome, plans, gates, golden, golden_path, platform, base)


def run(argv: list[str]) -> int:
    """``cobench qualify ...``: PASS exits 0, FAIL 1 (errors: :func:`suite.cli.guarded`)."""
    return _qualify(_parser().parse_args(argv))
