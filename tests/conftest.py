"""Shared helpers: run the real `cobench` command in a subprocess and read its MLflow store."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

# Few steps, tiny data: an end-to-end run in seconds on a 2-core CPU.
TINY = [
    "runner.warmup_steps=1",
    "runner.steps=4",
    "runner.progress=false",
    "workload.train_batches=2",
    "workload.eval_batches=1",
]


@pytest.fixture(scope="session")
def calibration_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One GEMM calibration per test session, not per test."""
    return str(tmp_path_factory.mktemp("calibration") / "calibration.json")


def clean_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def cobench(tmp_path: Path, calibration_cache: str):
    """``cobench(*args)`` runs the CLI with results under tmp_path/results."""

    def run(*args: str, results_dir: Path | None = None, timeout: float = 300, extra_env=None):
        results = results_dir or tmp_path / "results"
        cmd = [sys.executable, "-m", "suite.cli", *args]
        if args and args[0] in ("run", "suite"):
            cmd += [f"results_dir={results}", f"platform.calibration_cache={calibration_cache}"]
        env = clean_env() | (extra_env or {})
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)

    return run


def mlflow_runs(results_dir: Path, experiment: str = "cobench") -> list:
    """All runs in the sqlite store under ``results_dir`` (read with MLflow's own client)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{results_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id], max_results=1000)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    port = _free_port()
    server_dir = tmp_path / "server"
    server_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{server_dir / 'server.db'}", "--workers", "1"],
        cwd=server_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("mlflow server did not come up within 90 s")
        yield uri
    finally:
        proc.terminate()
        proc.wait(timeout=30)
