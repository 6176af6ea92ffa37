"""``cobench report``: an MLPerf-style submission folder and a self-contained HTML report of a suite run.

    cobench report [--run PARENT_RUN_ID | --suite NAME] [--org ORG] [--system NAME]
                   [--tracking-uri URI | --results-dir DIR] [--out DIR] [--ruleset 6.0.0]

From the suite's MLflow parent run and its benchmark runs (any tracking store) it writes::

    <out>/<org>/systems/<system>.json                              MLPerf system description
    <out>/<org>/results/<system>/<benchmark>/result_<i>.txt        the runs' MLPerf logs
    <out>/<org>/benchmarks/<benchmark>/config.yaml, README.md      the configuration, how to reproduce
    <out>/report.html                                              everything above, plots inline (SVG)
    <out>/compliance.json                                          mlperf-logging's checker per log

Every MLPerf log of a benchmark that mirrors an MLPerf one (its ``submission_benchmark`` has an
``open_<benchmark>.yaml`` rule set) is run through mlperf-logging's compliance checker.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import yaml

from harness.cli import EXIT_OK, add_store_flags
from harness.identity import reproduce_overrides
from harness.running.summary import is_serving, serving_text
from suite.results import RunRecord, find_runs, open_store

if TYPE_CHECKING:  # mlflow is imported when a store is opened
    from mlflow.tracking import MlflowClient

TEMPLATES = Path(__file__).resolve().parent / "templates"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cobench report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--run", help="the suite's MLflow parent run id")
    which.add_argument("--suite", help="the latest run of this suite (default: the latest suite run)")
    parser.add_argument("--org", help="submitting organisation (default: the logs' submission_org)")
    parser.add_argument("--system", help="system name (default: the runs' platform)")
    add_store_flags(parser)
    parser.add_argument("--out", type=Path, help="output folder (default <results-dir>/submissions/<time>)")
    parser.add_argument("--ruleset", default="6.0.0", help="mlperf-logging training ruleset (default 6.0.0)")
    return parser


def _parent(client: Any, ns: argparse.Namespace) -> Any:
    from mlflow.exceptions import MlflowException

    if ns.run:
        try:
            run = client.get_run(ns.run)
        except MlflowException:
            raise ValueError(f"no run {ns.run!r} in the tracking store") from None
        if run.data.tags.get("kind") not in ("suite", "qualification"):
            raise ValueError(f"run {ns.run} is a single benchmark run, not a suite's parent run: pass the "
                             f"parent's id, or --suite NAME")
        return run
    exp = client.get_experiment_by_name(ns.experiment)
    clauses = ["tags.kind = 'suite'"] + ([f"tags.suite = '{ns.suite}'"] if ns.suite else [])
    runs = client.search_runs([exp.experiment_id], " and ".join(clauses), max_results=1,
                              order_by=["attributes.start_time DESC"]) if exp else []
    if not runs:
        raise ValueError(f"no {'run of suite ' + repr(ns.suite) if ns.suite else 'suite run'} in the tracking "
                         f"store: run one first (`cobench suite smoke`)")
    return runs[0]


def _mllog_value(lines: list[str], key: str) -> Any:
    for line in lines:
        if line.startswith(":::MLLOG") and f'"key": "{key}"' in line:
            return json.loads(line[len(":::MLLOG"):])["value"]
    return None


def _check(path: Path, ruleset: str) -> dict[str, Any]:
    """mlperf-logging's compliance checker on one log (in a scratch folder: it writes a log file)."""
    with tempfile.TemporaryDirectory() as scratch:
        proc = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                               "--ruleset", ruleset, str(path.resolve())], capture_output=True, text=True,
                              timeout=300, cwd=scratch)
    output = proc.stdout + proc.stderr
    passed = proc.returncode == 0 and "SUCCESS" in output
    problems = [line.split(" - ", 1)[-1].strip() for line in output.splitlines()
                if line.startswith(("WARNING", "ERROR")) and "FAILED" not in line]
    return {"passed": passed, "summary": "all checks passed" if passed else "; ".join(problems) or output[-300:],
            "output": output}


