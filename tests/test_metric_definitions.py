"""Every metric the suites gate or report is defined once, and the README's table is that definition."""

from __future__ import annotations

from pathlib import Path

import yaml

from harness.loop import RepetitionState
from harness.metrics import METRIC_DEFINITIONS, benchmark_metrics, defines, metric_table

ROOT = Path(__file__).resolve().parent.parent


def test_readme_metric_table_is_rendered_from_the_definitions():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- metrics:begin -->\n", 1)[1].split("<!-- metrics:end -->", 1)[0]
    assert block == metric_table(), "re-render the README table from harness.metrics.metric_table()"


def test_every_metric_a_run_reports_is_defined():
    def rank(r: int, rep: int) -> RepetitionState:
        return RepetitionState(rep, step_times_s=[0.01 * (1 + r + rep / 10)] * 5, losses=[2.0, 1.5, 1.2],
                               timed_samples=40, timed_tokens=400, steps_done=6, global_batch_size=16,
                               peak_memory_bytes=2**20, target_reached=True, time_to_train_s=1.0,
                               flops_per_step=1e9)

    metrics = benchmark_metrics([[rank(0, rep), rank(1, rep)] for rep in range(3)], "tokens/s", 1e12)
    assert {"mfu", "rank_imbalance", "step_time_ms_p50_rank1", "quality_target_reached"} <= set(metrics)
    assert [m for m in metrics if not defines(m)] == []


def test_every_metric_a_gates_file_bounds_is_defined():
    for path in (ROOT / "conf" / "gates").glob("*.yaml"):
        for name, bench in yaml.safe_load(path.read_text())["benchmarks"].items():
            for bound in bench.get("metrics") or []:
                assert bound["metric"] in METRIC_DEFINITIONS, (path.name, name, bound["metric"])
