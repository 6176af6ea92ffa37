"""A team's tracking server: `mlflow server` on loopback, reached through tracking=server."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import TINY


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


def test_run_logs_to_a_tracking_server(cobench, mlflow_server):
    proc = cobench("run", "tracking=server", f"tracking.uri={mlflow_server}", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("cobench")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["workload"] == "llama" and "throughput" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "fingerprint.json", "mllog_rep0.txt"} <= artifacts


def test_env_var_selects_the_server_too(cobench, mlflow_server):
    proc = cobench("run", *TINY, extra_env={"MLFLOW_TRACKING_URI": mlflow_server})
    assert proc.returncode == 0, proc.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    assert len(client.search_runs([client.get_experiment_by_name("cobench").experiment_id])) == 1
