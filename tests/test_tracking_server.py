"""A team's tracking server: `mlflow server` on loopback, reached through tracking=server."""

from __future__ import annotations

import pytest
from conftest import TINY


def test_run_logs_to_a_tracking_server(cobench, mlflow_server):
    proc = cobench("run", "tracking=server", f"tracking.uri={mlflow_server}", "tracking.experiment=server-run", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("server-run")  # the shared server's: this test's own experiment
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["workload"] == "llama" and "throughput" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "fingerprint.json", "mllog_rep0.txt"} <= artifacts


def test_env_var_selects_the_server_too(cobench, mlflow_server):
    proc = cobench("run", "tracking.experiment=server-env", *TINY, extra_env={"MLFLOW_TRACKING_URI": mlflow_server})
    assert proc.returncode == 0, proc.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    assert len(client.search_runs([client.get_experiment_by_name("server-env").experiment_id])) == 1


def test_eight_concurrent_runs_into_a_server_on_postgresql(tmp_path, calibration_cache, postgres_mlflow_server):
    """The fleet set-up: `mlflow server` on PostgreSQL, eight cobench runs at once, nothing lost."""
    import subprocess
    import sys

    from conftest import clean_env
    from mlflow.tracking import MlflowClient

    procs = []
    for i in range(8):
        cmd = [sys.executable, "-m", "suite.cli", "run", "tracking=server", f"tracking.uri={postgres_mlflow_server}",
               "tracking.experiment=fleet", f"results_dir={tmp_path / f'r{i}'}", f"run_name=node{i}",
               f"platform.calibration_cache={calibration_cache}", *TINY]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=clean_env(), cwd=tmp_path))
    outputs = [p.communicate(timeout=600) for p in procs]
    failed = [f"node{i} exit {p.returncode}: {outputs[i][1][-1500:]}" for i, p in enumerate(procs) if p.returncode]
    assert not failed, failed
    client = MlflowClient(tracking_uri=postgres_mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("fleet").experiment_id], max_results=100)
    assert sorted(r.info.run_name for r in runs) == [f"node{i}" for i in range(8)]
    for run in runs:
        assert run.info.status == "FINISHED" and run.data.metrics["throughput"] > 0
        assert len(client.get_metric_history(run.info.run_id, "train_loss")) >= 4
        assert "fingerprint.json" in {a.path for a in client.list_artifacts(run.info.run_id)}


def test_a_server_that_goes_away_mid_run_loses_nothing(tmp_path, calibration_cache):
    """The server dies while a run trains: the run still finishes, its folder keeps everything and says
    it was not uploaded, exit 1 says so; with the server back, `cobench upload` records it."""
    import json
    import subprocess
    import sys
    import time

    from conftest import _free_port, clean_env, start_mlflow_server
    from mlflow.tracking import MlflowClient

    port, server_dir = _free_port(), tmp_path / "server"
    server_dir.mkdir()
    uri = f"http://127.0.0.1:{port}"
    server = start_mlflow_server(server_dir, port)
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "suite.cli", "run", "tracking=server", f"tracking.uri={uri}",
           f"results_dir={results}", f"platform.calibration_cache={calibration_cache}",
           "runner.warmup_steps=1", "runner.steps=300", "runner.progress=false", "workload.train_batches=2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                            cwd=tmp_path)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not list(results.glob("runs/*/mllog_rep0.txt")):
            time.sleep(0.2)
        server.terminate()  # mid-run: the run was created, its end cannot be recorded
        server.wait(timeout=30)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        for p in (proc, server):
            if p.poll() is None:
                p.kill()
    assert proc.returncode == 1, stderr[-3000:]
    (folder,) = list((results / "runs").iterdir())
    assert "cobench upload" in stdout + stderr and (folder / "upload_pending.json").exists()
    record = json.loads((folder / "metrics.json").read_text())
    assert record["status"] == "FINISHED" and record["metrics"]["throughput"] > 0 and record["losses"]

    server = start_mlflow_server(server_dir, port)  # the same store comes back
    try:
        up = subprocess.run([sys.executable, "-m", "suite.cli", "upload", str(folder)], capture_output=True,
                            text=True, timeout=300, env=clean_env())
        assert up.returncode == 0, up.stderr[-3000:]
        assert not (folder / "upload_pending.json").exists()
        client = MlflowClient(tracking_uri=uri)
        run = client.get_run(record["mlflow"]["run_id"])
        assert run.info.status == "FINISHED" and run.data.metrics["throughput"] == record["metrics"]["throughput"]
        assert len(client.get_metric_history(run.info.run_id, "train_loss")) == len(record["losses"])
        assert "mllog_rep0.txt" in {a.path for a in client.list_artifacts(run.info.run_id)}
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.parametrize("how", ["override", "environment"])
def test_a_tracking_uri_with_credentials_is_refused_and_the_secret_is_written_nowhere(cobench, tmp_path, how):
    """``http://user:secret@host`` would be stored wherever the run is written down (config.yaml, MLflow
    params, Hydra's folder, reports): refused before anything is written, the secret not echoed. (A user
    name alone is no secret: ``postgresql://cobench@host/db`` stays a valid store.)"""
    from harness.config import redacted_uri, uri_has_credentials

    assert not uri_has_credentials("postgresql://cobench@127.0.0.1:5432/mlflow")
    assert redacted_uri("postgresql://u:pw@db:5432/m") == "postgresql://u:***@db:5432/m"
    secret = "S3cret-pa55word"
    uri = f"http://bench:{secret}@127.0.0.1:9"
    args = ["run", "tracking=server", *([f"tracking.uri={uri}"] if how == "override" else []), *TINY]
    proc = cobench(*args, extra_env={"MLFLOW_TRACKING_URI": uri} if how == "environment" else None)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "carries credentials" in proc.stderr and "MLFLOW_TRACKING_PASSWORD" in proc.stderr
    assert "http://bench:***@127.0.0.1:9" in proc.stderr
    assert secret not in proc.stdout + proc.stderr
    written = [p for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert written == []


def test_an_authenticated_server_takes_its_writer_and_refuses_a_reader_and_a_wrong_password(cobench, tmp_path,
                                                                                              auth_mlflow_server):
    """MLflow's own auth app: credentials from MLflow's variables; a wrong password and a user who may only
    read are refused before any run exists (exit 2, said plainly); the writer's run is recorded; no password
    is written anywhere."""
    uri, passwords, runs = auth_mlflow_server

    def run_as(user: str, password: str):
        return cobench("run", "tracking=server", f"tracking.uri={uri}", *TINY,
                       extra_env={"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password})

    before = len(runs())
    proc = run_as("writer", "not-" + passwords["writer"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"the server {uri} refused these credentials (user 'writer')" in proc.stderr
    assert "Response body" not in proc.stderr  # not MLflow's raw text
    proc = run_as("reader", passwords["reader"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "user 'reader' may not write to experiment 'cobench'" in proc.stderr and "EDIT" in proc.stderr
    assert len(runs()) == before  # neither left a run on the server
    proc = run_as("writer", passwords["writer"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    (made,) = runs()[: len(runs()) - before]
    assert made.info.status == "FINISHED" and made.data.metrics["throughput"] > 0
    for password in passwords.values():
        assert password not in proc.stdout + proc.stderr
        assert [p for p in tmp_path.rglob("*") if p.is_file() and password.encode() in p.read_bytes()] == []