def _rules_exist(benchmark: str, ruleset: str) -> bool:
    import mlperf_logging

    rules = Path(mlperf_logging.__file__).parent / "compliance_checker" / f"training_{ruleset}"
    return (rules / f"open_{benchmark}.yaml").is_file()


def _svg(fig: Any) -> str:
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg")
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # inline: drop the XML prolog and DOCTYPE


def _plots(rows: list[dict[str, Any]], losses: dict[str, list[float]]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = []
    done = [r for r in rows if r["metrics"].get("throughput")]
    if done:
        fig, ax = plt.subplots(figsize=(6.4, 3.4))
        names = [r["benchmark"] for r in done]
        values = [r["metrics"]["throughput"] for r in done]
        # clamped: matplotlib refuses a negative whisker, and rounding can make one of -1e-12
        lower = [max(0.0, v - r["metrics"].get("throughput_min", v)) for v, r in zip(values, done, strict=True)]
        upper = [max(0.0, r["metrics"].get("throughput_max", v) - v) for v, r in zip(values, done, strict=True)]
        ax.barh(names, values, xerr=[lower, upper], capsize=3, color="#4c72b0")
        ax.set_xscale("log")
        ax.set_xlabel("throughput, each in its unit (whiskers: min-max)")
        ax.set_title("Throughput per benchmark")
        fig.tight_layout()
        plots.append(_svg(fig))
        plt.close(fig)
    if losses:
        fig, ax = plt.subplots(figsize=(6.4, 3.4))
        for name, values in losses.items():
            ax.plot(range(len(values)), values, label=name)
        ax.set_xlabel("training step (repetition 0)")
        ax.set_ylabel("training loss")
        ax.set_title("Loss trajectories")
        ax.legend(fontsize="small")
        fig.tight_layout()
        plots.append(_svg(fig))
        plt.close(fig)
    return plots


def _command(config: dict[str, Any], workload: str) -> str:
    """``cobench run`` with every setting of the run's resolved config that differs from what its workload
    composes by default, the platform's included (:func:`harness.identity.reproduce_overrides`)."""
    overrides = reproduce_overrides(config) if config.get("workload") else [f"workload={workload}"]
    return "cobench run " + " ".join(shlex.quote(o) for o in overrides)


def _fmt(value: float | None, digits: int = 4) -> str:
    """A figure as people read it: ``46,910``, ``0.8025``, never ``4.691e+04``."""
    if value is None:
        return "-"
    if abs(value) >= 10 ** digits:
        return f"{value:,.0f}"
    text = f"{value:.{digits}g}"
    return f"{value:,.{max(digits - 1 - int(math.floor(math.log10(abs(value)))), 0)}f}" if "e" in text else text


def report(ns: argparse.Namespace) -> int:
    import jinja2

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    client = open_store(ns.tracking_uri, ns.results_dir)
    parent = _parent(client, ns)
    parent_id, suite = parent.info.run_id, parent.data.tags.get("suite", "?")
    runs: list[RunRecord] = find_runs(client, experiment=ns.experiment, tags={"mlflow.parentRunId": parent_id},
                                      status=None)
    if not runs:
        raise ValueError(f"suite run {parent_id} has no benchmark runs to report")
    out = ns.out or ns.results_dir / "submissions" / time.strftime("%Y%m%d-%H%M%S")
    scratch = Path(tempfile.mkdtemp(prefix="cobench-report-"))
    try:
        return _write(ns, client, parent_id, suite, runs, out, scratch, jinja2)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _write(ns: argparse.Namespace, client: MlflowClient, parent_id: str, suite: str, runs: list[RunRecord], out: Path,
           scratch: Path, jinja2: ModuleType) -> int:
    started = time.perf_counter()
    rows, losses, fidelity, compliance = [], {}, [], []
    system_name = ns.system or runs[0].platform
    org = ns.org
    fingerprint: dict[str, Any] = {}
    for run in runs:
        local = Path(client.download_artifacts(run.run_id, "", str(scratch / run.run_id)))
        logs = sorted(local.glob("mllog_rep*.txt"), key=lambda p: int(p.stem.removeprefix("mllog_rep")))
        config = yaml.safe_load((local / "config.yaml").read_text()) if (local / "config.yaml").is_file() else {}
        fingerprint = fingerprint or (json.loads((local / "fingerprint.json").read_text())
                                      if (local / "fingerprint.json").is_file() else {})
        benchmark = run.tags.get("benchmark", run.name)
        first_lines = logs[0].read_text().splitlines() if logs else []
        org = org or _mllog_value(first_lines, "submission_org") or "cobench"
        mlperf_benchmark = _mllog_value(first_lines, "submission_benchmark") or ""
        rows.append({"benchmark": benchmark, "workload": run.tags.get("workload", "?"), "status": run.status,
                     "metrics": run.metrics, "unit": run.tags.get("throughput_unit", ""), "logs": logs,
                     "config": config, "local": local, "mlperf_benchmark": mlperf_benchmark})
        history = client.get_metric_history(run.run_id, "train_loss")
        if history and run.tags.get("workload") != "generated":
            losses[benchmark] = [m.value for m in sorted(history, key=lambda m: m.step)]
        if run.tags.get("workload") == "generated":
            m = run.metrics
            fidelity.append({"benchmark": benchmark, "source": run.tags.get("source_workload", "?"),
                             "portability": run.tags.get("portability", "?"),
                             **{k: _fmt(m.get(k), 3) for k in ("time_error_pct", "replay_step_ms", "reference_step_ms",
                                                               "op_coverage_pct", "time_coverage_pct",
                                                               "category_distance", "host_gap_ms")}})
    base = out / org
    results_dir = base / "results" / system_name
    for row in rows:
        bench_dir = base / "benchmarks" / row["benchmark"]
        bench_dir.mkdir(parents=True, exist_ok=True)
        row["command"] = _command(row["config"], row["workload"])
        if (row["local"] / "config.yaml").is_file():
            shutil.copy(row["local"] / "config.yaml", bench_dir / "config.yaml")
        (bench_dir / "README.md").write_text(
            f"# {row['benchmark']}\n\nWorkload `{row['workload']}` of cobench suite `{suite}`; "
            f"`config.yaml` is the resolved configuration.\n\nReproduce:\n\n    {row['command']}\n")
        target = results_dir / row["benchmark"]
        target.mkdir(parents=True, exist_ok=True)
        for i, log in enumerate(row["logs"]):
            shutil.copy(log, target / f"result_{i}.txt")
            if _rules_exist(row["mlperf_benchmark"], ns.ruleset):
                outcome = _check(target / f"result_{i}.txt", ns.ruleset)
                compliance.append({"benchmark": row["benchmark"], "mlperf_benchmark": row["mlperf_benchmark"],
                                   "file": str((target / f"result_{i}.txt").relative_to(out)), **outcome})
    system = _system(fingerprint, org, system_name, rows[0]["config"])
    (base / "systems").mkdir(parents=True, exist_ok=True)
    (base / "systems" / f"{system_name}.json").write_text(json.dumps(system, indent=2))
    (out / "compliance.json").write_text(json.dumps(compliance, indent=2))
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True)
    html = env.get_template("report.html.j2").render(
        system=system, suite=suite, parent_run_id=parent_id, ruleset=ns.ruleset, fidelity=fidelity,
        generated=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), compliance=compliance,
        plots=_plots(rows, losses), runs=[_row_view(r) for r in rows],
        suite_command=_suite_command(suite, rows[0]["config"]))
    (out / "report.html").write_text(html)
    passed = sum(c["passed"] for c in compliance)
    print(f"report: {out / 'report.html'}\nsubmission folder: {base}\n"
          f"compliance: {passed} of {len(compliance)} MLPerf logs pass ({ns.ruleset}); "
          f"{time.perf_counter() - started:.1f} s")
    return EXIT_OK


