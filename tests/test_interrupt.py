"""Ctrl-C mid-run: a KILLED MLflow run that keeps its metrics, and an aborted MLPerf log."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from conftest import clean_env, mlflow_runs

from harness.recording.mlperf_log import read_mllog


def test_ctrl_c_leaves_a_killed_run_with_metrics_so_far(tmp_path, calibration_cache):
    results = tmp_path / "results"
    cmd = [
        sys.executable, "-m", "suite.cli", "run", f"results_dir={results}",
        f"platform.calibration_cache={calibration_cache}", "runner.warmup_steps=1",
        "runner.steps=100000", "runner.progress=false", "workload.train_batches=2",
    ]
    # As from a terminal: a shell's background job (e.g. CI started with `&`) inherits SIGINT ignored,
    # and Python then installs no KeyboardInterrupt handler at all.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(), cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 180
        mllog = None
        while time.monotonic() < deadline and proc.poll() is None:
            logs = list((results / "runs").glob("*/mllog_rep0.txt")) if (results / "runs").exists() else []
            if logs and "block_start" in logs[0].read_text():
                mllog = logs[0]
                break
            time.sleep(0.2)
        assert mllog is not None, "the run never reached its timed steps"
        time.sleep(2.0)  # some timed steps
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted by Ctrl-C (SIGINT); MLflow runs: llama KILLED" in stderr
    (run,) = mlflow_runs(results)
    assert run.info.status == "KILLED"
    assert run.data.tags["error"] == "interrupted by Ctrl-C (SIGINT)"
    assert run.data.metrics["throughput"] > 0  # what was measured before Ctrl-C is kept
    assert "step_time_ms_p50" in run.data.metrics
    stops = [line for line in read_mllog(mllog) if line["key"] == "run_stop"]
    assert len(stops) == 1 and stops[0]["metadata"]["status"] == "aborted"
