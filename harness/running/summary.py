"""The summary table printed at the end of a run, sweep or suite: it fits the terminal it is printed on.

Every figure says how it was aggregated: the headline (throughput, step times, MFU) is the olympic
mean over the repetitions, ``± %`` their spread (cv); quality is repetition 0's (the configured
seed), with the target and how many repetitions reached it. A narrow terminal gets the columns
that matter; a wide one (or a log file) also gets the platform, tail latencies, memory and run id.
"""

from __future__ import annotations

import math
import os

from rich.console import Console
from rich.table import Table

from harness.running.runner import STATUS_FINISHED, STATUS_SKIPPED, BenchmarkResult, results_root_of

QUALITY_KEYS = ("eval_loss", "auc", "hr_at_10", "ndcg_at_10", "time_error_pct", "result_valid")
WIDE_FROM = 150  # columns: from this terminal width on, the wide table
UNITS = {"tokens/s": "tok/s", "samples/s": "samples/s", "iterations/s": "it/s"}


def _fmt(value: float | None, spec: str = ".1f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def human(value: float | None, unit: str = "") -> str:
    """``36942.1, "tokens/s"`` → ``36.9 k tok/s``: three significant digits and an SI prefix."""
    if value is None or not math.isfinite(value):
        return "-"
    unit = UNITS.get(unit, unit)
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix} {unit}".rstrip()
    return f"{value:.3g} {unit}".rstrip()


def is_serving(m: dict[str, float]) -> bool:
    """A serving benchmark's metrics (LoadGen's latency limits among them): one "step" is a whole LoadGen test,
    so its step times say nothing; it is judged by TTFT/TPOT p99 against the limits and LoadGen's verdict."""
    return "ttft_limit_ms" in m


def serving_text(m: dict[str, float], markup: bool = True) -> str:
    """``VALID, TTFT p99 7.36 ms (limit 400), TPOT p99 1.2 ms (limit 40)``: what serving is judged by (``markup``:
    what failed in rich's red)."""
    def red(text: str) -> str:
        return f"[red]{text}[/red]" if markup else text

    parts = [("VALID" if m["result_valid"] >= 1 else red("INVALID")) if "result_valid" in m else "-"]
    for name, key, limit in (("TTFT", "ttft_ms_p99", "ttft_limit_ms"), ("TPOT", "tpot_ms_p99", "tpot_limit_ms")):
        if key in m:
            over = limit in m and m[key] > m[limit]
            figure = f"{name} p99 {m[key]:.3g} ms" + (f" (limit {m[limit]:.3g})" if limit in m else "")
            parts.append(red(figure) if over else figure)
    return ", ".join(parts)


def quality_text(m: dict[str, float]) -> str:
    """Repetition 0's quality figures; with a target, the target and how many repetitions reached it."""
    if is_serving(m):
        return serving_text(m)
    figures = ", ".join(f"{k} {m[k]:.4g}" for k in QUALITY_KEYS if k in m)
    if "quality_target_value" in m:
        reps = int(m.get("repetitions_completed", 1))
        reached = int(m.get("quality_target_reps_reached", 0))
        mark = "✓" if reached == reps else "✗ not reached in the steps run: raise runner.steps"
        figures += f" (target {m['quality_target_value']:.4g}: {reached}/{reps} {mark})"
    return figures or "-"


def summary_table(results: list[BenchmarkResult], title: str = "cobench results", extra_metrics: list[str] = (),
                  *, wide: bool = True, labels: dict[int, str] | None = None) -> Table:
    """One row per benchmark; ``extra_metrics`` adds a column per metric name (printed apart, as
    :func:`metric_tables`, by :func:`print_summary`); ``labels``: a row's name by its index (e.g. a
    sweep's differing overrides)."""
    table = Table(title=title, title_justify="left", caption="throughput, p50, MFU: olympic mean over the "
                  "repetitions, ± their cv; quality: repetition 0", caption_justify="left")
    columns = ["benchmark", *(["platform"] if wide else []), "status", "throughput", "±", "p50 ms",
               *(["p90 ms", "p99 ms", "step cv"] if wide else []), "MFU", *(["peak MB", "reps"] if wide else []),
               "quality", *extra_metrics, *(["run id"] if wide else [])]
    for header in columns:
        table.add_column(header, justify="left" if header in ("benchmark", "platform", "status", "quality")
                         else "right", overflow="fold")
    for i, r in enumerate(results):
        m = r.metrics
        status = r.status if r.status in (STATUS_FINISHED, STATUS_SKIPPED) else f"[red]{r.status}[/red]"
        if m.get("noisy"):
            status += " [yellow]noisy[/yellow]"
        if m.get("ops_failed") or m.get("ops_divergent"):
            status += " [red]unfaithful[/red]"
        elif m.get("fidelity_valid") == 0.0:
            status += " [yellow]fidelity not valid[/yellow]"
        reps = int(m.get("repetitions_completed", 0))
        step = {} if is_serving(m) else m  # a serving "step" is a whole LoadGen test: no step-time figures
        cells = {
            "benchmark": (labels or {}).get(i, r.benchmark),
            "platform": r.platform,
            "status": status,
            "throughput": human(m.get("throughput"), r.throughput_unit),
            "±": f"{100 * m['throughput_cv']:.0f} %" if reps > 1 and "throughput_cv" in m else "-",
            "p50 ms": _fmt(step.get("step_time_ms_p50"), ".2f"),
            "p90 ms": _fmt(step.get("step_time_ms_p90"), ".2f"),
            "p99 ms": _fmt(step.get("step_time_ms_p99"), ".2f"),
            "step cv": f"{100 * m['step_time_cv']:.0f} %" if "step_time_cv" in step else "-",
            "MFU": f"{100 * m['mfu']:.2f} %" if "mfu" in m else "-",
            "peak MB": _fmt(m.get("peak_memory_mb"), ",.0f"),
            "reps": str(reps) if reps else "-",
            "quality": quality_text(m),
            "run id": (r.run_id or "-")[:8],
        }
        cells.update({name: _fmt(m.get(name), ".4g") for name in extra_metrics})
        table.add_row(*(cells[c] for c in columns))
    return table


