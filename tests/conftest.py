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


def start_mlflow_server(server_dir: Path, port: int) -> subprocess.Popen:
    """`mlflow server` on a sqlite store in ``server_dir`` (artifacts there too), answering its health check."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{server_dir / 'server.db'}", "--workers", "1"],
        cwd=server_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    pytest.fail("mlflow server did not come up within 90 s")


@pytest.fixture
def mlflow_server(tmp_path):
    port = _free_port()
    server_dir = tmp_path / "server"
    server_dir.mkdir()
    proc = start_mlflow_server(server_dir, port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _postgres_binary(name: str) -> str | None:
    import glob
    import shutil

    found = shutil.which(name) or sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found if isinstance(found, str) else (found[-1] if found else None)


@pytest.fixture(scope="session")
def postgres_uri():
    """A scratch PostgreSQL cluster for the whole test session (Debian's `postgresql`; .ci/run installs
    it): initdb into a temporary folder, the server on a free loopback port, one database `mlflow`."""
    import shutil
    import tempfile

    initdb, postgres, createdb = (_postgres_binary(n) for n in ("initdb", "postgres", "createdb"))
    if not (initdb and postgres and createdb):
        pytest.skip("PostgreSQL is not installed here (Debian: apt-get install postgresql)")
    base = Path(tempfile.mkdtemp(prefix="cobench-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root: run the cluster as the package's postgres user
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(base, "postgres")
    data, port = base / "data", _free_port()
    subprocess.run([*as_user, initdb, "-D", str(data), "-U", "cobench", "--auth=trust", "-E", "UTF8"],
                   check=True, capture_output=True)
    server = subprocess.Popen([*as_user, postgres, "-D", str(data), "-p", str(port), "-k", str(base),
                               "-c", "listen_addresses=127.0.0.1", "-c", "max_connections=200"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while subprocess.run([createdb, "-h", "127.0.0.1", "-p", str(port), "-U", "cobench", "mlflow"],
                             capture_output=True).returncode != 0:
            if time.monotonic() > deadline or server.poll() is not None:
                pytest.fail("the scratch PostgreSQL server did not come up")
            time.sleep(0.5)
        yield f"postgresql://cobench@127.0.0.1:{port}/mlflow"
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_mlflow_server(postgres_uri, tmp_path_factory):
    """`mlflow server` on that PostgreSQL database with a file artifact store, for the whole session."""
    port = _free_port()
    artifacts = tmp_path_factory.mktemp("pg-artifacts")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", postgres_uri, "--artifacts-destination", str(artifacts), "--workers", "2"],
        cwd=artifacts, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("mlflow server on PostgreSQL did not come up within 120 s")
        yield uri
    finally:
        proc.terminate()
        proc.wait(timeout=30)