def _suite_command(suite: str, config: dict[str, Any]) -> str:
    """``cobench suite`` on the platform the runs had: its settings that differ from the defaults."""
    overrides = reproduce_overrides(config) if config.get("workload") else []
    platform = [o for o in overrides if o.lstrip("+").startswith("platform.")]
    return " ".join(["cobench suite", shlex.quote(suite), *(shlex.quote(o) for o in platform)])


def _row_view(row: dict[str, Any]) -> dict[str, Any]:
    m = row["metrics"]
    quality = ", ".join(f"{k}={m[k]:.4g}" for k in ("eval_loss", "auc", "hr_at_10", "ndcg_at_10") if k in m)
    if is_serving(m):  # judged by LoadGen's verdict and its latency limits
        quality = serving_text(m, markup=False)
    elif "quality_target_reached" in m:
        target = f" {m['quality_target_value']:.4g}" if "quality_target_value" in m else ""
        quality += f" (target{target} reached)" if m["quality_target_reached"] == 1.0 else \
            f" (target{target} not reached)"
    return {"benchmark": row["benchmark"], "workload": row["workload"], "status": row["status"],
            "throughput": _fmt(m.get("throughput")), "unit": row["unit"], "cv": _fmt(m.get("throughput_cv"), 3),
            "range": f"{_fmt(m.get('throughput_min'))} – {_fmt(m.get('throughput_max'))}",
            "p50": _fmt(m.get("step_time_ms_p50")), "ttt": _fmt(m.get("time_to_train_s")),
            "quality": quality or "-", "repetitions": len(row["logs"]), "command": row["command"]}


