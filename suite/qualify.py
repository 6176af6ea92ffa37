"""``cobench qualify``: run the qualification suite and judge the platform against its gates.

    cobench qualify [--gates FILE] [--golden FILE] [--suite NAME] [OVERRIDES]   → PASS (0) / FAIL (1)
    cobench qualify --record-golden [--golden FILE] [OVERRIDES]                  → new golden reference

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
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from harness.cli import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, sigterm_as_interrupt
from harness.config import CONF_DIR, CobenchConfig, config_hash, results_root
from harness.distributed import env_dist_info
from harness.platform import discover_platform
from harness.runner import STATUS_FINISHED
from harness.tracking import TrackingError
from suite.gates import GateError, GateResult, GatesFile, evaluate, load_gates, load_golden, write_golden
from suite.runner import Plan, SuiteOutcome, plan_suite, run_suite


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cobench qualify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default="qualify", help="the suite to run (default: qualify)")
    parser.add_argument("--gates", type=Path, help="gates file (default conf/gates/<platform>.yaml)")
    parser.add_argument("--golden", type=Path, help="golden reference (default: the one the gates file names)")
    parser.add_argument("--record-golden", action="store_true",
                        help="run the suite and record its results as the golden reference (a trusted run)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. platform=cpu")
    return parser


def _benchmark_hash(plan: Plan) -> str:
    """What a golden reference is valid for: the benchmark's configuration (its source's, for a replay,
    whose spec path moves with the results folder)."""
    return config_hash(plan.source if plan.source is not None else plan.cfg)


def _gates_for(base: CobenchConfig, plans: list[Plan], suite: str, path: Path | None) -> tuple[str, GatesFile]:
    platform = discover_platform(base.platform, env_dist_info().local_rank).name
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


def _losses(outcome: SuiteOutcome, run_id: str | None) -> list[float]:
    if outcome.tracker is None or run_id is None:
        return []
    history = outcome.tracker.client.get_metric_history(run_id, "train_loss")
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def _record(outcome: SuiteOutcome, plans: list[Plan], platform: str, path: Path) -> int:
    failed = [r.benchmark for r in outcome.results if r.status != STATUS_FINISHED]
    if failed:
        print(f"cobench qualify: not recording a golden reference: benchmarks did not finish: {failed}",
              file=sys.stderr)
        return EXIT_FAILED
    by_name = {r.benchmark: r for r in outcome.results}
    golden = {
        "platform": platform,
        "suite": outcome.suite.name,
        "suite_version": outcome.suite.version,
        "recorded": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "source_run_id": outcome.parent_run_id or "",
        "torch_version": str(torch.__version__),
        "benchmarks": {
            plan.name: {
                "config_hash": _benchmark_hash(plan),
                "throughput": by_name[plan.name].metrics["throughput"],
                "throughput_unit": by_name[plan.name].throughput_unit,
                "throughput_cv": by_name[plan.name].metrics.get("throughput_cv", 0.0),
                "train_loss": _losses(outcome, by_name[plan.name].run_id),
            }
            for plan in plans
        },
    }
    write_golden(path, golden)
    print(f"golden reference for {platform!r} written to {path}")
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
                     f"{g['measured']} | {g['required']} | {g['detail']} |")
    return "\n".join(lines) + "\n"


def _print(verdict: dict[str, Any], results: list[GateResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"qualification of {verdict['platform']}: {verdict['verdict']}")
    for column in ("benchmark", "gate", "result", "measured", "required"):
        table.add_column(column)
    for g in results:
        table.add_row(g.benchmark, g.gate, "PASS" if g.passed else "[bold red]FAIL[/]", g.measured, g.required)
    Console(width=160).print(table)


def _judge(outcome: SuiteOutcome, plans: list[Plan], gates: GatesFile, golden: dict[str, Any],
           golden_path: Path, platform: str, base: CobenchConfig) -> int:
    by_name = {r.benchmark: r for r in outcome.results}
    results: list[GateResult] = []
    for plan in plans:
        r = by_name[plan.name]
        results += evaluate(plan.name, gates.benchmarks[plan.name], r.status, r.error, r.metrics,
                            _losses(outcome, r.run_id), golden["benchmarks"].get(plan.name))
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
        "gates": [asdict(g) for g in results],
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
        print(f"FAIL {g.benchmark} {g.gate}: measured {g.measured}, required {g.required}"
              + (f" ({g.detail})" if g.detail else ""), file=sys.stderr)
    print(f"verdict {verdict['verdict']}: {out / 'verdict.md'}")
    return EXIT_FAILED if failed else EXIT_OK


def _qualify(ns: argparse.Namespace) -> int:
    base, plans = plan_suite(ns.suite, ns.overrides)
    if not base.tracking.enabled:
        raise GateError("qualification logs its verdict and reads loss trajectories from MLflow: "
                        "leave tracking on (drop tracking=off)")
    platform, gates = _gates_for(base, plans, ns.suite, ns.gates)
    golden_path = ns.golden or gates.golden
    golden = None
    if not ns.record_golden:
        golden = load_golden(golden_path)
        assert base.suite is not None
        _check_golden(golden, golden_path, ns.suite, base.suite.version, plans)
    outcome = run_suite(ns.suite, ns.overrides)
    if not env_dist_info().is_main:
        return EXIT_OK
    if ns.record_golden:
        return _record(outcome, plans, platform, golden_path)
    assert golden is not None
    return _judge(outcome, plans, gates, golden, golden_path, platform, base)


def main(argv: list[str]) -> int:
    try:
        ns = _parser().parse_args(argv)
    except SystemExit as exit_:
        return EXIT_OK if exit_.code == 0 else EXIT_BAD_INPUT
    sigterm_as_interrupt()
    try:
        return _qualify(ns)
    except (GateError, ValueError, TrackingError) as err:
        print(f"cobench qualify: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("cobench qualify: interrupted; no verdict (open MLflow runs were closed as KILLED)", file=sys.stderr)
        return EXIT_INTERRUPTED
