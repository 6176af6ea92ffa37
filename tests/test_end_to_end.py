"""The user's commands, for real: `cobench run` / `cobench suite` into a real sqlite MLflow store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY, clean_env, mlflow_runs

from harness.recording.mlperf_log import read_mllog

METRICS = ("throughput", "step_time_ms_p50", "step_time_ms_p90", "step_time_ms_p99", "mfu",
           "peak_memory_mb", "loss", "eval_loss", "quality_target_reached", "quality_target_reps_reached",
           "quality_target_value", "noisy")
TAGS = ("platform", "device_name", "workload", "suite", "git_sha", "git_dirty", "torch_version",
        "config_hash", "throughput_unit")


def _artifacts(run) -> set[str]:
    root = Path(run.info.artifact_uri.removeprefix("file://"))
    return {p.name for p in root.iterdir()}


def test_run_logs_a_finished_run_with_the_agreed_names(cobench, tmp_path):
    proc = cobench("run", "workload=llama", *TINY)
    assert proc.returncode == 0, proc.stderr
    results = tmp_path / "results"
    (run,) = mlflow_runs(results)
    assert run.info.status == "FINISHED"
    assert set(METRICS) <= set(run.data.metrics), sorted(run.data.metrics)
    assert set(TAGS) <= set(run.data.tags)
    assert run.data.tags["workload"] == "llama"
    assert run.data.tags["throughput_unit"] == "tokens/s"
    assert run.data.tags["platform"] == "cpu"
    assert run.data.metrics["throughput"] > 0
    assert 0 < run.data.metrics["mfu"] < 1  # against this CPU's measured GEMM peak
    assert run.data.params["workload.batch_size"] == "8"
    assert {"config.yaml", "fingerprint.json", "mllog_rep0.txt", "metrics.json"} <= _artifacts(run)
    assert run.info.artifact_uri.startswith((results / "mlartifacts").as_uri())
    # MLPerf's time to train exists only when the target was reached
    assert ("time_to_train_s" in run.data.metrics) == (run.data.metrics["quality_target_reached"] == 1.0)
    # the summary, and where the outputs went
    assert "llama" in proc.stdout and "tok/s" in proc.stdout and "FINISHED" in proc.stdout
    (run_dir,) = (results / "runs").iterdir()
    assert f"outputs: {run_dir}/" in " ".join(proc.stdout.split())  # the run's own folder, no placeholder
    # the local copy survives independently of MLflow
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "FINISHED"
    keys = [line["key"] for line in read_mllog(run_dir / "mllog_rep0.txt")]
    assert keys.count("run_start") == 1 and keys.count("run_stop") == 1


def test_multirun_sweep_makes_one_run_per_value(cobench, tmp_path):
    proc = cobench("run", "-m", "workload.batch_size=2,4", *TINY)
    assert proc.returncode == 0, proc.stderr
    runs = mlflow_runs(tmp_path / "results")
    assert sorted(r.data.params["workload.batch_size"] for r in runs) == ["2", "4"]
    assert all(r.info.status == "FINISHED" for r in runs)
    assert len({r.data.tags["config_hash"] for r in runs}) == 2
    assert "llama batch_size=2" in proc.stdout and "llama batch_size=4" in proc.stdout  # rows told apart
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


def test_a_run_above_its_credible_mfu_measures_the_peak_again(tmp_path):
    """A measured peak is a lower bound, low when other work held the cores: a run whose MFU comes out above
    what the platform credibly reaches measures it once more and reports MFU against the faster figure."""
    cache = tmp_path / "calibration.json"

    def run(name: str) -> tuple[subprocess.CompletedProcess, object]:
        proc = subprocess.run([sys.executable, "-m", "suite.cli", "run", "workload=llama", *TINY,
                               f"results_dir={tmp_path / name}", f"platform.calibration_cache={cache}"],
                              capture_output=True, text=True, timeout=300, env=clean_env(), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        (found,) = mlflow_runs(tmp_path / name)
        return proc, found

    run("first")  # measures this platform's peak into the cache, under its own key
    (key, entry), = json.loads(cache.read_text()).items()
    low = {**entry, "flops": 1e9, "loadavg": 0.0, "measured_at": "2026-01-01T00:00:00+0000"}  # plausible, but low
    low.pop("doubt", None)
    cache.write_text(json.dumps({key: low}))
    _, again = run("second")
    assert again.data.metrics["peak_flops"] > 1e9  # measured again, the faster figure kept
    assert again.data.tags["peak_flops_measured_at"] != low["measured_at"]
    assert json.loads(cache.read_text())[key]["flops"] == again.data.metrics["peak_flops"]
    assert again.data.metrics["mfu"] == pytest.approx(
        again.data.metrics["achieved_tflops"] * 1e12 / again.data.metrics["peak_flops"], rel=1e-6)


def test_results_dir_moves_every_output(cobench, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    proc = cobench("run", *TINY, results_dir=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert (elsewhere / "mlflow.db").exists() and (elsewhere / "mlartifacts").is_dir()
    assert not (tmp_path / "results").exists()


def test_bad_value_fails_before_anything_runs(cobench, tmp_path):
    proc = cobench("run", "runner.steps=0")
    assert proc.returncode == 2
    assert "runner.steps" in proc.stderr and ">= 1" in proc.stderr
    assert mlflow_runs(tmp_path / "results") == []
    assert not (tmp_path / "results" / "runs").exists()


def test_unknown_key_fails_naming_it(cobench, tmp_path):
    proc = cobench("run", "workload.batch_sise=4")
    assert proc.returncode == 2
    assert "workload.batch_sise" in proc.stderr and "batch_size" in proc.stderr
    assert mlflow_runs(tmp_path / "results") == []


def test_unknown_workload_lists_the_known_ones(cobench):
    proc = cobench("run", "workload=resnet")
    assert proc.returncode == 2
    assert "resnet" in proc.stderr and "llama" in proc.stderr


def test_bad_value_late_in_a_sweep_stops_the_sweep_before_it_starts(cobench, tmp_path):
    proc = cobench("run", "-m", "workload.batch_size=2,0", *TINY)
    assert proc.returncode == 2
    assert "workload.batch_size" in proc.stderr
    assert mlflow_runs(tmp_path / "results") == []


def test_unknown_suite_is_a_clear_error(cobench):
    proc = cobench("suite", "nosuch")
    assert proc.returncode == 2
    assert "suite/nosuch" in proc.stderr and "smoke" in proc.stderr


def test_unreachable_tracking_server_is_reported_before_the_workload(cobench, tmp_path):
    proc = cobench("run", *TINY, "tracking.uri=http://127.0.0.1:9", "tracking.connect_timeout_s=2")
    assert proc.returncode == 2
    assert "unreachable" in proc.stderr and "127.0.0.1:9" in proc.stderr
    assert not (tmp_path / "results" / "runs").exists()  # no half-made run folder either


def test_suite_makes_a_parent_run_with_a_child_per_benchmark(cobench, tmp_path):
    proc = cobench("suite", "smoke", *TINY, "runner.repetitions=1", "runner.eval_interval=0")
    assert proc.returncode == 0, proc.stderr
    runs = mlflow_runs(tmp_path / "results")
    parents = [r for r in runs if r.data.tags.get("kind") == "suite"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert children and {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    assert all(c.data.tags["suite"] == "smoke" for c in children)
    assert "suite_wall_s" in parents[0].data.metrics
    assert "suite smoke" in proc.stdout


def test_concurrent_runs_on_a_fresh_store_both_land(tmp_path, calibration_cache):
    """Two runs racing to create the sqlite schema and the experiment must both succeed."""
    results = tmp_path / "results"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "suite.cli", "run", f"results_dir={results}", f"seed={seed}",
             f"platform.calibration_cache={calibration_cache}", *TINY],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=tmp_path,
        )
        for seed in (1, 2)
    ]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    runs = mlflow_runs(results)
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)


def test_a_run_too_noisy_to_trust_says_so(cobench, tmp_path):
    """Beyond runner.noise_*_cv_max a run is marked noisy: a warning, the metric and the tag. (A limit so low
    that any real run exceeds it stands in for a machine under load.)"""
    proc = cobench("run", "workload=llama", *TINY, "runner.noise_step_cv_max=0.0001")
    assert proc.returncode == 0, proc.stderr
    assert "is noisy: step-time cv" in " ".join(proc.stdout.split())
    (run,) = mlflow_runs(tmp_path / "results")
    assert run.data.metrics["noisy"] == 1.0 and run.data.tags["noisy"] == "1"
    assert "runner.noise_step_cv_max" in run.data.tags["noise_reason"]
