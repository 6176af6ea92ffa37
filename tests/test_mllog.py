"""The MLPerf log: the keys and order MLPerf requires, read back with mlperf-logging's parser."""

from __future__ import annotations

import pytest
from conftest import TINY

from harness.config import compose_config, to_run_config
from harness.recording.mlperf_log import read_mllog
from harness.running.runner import run_benchmark

REQUIRED_ONCE = ("submission_org", "submission_platform", "submission_division", "submission_benchmark",
                 "init_stop", "run_start", "run_stop", "global_batch_size", "seed", "train_samples",
                 "eval_samples", "gradient_accumulation_steps", "opt_base_learning_rate",
                 "opt_adamw_beta_1", "opt_adamw_weight_decay", "opt_gradient_clip_norm")


@pytest.fixture(scope="module")
def mllog_lines(tmp_path_factory, calibration_cache):
    results = tmp_path_factory.mktemp("mllog")
    cfg = to_run_config(compose_config([
        *TINY, "runner.eval_interval=2", "runner.repetitions=2", "tracking=off", "seed=7",
        f"results_dir={results}", f"platform.calibration_cache={calibration_cache}",
    ]))
    result = run_benchmark(cfg)
    assert result.status == "FINISHED", result.error
    return [read_mllog(result.run_dir / f"mllog_rep{i}.txt") for i in range(2)]


def test_one_log_per_repetition_with_its_own_seed(mllog_lines):
    seeds = [next(line["value"] for line in lines if line["key"] == "seed") for lines in mllog_lines]
    assert seeds == [7, 8]


def test_required_keys_appear_exactly_once(mllog_lines):
    keys = [line["key"] for line in mllog_lines[0]]
    for key in REQUIRED_ONCE:
        assert keys.count(key) == 1, key
    assert keys.count("cache_clear") >= 1


def test_events_come_in_mlperf_order(mllog_lines):
    keys = [line["key"] for line in mllog_lines[0]]
    order = ["submission_org", "cache_clear", "init_start", "global_batch_size", "init_stop",
             "run_start", "block_start", "block_stop", "eval_start", "eval_accuracy", "eval_stop",
             "run_stop"]
    positions = [keys.index(key) for key in order]
    assert positions == sorted(positions)
    assert keys[-1] == "run_stop"
    # eval_interval=2 with 4 timed steps: two blocks, two evaluations
    assert keys.count("block_start") == 2 and keys.count("eval_accuracy") == 2


def test_eval_accuracy_and_run_stop_carry_the_metadata_checkers_need(mllog_lines):
    lines = mllog_lines[0]
    evals = [line for line in lines if line["key"] == "eval_accuracy"]
    assert all("samples_count" in e["metadata"] for e in evals)
    assert evals[-1]["metadata"]["samples_count"] == (1 + 4) * 8  # warm-up + timed steps × batch
    (stop,) = [line for line in lines if line["key"] == "run_stop"]
    assert stop["metadata"]["status"] in ("success", "aborted")
    assert next(line["value"] for line in lines if line["key"] == "submission_benchmark") == "llama31_8b"


def test_each_line_names_the_harness_line_that_logged_it(mllog_lines):
    """The call site in the metadata is the caller's, never the log writer's own wrapper."""
    for lines in mllog_lines:
        files = {line["metadata"]["file"] for line in lines}
        assert not any(f.endswith("mlperf_log.py") for f in files), files
        assert any(f.endswith("loop.py") for f in files), files
