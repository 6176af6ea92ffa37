"""Every metric the suites gate or report is defined once, and the docs' metrics page shows that definition."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import yaml

from harness.running.loop import RepetitionState
from harness.running.metrics import METRIC_DEFINITIONS, benchmark_metrics, defines, metric_table
from workloads.base import QualityTarget

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_metrics_page_is_rendered_from_the_definitions():
    """The site's metrics page holds a marker, and the build hook (declared in mkdocs.yml) puts exactly
    ``metric_table()`` there: the page shows the definitions the code uses, never a copy."""
    hook_path = ROOT / "docs" / "hooks" / "metrics.py"
    assert "docs/hooks/metrics.py" in yaml.safe_load((ROOT / "mkdocs.yml").read_text())["hooks"]
    spec = importlib.util.spec_from_file_location("docs_metrics_hook", hook_path)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)

    source = (ROOT / "docs" / "metrics.md").read_text()
    assert source.count(hook.MARKER) == 1 and "| metric | unit |" not in source  # generated, not copied
    before, after = source.split(hook.MARKER)
    page = SimpleNamespace(file=SimpleNamespace(src_uri="metrics.md"))
    assert hook.on_page_markdown(source, page=page, config=None, files=None) == before + metric_table() + after
    other = SimpleNamespace(file=SimpleNamespace(src_uri="index.md"))
    assert hook.on_page_markdown(source, page=other, config=None, files=None) == source
    assert all(f"| `{name}` |" in metric_table() for name in METRIC_DEFINITIONS)


def test_every_metric_a_run_reports_is_defined():
    def rank(r: int, rep: int) -> RepetitionState:
        return RepetitionState(rep, step_times_s=[0.01 * (1 + r + rep / 10)] * 5, losses=[2.0, 1.5, 1.2],
                               timed_samples=40, timed_tokens=400, steps_done=6, global_batch_size=16,
                               peak_memory_bytes=2**20, target_reached=True, time_to_train_s=1.0,
                               flops_per_step=1e9, target=QualityTarget("eval_loss", 1.0),
                               quality={"eval_loss": 0.9})

    metrics = benchmark_metrics([[rank(0, rep), rank(1, rep)] for rep in range(3)], "tokens/s", 1e12)
    assert {"mfu", "rank_imbalance", "step_time_ms_p50_rank1", "quality_target_reached", "time_to_train_s",
            "quality_target_reps_reached"} <= set(metrics)
    metrics["noisy"] = 0.0  # set by the runner from noise_verdict
    assert [m for m in metrics if not defines(m)] == []


def test_every_metric_a_gates_file_bounds_is_defined():
    for path in (ROOT / "conf" / "gates").glob("*.yaml"):
        for name, bench in yaml.safe_load(path.read_text())["benchmarks"].items():
            for bound in bench.get("metrics") or []:
                assert bound["metric"] in METRIC_DEFINITIONS, (path.name, name, bound["metric"])


def test_the_summary_fits_a_100_column_terminal_and_names_sweep_rows():
    from rich.console import Console

    from harness.running.runner import BenchmarkResult
    from harness.running.summary import summary_table, sweep_labels

    metrics = {"throughput": 36942.1, "throughput_cv": 0.031, "repetitions_completed": 3.0, "step_time_ms_p50": 8.91,
               "step_time_cv": 0.05, "mfu": 0.0213, "eval_loss": 0.6834, "quality_target_value": 0.7,
               "quality_target_reps_reached": 2.0, "quality_target_reached": 0.0}
    results = [BenchmarkResult("llama", "llama", "cpu", "FINISHED", "tokens/s", None, metrics=dict(metrics))
               for _ in range(2)]
    labels = sweep_labels(results, [["workload.batch_size=2", "runner.steps=5"],
                                    ["workload.batch_size=4", "runner.steps=5"]])
    console = Console(width=100, record=True)
    console.print(summary_table(results, wide=False, labels=labels))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "…" not in text  # nothing cut
    assert "llama batch_size=2" in text and "llama batch_size=4" in text and "steps=5" not in text
    assert "36.9 k tok/s" in text and "3 %" in text  # people's numbers; cv in percent, said so
    assert "(target" in text and "2/3 ✗" in text  # the target, and how many repetitions reached it


def test_a_suites_own_metrics_fit_the_terminal_in_as_many_tables_as_it_takes():
    from rich.console import Console

    from harness.running.runner import BenchmarkResult
    from harness.running.summary import metric_tables

    metrics = ["auc_delta", "a2a_compression_ratio", "codec_forward_max_error_over_bound", "codec_ms_per_step",
               "codec_break_even_gbps", "step_projected_ms_12p5GBps", "step_projected_ms_25GBps"]
    results = [BenchmarkResult(name, "dlrm", "cpu", "FINISHED", "samples/s", None,
                               metrics={m: 1234.5678 for m in metrics}) for name in ("none", "eb_rel_agreed")]
    tables = metric_tables(results, metrics, 100)
    assert len(tables) > 1
    console = Console(width=100, record=True)
    for table in tables:
        console.print(table)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 100
    assert all(m in text for m in metrics) and "1235" in text  # whole names, numbers not cut


def test_a_serving_row_shows_what_serving_is_judged_by_not_a_whole_loadgen_test_as_a_step():
    from rich.console import Console

    from harness.running.runner import BenchmarkResult
    from harness.running.summary import summary_table

    metrics = {"throughput": 1234.0, "repetitions_completed": 1.0, "step_time_ms_p50": 15028.0,
               "step_time_cv": 0.0, "ttft_ms_p99": 7.36, "ttft_limit_ms": 400.0, "tpot_ms_p99": 52.5,
               "tpot_limit_ms": 40.0, "result_valid": 0.0, "quality_target_value": 1.0,
               "quality_target_reps_reached": 0.0}
    console = Console(width=200, record=True)
    console.print(summary_table([BenchmarkResult("llama_infer", "llama_infer", "cpu", "FINISHED", "tokens/s", None,
                                                 metrics=metrics)]))
    text = " ".join(console.export_text().split())
    assert "INVALID, TTFT p99 7.36 ms (limit 400), TPOT p99 52.5 ms (limit 40)" in text
    assert "15028" not in text and "15,028" not in text
