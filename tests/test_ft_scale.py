"""The effective-training-time model of `cobench ft-scale` (suite/ft_scale.py)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
from conftest import clean_env

from suite.ft_scale import (
    LLAMA3_FAILURES_PER_GPU_HOUR,
    ScaleInputs,
    ett_ft,
    ett_sync,
    inputs_for_targets,
    measured_inputs,
    scale_table,
)


def test_the_seed_figures_need_a_failure_rate_and_checkpoint_interval_it_states():
    fitted = inputs_for_targets(ScaleInputs())
    assert ett_sync(fitted, 100_000) == pytest.approx(0.44)
    assert ett_ft(fitted, 100_000) == pytest.approx(0.80)
    # what it takes: ~2.5x Llama 3's failure rate (a failure every ~12 min at 100k GPUs), ~12-min checkpoints
    assert 2 < fitted.failures_per_gpu_hour / LLAMA3_FAILURES_PER_GPU_HOUR < 3
    assert 10 * 60 < fitted.checkpoint_interval_s < 13 * 60
    assert fitted.sources["failures_per_gpu_hour"].startswith("fitted")
    assert fitted.sources["stall_sync_s"].startswith("published")


def test_replica_level_recovery_wins_more_the_larger_the_cluster():
    rows = scale_table(inputs_for_targets(ScaleInputs()))
    sync, ft = [r.ett_sync_pct for r in rows], [r.ett_ft_pct for r in rows]
    assert sync == sorted(sync, reverse=True)  # more GPUs, more failures
    replicated = [r.ett_ft_pct for r in rows if r.gpus >= 2 * 1024]
    assert replicated == sorted(replicated, reverse=True)
    gaps = [f - s for f, s in zip(ft, sync, strict=True)]
    assert all(g >= 0 for g in gaps) and gaps[-1] > 30 and gaps == sorted(gaps)
    # one replica group has no peer to heal from: it restarts like a synchronous job
    assert rows[0].gpus < 2 * 1024 and rows[0].ett_ft_pct == rows[0].ett_sync_pct


def test_llama3_published_rate_gives_its_reported_effective_training_time_at_16k():
    # Llama 3 reported > 90 % effective training time on 16k GPUs (with faster restarts than 10 min)
    published = ScaleInputs()
    assert 0.85 < ett_sync(published, 16_384) < 0.95
    assert ett_sync(published.with_source("test", stall_sync_s=120.0), 16_384) > 0.90


def test_measured_figures_replace_published_ones_and_say_so(tmp_path):
    ft_run = tmp_path / "metrics.json"
    ft_run.write_text(json.dumps({"metrics": {"stall_s": 1.2, "recovery_s": 9.5, "baseline_restart_s": 14.0}}))
    inputs = measured_inputs(ScaleInputs(), [ft_run])
    assert (inputs.stall_ft_s, inputs.recovery_replica_s, inputs.stall_sync_s) == (1.2, 9.5, 14.0)
    assert inputs.sources["stall_ft_s"].startswith(f"measured: {ft_run}")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"metrics": {"throughput": 1.0}}))
    with pytest.raises(ValueError, match="no failure-scenario figures"):
        measured_inputs(ScaleInputs(), [other])


def test_cli_writes_the_table_and_refuses_bad_sizes(tmp_path):
    cmd = [sys.executable, "-m", "suite.cli", "ft-scale", "--sizes", "1000,100000", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    with (tmp_path / "ft_scale.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["gpus"]) for r in rows] == [1000, 100000]
    assert float(rows[1]["ett_sync_pct"]) == pytest.approx(44.0) and float(rows[1]["ett_ft_pct"]) == pytest.approx(80.0)
    assert "fitted" in proc.stdout and "published" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "suite.cli", "ft-scale", "--sizes", "lots"], capture_output=True,
                         text=True, timeout=120, env=clean_env())
    assert bad.returncode == 2 and "--sizes 'lots'" in bad.stderr
