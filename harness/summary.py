"""The one-screen summary table printed at the end of a run, sweep or suite."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from harness.runner import STATUS_FINISHED, STATUS_SKIPPED, BenchmarkResult

QUALITY_KEYS = ("eval_loss", "auc", "hr_at_10", "ndcg_at_10", "time_error_pct")


def _fmt(value: float | None, spec: str = ".1f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def summary_table(
    results: list[BenchmarkResult], title: str = "cobench results", extra_metrics: list[str] = ()
) -> Table:
    """One row per benchmark; ``extra_metrics`` adds a column per metric name (e.g. a suite's)."""
    table = Table(title=title, title_justify="left")
    for header in ("benchmark", "platform", "status", "throughput", "p50 ms", "p90 ms", "p99 ms",
                   "step cv %", "rep cv %", "MFU %", "peak MB", "quality", *extra_metrics, "run id"):
        table.add_column(header, justify="left" if header in ("benchmark", "platform", "status") else "right")
    for r in results:
        m = r.metrics
        quality = ", ".join(f"{k}={m[k]:.4g}" for k in QUALITY_KEYS if k in m)
        if "quality_target_reached" in m:
            quality += " ✓" if m["quality_target_reached"] else " ✗"
        status = r.status if r.status in (STATUS_FINISHED, STATUS_SKIPPED) else f"[red]{r.status}[/red]"
        table.add_row(
            r.benchmark,
            r.platform,
            status,
            f"{_fmt(m.get('throughput'), ',.0f')} {r.throughput_unit}" if "throughput" in m else "-",
            _fmt(m.get("step_time_ms_p50"), ".2f"),
            _fmt(m.get("step_time_ms_p90"), ".2f"),
            _fmt(m.get("step_time_ms_p99"), ".2f"),
            _fmt(100 * m["step_time_cv"] if "step_time_cv" in m else None),
            _fmt(100 * m["throughput_cv"] if m.get("repetitions_completed", 0) > 1 else None),
            _fmt(100 * m["mfu"] if "mfu" in m else None, ".2f"),
            _fmt(m.get("peak_memory_mb"), ",.0f"),
            quality or "-",
            *(_fmt(m.get(name), ".4g") for name in extra_metrics),
            (r.run_id or "-")[:8],
        )
    return table


def print_summary(
    results: list[BenchmarkResult], title: str = "cobench results", extra_metrics: list[str] = ()
) -> None:
    console = Console()
    if not console.is_terminal:  # logs and pipes: don't squeeze the table into 80 columns
        console = Console(width=200)
    console.print(summary_table(results, title, list(extra_metrics)))
    for r in results:
        if r.error:
            where = f" (details: {r.run_dir})" if r.run_dir else ""
            console.print(f"[red]{r.benchmark}: {r.status}: {r.error}[/red]{where}")