def _system(fp: dict[str, Any], org: str, name: str, config: dict[str, Any]) -> dict[str, Any]:
    """MLPerf's system-description fields, from the runs' environment fingerprint."""
    libs = fp.get("libraries", {})
    accel = fp.get("accelerator") or {}
    on_cpu = str(fp.get("device", "cpu")).startswith("cpu")
    mllog = config.get("mllog") or {}
    return {
        "submitter": org,
        "division": mllog.get("division", "open"),
        "status": mllog.get("status", "research"),
        "system_name": name,
        "number_of_nodes": fp.get("nodes", 1),
        "host_processor_model_name": fp.get("cpu", "unknown"),
        "host_processors_per_node": 1,
        "host_processor_core_count": fp.get("cpu_count", "unknown"),
        "host_memory_capacity": f"{fp['memory_gb']} GB" if "memory_gb" in fp else "unknown",
        "accelerator_model_name": "N/A" if on_cpu else fp.get("device_name", "unknown"),
        "accelerators_per_node": 0 if on_cpu else fp.get("ranks_per_node", accel.get("device_count", 1)),
        "accelerator_memory_capacity": f"{accel['total_memory_gb']} GB" if "total_memory_gb" in accel else "N/A",
        "framework": f"PyTorch {libs.get('torch', '?')}",
        "other_software_stack": ", ".join(f"{k} {v}" for k, v in sorted(libs.items()) if k != "torch"),
        "operating_system": fp.get("os", "unknown"),
        "sw_notes": f"cobench {fp.get('git_sha', '?')[:12]}{' (dirty)' if fp.get('git_dirty') else ''}; "
                    f"{fp.get('torch_threads', '?')} intra-op threads",
    }


def run(argv: list[str]) -> int:
    """``cobench report [OPTIONS]`` (errors: :func:`suite.cli.guarded`)."""
    return report(_parser().parse_args(argv))