def metric_tables(results: list[BenchmarkResult], metrics: list[str], width: int,
                  labels: dict[int, str] | None = None) -> list[Table]:
    """``metrics`` of every benchmark (a suite's own figures), as as many tables as it takes for
    each to fit ``width`` columns: one column per metric, whole names, none cut."""
    names = [(labels or {}).get(i, r.benchmark) for i, r in enumerate(results)]
    first = max((len(n) for n in names), default=9) + 3
    chunks: list[list[str]] = [[]]
    used = first
    for metric in metrics:
        need = max(len(metric), 9) + 3
        if chunks[-1] and used + need > width:
            chunks.append([])
            used = first
        chunks[-1].append(metric)
        used += need
    tables = []
    for chunk in (c for c in chunks if c):
        table = Table(title_justify="left")
        table.add_column("benchmark", no_wrap=True)
        for metric in chunk:
            table.add_column(metric, justify="right", no_wrap=True)
        for name, r in zip(names, results, strict=True):
            table.add_row(name, *(_fmt(r.metrics.get(metric), ".4g") for metric in chunk))
        tables.append(table)
    return tables


def print_summary(results: list[BenchmarkResult], title: str = "cobench results", extra_metrics: list[str] = (),
                  labels: dict[int, str] | None = None) -> None:
    """The table (and a suite's own metrics below it), then what needs saying: failures, noisy runs,
    and where the outputs went."""
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:  # logs and pipes: the wide table, unsqueezed
        console = Console(width=200)
    wide = console.width >= WIDE_FROM
    console.print(summary_table(results, title, wide=wide, labels=labels))
    for table in metric_tables(results, list(extra_metrics), console.width, labels):
        console.print(table)
    for r in results:
        if r.error:
            where = f" (details: {r.run_dir})" if r.run_dir else ""
            console.print(f"[red]{r.benchmark}: {r.status}: {r.error}[/red]{where}")
        if r.noise:
            console.print(f"[yellow]warning: {r.benchmark} is noisy: {r.noise}[/yellow]")
        if r.metrics.get("ops_failed") or r.metrics.get("ops_divergent"):
            console.print(f"[red]warning: {r.benchmark}: the replay is not the program: "
                          f"{r.metrics.get('ops_failed', 0):.0f} ops failed, {r.metrics.get('ops_divergent', 0):.0f} "
                          f"made other shapes than captured (which, and why: fidelity.json in {r.run_dir})[/red]")
        if r.mfu_doubt:
            console.print(f"[yellow]warning: {r.benchmark}'s MFU is suspect: {r.mfu_doubt}[/yellow]")
        if r.upload_error:
            console.print(f"[yellow]{r.benchmark}: not recorded in MLflow ({r.upload_error}); everything is in "
                          f"{r.run_dir}: `cobench upload {r.run_dir}` once the store is back[/yellow]", soft_wrap=True)
    ran = [r for r in results if r.run_dir is not None]
    for r in ran:  # each run's own folder, named as the table names its row
        name = f"{labels.get(results.index(r), r.benchmark) if labels else r.benchmark}: " if len(ran) > 1 else ""
        console.print(f"outputs: {name}{r.run_dir}/", soft_wrap=True)
    if ran:
        stores = sorted({results_root_of(r.run_dir) / "mlflow.db" for r in ran})
        console.print("each run's folder holds metrics.json, its MLPerf logs and its config"
                      + "".join(f"; MLflow: mlflow ui --backend-store-uri sqlite:///{store}"
                                for store in stores if store.is_file()), soft_wrap=True)


def named_by_differences(name: str, mine: dict[str, str], all_settings: list[dict[str, str]]) -> str:
    """``name`` plus the settings (of ``mine``) whose values differ across ``all_settings``:
    ``llama batch_size=2``; just ``name`` when nothing differs."""
    differing = sorted(k for k in set().union(*all_settings) if len({s.get(k) for s in all_settings}) > 1)
    return " ".join([name, *(f"{k.split('.')[-1]}={mine.get(k, '-')}" for k in differing)])


def sweep_labels(results: list[BenchmarkResult], overrides: list[list[str]]) -> dict[int, str]:
    """Rows of a sweep named by what differs between them (``overrides``: each run's command-line
    overrides, in the order of ``results``)."""
    if len(results) < 2 or len(overrides) != len(results):
        return {}
    parsed = [dict(o.split("=", 1) for o in job if "=" in o) for job in overrides]
    return {i: named_by_differences(r.benchmark, parsed[i], parsed) for i, r in enumerate(results)}
