"""A team's results fleet (docs/fleets.md): many hosts writing to one MLflow server on PostgreSQL with
MLflow's auth app over TLS, and many runs writing to one embedded sqlite store; nothing lost, no
secret written down. Real servers on loopback, started once per test session (conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import TINY, clean_env, mlflow_runs

# The smallest Llama run that still goes through every part of a run (a few ms a step on one thread):
# what the fleet tests time is the writing, not the training.
SMALL = ["workload=llama", "workload.dim=32", "workload.n_layers=1", "workload.n_heads=2", "workload.n_kv_heads=2",
         "workload.batch_size=2", "workload.seq_len=16", "workload.train_batches=2", "workload.eval_batches=1",
         "runner.warmup_steps=1", "runner.steps=3", "runner.eval_interval=0", "runner.progress=false",
         "platform.calibrate=false", "platform.num_threads=1"]


def cobench_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "suite.cli", *args]


def files_holding(folder: Path, secret: str) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def credentials_file(folder: Path, user: str, password: str, mode: int = 0o600) -> Path:
    path = folder / f"{user}.credentials"
    path.write_text(f"[mlflow]\nmlflow_tracking_username = {user}\nmlflow_tracking_password = {password}\n")
    path.chmod(mode)
    return path


def test_run_folder_files_are_never_seen_half_written(tmp_path):
    """metrics.json rewritten in a loop by a process that is then SIGKILLed: every read in between, and the
    file left behind, is whole JSON, and no temporary file is left to be uploaded with the run."""
    target = tmp_path / "metrics.json"
    writer = subprocess.Popen([sys.executable, "-c", (
        "import json, sys\nfrom pathlib import Path\nfrom harness.files import write_atomic\n"
        "i = 0\nwhile True:\n    i += 1\n"
        "    write_atomic(Path(sys.argv[1]), json.dumps({'i': i, 'pad': ['x' * 64] * 20000}))\n"
    ), str(target)], env=clean_env())
    try:
        deadline, reads = time.monotonic() + 30, 0
        while reads < 200 and time.monotonic() < deadline:
            if target.exists():
                assert len(json.loads(target.read_text())["pad"]) == 20000
                reads += 1
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
    assert reads == 200
    assert json.loads(target.read_text())["i"] >= 1
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert len(leftovers) <= 1  # at most the one being written when it was killed: hidden, never uploaded


def test_uploading_a_run_folder_again_or_twice_at_once_makes_no_duplicate(tmp_path, calibration_cache):
    """`cobench upload` of a folder whose upload was cut short (the run and some rows already in the store),
    twice at once and then once more: still one run, with each metric row once."""
    results = tmp_path / "results"
    done = subprocess.run(cobench_cmd("run", *SMALL, f"results_dir={results}",
                                      f"platform.calibration_cache={calibration_cache}"),
                          capture_output=True, text=True, timeout=300, env=clean_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (folder,) = (results / "runs").iterdir()
    record = json.loads((folder / "metrics.json").read_text())
    (folder / "upload_pending.json").write_text(json.dumps({"error": "ConnectionError: cut short"}))
    uploads = [subprocess.Popen(cobench_cmd("upload", str(folder)), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=clean_env()) for _ in range(2)]
    outputs = [u.communicate(timeout=300) for u in uploads]
    assert [u.returncode for u in uploads] == [0, 0], [err[-2000:] for _, err in outputs]
    assert sum("already recorded" in out for out, _ in outputs) == 1  # the second waited for the first
    again = subprocess.run(cobench_cmd("upload", str(folder)), capture_output=True, text=True, timeout=300,
                           env=clean_env())
    assert again.returncode == 0 and "already recorded" in again.stdout
    (run,) = mlflow_runs(results)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    assert run.info.run_id == record["mlflow"]["run_id"] and run.info.status == "FINISHED"
    assert len(client.get_metric_history(run.info.run_id, "train_loss")) == len(record["losses"])
    assert len(client.get_metric_history(run.info.run_id, "throughput")) == 1
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]
