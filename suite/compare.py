"""``cobench compare``: the same benchmarks across platforms, from MLflow.

    cobench compare [--baseline PLATFORM] [--metric throughput] [--suite S] [--workload W]
                    [--benchmark B] [--tag k=v ...] [--since DATE] [--until DATE]
                    [--tracking-uri URI | --results-dir DIR] [--out DIR]

One row per benchmark configuration (benchmark name + ``config_hash``: runs of different
configurations are never averaged together), one column group per platform: the olympic mean of
the matching runs' metric, its variation (cv, min–max, number of runs) and the ratio to the
baseline platform. Writes ``compare.csv``, ``compare.json``, ``compare.md`` and a plot
(``compare.svg`` and ``.png``: ratio to baseline with min–max error bars) to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from harness.cli import EXIT_OK, add_store_flags
from harness.running.summary import human, named_by_differences
from harness.running.timing import olympic_mean
from suite.results import RunRecord, find_runs, open_store, parse_date


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cobench compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--metric", default="throughput", help="metric to compare (default throughput)")
    parser.add_argument("--baseline", help="platform the others are divided by (default: the first found)")
    parser.add_argument("--suite")
    parser.add_argument("--workload")
    parser.add_argument("--benchmark")
    parser.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE", help="only runs with this tag")
    parser.add_argument("--since", help="runs started on/after this date (YYYY-MM-DD or ISO time)")
    parser.add_argument("--until", help="runs started before this date")
    add_store_flags(parser)
    parser.add_argument("--out", type=Path, help="output folder (default <results-dir>/compare/<time>)")
    return parser


MEASURED_PARAMS = ("workload.", "runner.", "seed", "deterministic")  # params that define what is measured


def summarize(runs: list[RunRecord], metric: str) -> tuple[dict[tuple[str, str], dict[str, dict]], list[str]]:
    """{(benchmark, config_hash): {platform: stats}} and the platforms, in order of first appearance.

    Per platform: the olympic mean over runs; ``cv``, ``min`` and ``max`` over every repetition the
    runs measured when the metric is the throughput (each run logs its repetitions' spread), else
    over the runs; the runs' world sizes and how many were marked noisy.
    """
    runs_of: dict[tuple[str, str], dict[str, list[RunRecord]]] = defaultdict(lambda: defaultdict(list))
    platforms: list[str] = []
    for run in runs:
        value = run.metrics.get(metric)
        if value is None or not math.isfinite(value):
            continue
        runs_of[(run.tags.get("benchmark", run.name), run.tags.get("config_hash", "?"))][run.platform].append(run)
        if run.platform not in platforms:
            platforms.append(run.platform)
    table = {}
    for key, by_platform in runs_of.items():
        table[key] = {}
        for platform, group in by_platform.items():
            vals = [r.metrics[metric] for r in group]
            mean = olympic_mean(vals)
            cv = statistics.pstdev(vals) / statistics.fmean(vals) if len(vals) > 1 and statistics.fmean(vals) else 0.0
            low, high = min(vals), max(vals)
            if metric == "throughput":  # each run's own repetitions count too
                cv = max([cv, *(r.metrics.get("throughput_cv", 0.0) for r in group)])
                low = min(r.metrics.get("throughput_min", r.metrics[metric]) for r in group)
                high = max(r.metrics.get("throughput_max", r.metrics[metric]) for r in group)
            table[key][platform] = {
                "value": mean, "cv": cv, "min": low, "max": high, "n": len(vals),
                "world_size": ",".join(sorted({r.tags.get("world_size", "?") for r in group})),
                "noisy": sum(r.tags.get("noisy") == "1" for r in group),
                "params": {k: v for k, v in group[0].params.items() if k.startswith(MEASURED_PARAMS)},
            }
    return table, platforms


def _label(benchmark: str, chash: str, table: dict) -> str:
    """A benchmark run with several configurations: named by the settings that differ between them."""
    configs = [next(iter(by_platform.values()))["params"] for (b, _), by_platform in table.items() if b == benchmark]
    if len(configs) < 2:
        return benchmark
    label = named_by_differences(benchmark, next(iter(table[(benchmark, chash)].values()))["params"], configs)
    return label if label != benchmark else f"{benchmark} [{chash}]"  # differing only where params don't show


def _rows(table: dict, platforms: list[str], baseline: str, unit: dict[str, str]) -> list[dict[str, Any]]:
    rows = []
    for (benchmark, chash), by_platform in sorted(table.items()):
        base = by_platform.get(baseline)
        for platform in platforms:
            stats = by_platform.get(platform)
            if stats is None:
                continue
            rows.append({
                "benchmark": _label(benchmark, chash, table),
                "config_hash": chash, "platform": platform, "unit": unit.get(benchmark, ""),
                **{k: v for k, v in stats.items() if k != "params"},
                "ratio": stats["value"] / base["value"] if base and base["value"] else None,
            })
    return rows


def _plot(rows: list[dict[str, Any]], platforms: list[str], baseline: str, metric: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benchmarks = list(dict.fromkeys(r["benchmark"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(benchmarks) * max(len(platforms), 1) / 2 + 2), 3.6))
    width = 0.8 / max(len(platforms), 1)
    for i, platform in enumerate(platforms):
        xs, ys, lo, hi = [], [], [], []
        for j, benchmark in enumerate(benchmarks):
            row = next((r for r in rows if r["benchmark"] == benchmark and r["platform"] == platform), None)
            if row is None or row["ratio"] is None:
                continue
            scale = row["ratio"] / row["value"] if row["value"] else 0.0
            xs.append(j + (i - (len(platforms) - 1) / 2) * width)
            ys.append(row["ratio"])
            # clamped: with one run min == value == max, and rounding can leave a -1e-16 whisker
            lo.append(max(0.0, row["ratio"] - row["min"] * scale))
            hi.append(max(0.0, row["max"] * scale - row["ratio"]))
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=platform)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(benchmarks)), benchmarks, rotation=15, ha="right")
    ax.set_ylabel(f"{metric} / {baseline}")
    ax.set_title(f"{metric} relative to {baseline} (bars: olympic mean; whiskers: min-max)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out / "compare.svg")
    fig.savefig(out / "compare.png", dpi=120)
    plt.close(fig)


def _write(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps({**meta, "rows": rows}, indent=2, default=str))
    with (out / "compare.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"# {meta['metric']} by platform (baseline `{meta['baseline']}`)", "",
             "| benchmark | platform | ranks | value | unit | ratio | cv % | min | max | runs | noisy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        lines.append(f"| {r['benchmark']} | {r['platform']} | {r['world_size']} | {r['value']:.4g} | {r['unit']} | "
                     f"{ratio} | {100 * r['cv']:.1f} | {r['min']:.4g} | {r['max']:.4g} | {r['n']} | {r['noisy']} |")
    (out / "compare.md").write_text("\n".join(lines) + "\n")


def _print(rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table


    table = Table(title=f"{meta['metric']}: {meta['runs']} runs, baseline {meta['baseline']}", caption=(
        "value: olympic mean over runs; cv and range: over every repetition of them"), caption_justify="left")
    for column in ("benchmark", "platform", "ranks", "value", "ratio", "cv", "range", "runs", "noisy"):
        table.add_column(column, justify="left" if column in ("benchmark", "platform") else "right")
    for r in rows:
        table.add_row(escape(r["benchmark"]), escape(r["platform"]), r["world_size"], human(r["value"], r["unit"]),
                      f"{r['ratio']:.3f}" if r["ratio"] is not None else "-", f"{100 * r['cv']:.1f} %",
                      f"{human(r['min'])} – {human(r['max'])}", str(r["n"]),
                      f"[yellow]{r['noisy']}[/yellow]" if r["noisy"] else "0")
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    console.print(table)
    if any(r["noisy"] for r in rows):
        console.print("[yellow]warning: rows with noisy runs (tag noisy=1) compare figures that are not to be "
                      "trusted; rerun them on a quiet machine[/yellow]")


def compare(ns: argparse.Namespace) -> int:
    tags = {}
    for item in ns.tag:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--tag {item!r}: expected KEY=VALUE")
        tags[key] = value
    client = open_store(ns.tracking_uri, ns.results_dir)
    runs = find_runs(client, experiment=ns.experiment, suite=ns.suite, workload=ns.workload,
                     benchmark=ns.benchmark, tags=tags, since=parse_date(ns.since, "--since"),
                     until=parse_date(ns.until, "--until"))
    where = ns.tracking_uri or str(ns.results_dir)
    if not runs:
        raise ValueError(f"no finished runs in {where} match the filters; try fewer filters, or run a suite first")
    table, platforms = summarize(runs, ns.metric)
    if not table:
        raise ValueError(f"none of the {len(runs)} matching runs logged metric {ns.metric!r}")
    baseline = ns.baseline or platforms[0]
    if baseline not in platforms:
        raise ValueError(f"baseline platform {baseline!r} has no matching runs; "
                         f"platforms found: {', '.join(platforms)}")
    mixed = sorted({b for b, _ in table if sum(1 for other, _ in table if other == b) > 1})
    if mixed:
        print(f"cobench compare: note: {', '.join(mixed)} ran with several configurations (config_hash); "
              f"they get one row each and are never averaged together", file=sys.stderr)
    unit = {r.tags.get("benchmark", r.name): r.tags.get("throughput_unit", "") if ns.metric == "throughput" else ""
            for r in runs}
    rows = _rows(table, platforms, baseline, unit)
    meta = {"metric": ns.metric, "baseline": baseline, "platforms": platforms, "runs": len(runs), "source": where,
            "filters": {"suite": ns.suite, "workload": ns.workload, "benchmark": ns.benchmark, "tags": tags,
                        "since": ns.since, "until": ns.until}}
    out = ns.out or ns.results_dir / "compare" / time.strftime("%Y%m%d-%H%M%S")
    _write(rows, meta, out)
    _plot(rows, platforms, baseline, ns.metric, out)
    _print(rows, meta)
    print(f"written: {out}/compare.{{csv,json,md,svg,png}}")
    return EXIT_OK


def run(argv: list[str]) -> int:
    """``cobench compare [OPTIONS]`` (errors: :func:`suite.cli.guarded`)."""
    return compare(_parser().parse_args(argv))

