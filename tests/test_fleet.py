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

import pytest
from conftest import clean_env, mlflow_runs

# The smallest Llama run that still goes through every part of a run (a few ms a step on one thread):
# what the fleet tests time is the writing, not the training.
SMALL = ["workload=llama", "workload.dim=32", "workload.n_layers=1", "workload.n_heads=2", "workload.n_kv_heads=2",
         "workload.batch_size=2", "workload.seq_len=16", "workload.train_batches=2", "workload.eval_batches=1",
         "runner.warmup_steps=1", "runner.steps=3", "runner.eval_interval=0", "runner.progress=false",
         "platform.calibrate=false", "platform.num_threads=1"]


@pytest.fixture
def own_environ():
    """This process's environment put back as it was after the test: opening a store sets MLflow's variables
    (a credentials file's, a CA's), and monkeypatch.delenv of an unset name would not undo that."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


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


def test_credentials_files_that_others_may_read_or_that_hold_none_are_refused(own_environ, tmp_path):
    """MLflow's own ~/.mlflow/credentials (its client reads it by itself) must be owner-only too; a file with
    no credentials, or none at all, is named with what to write in it. The password is never in a message."""
    from harness.config import TrackingConfig
    from harness.recording.credentials import CredentialsError, apply_tracking_credentials

    os.environ["HOME"] = str(tmp_path)
    os.environ.pop("MLFLOW_TRACKING_SERVER_CERT_PATH", None)
    uri = "https://tracking-host:5000"
    (tmp_path / ".mlflow").mkdir()
    mlflow_file = credentials_file(tmp_path / ".mlflow", "bench", "pa55-word", mode=0o604)
    mlflow_file.rename(tmp_path / ".mlflow" / "credentials")
    with pytest.raises(CredentialsError, match=r"MLflow's credentials file .*credentials may be read by others "
                                               r"\(mode 604\).*chmod 600"):
        apply_tracking_credentials(TrackingConfig(uri=uri), uri)
    apply_tracking_credentials(TrackingConfig(uri="sqlite:///x.db"), "sqlite:///x.db")  # no server: not read
    (tmp_path / ".mlflow" / "credentials").chmod(0o600)
    apply_tracking_credentials(TrackingConfig(uri=uri), uri)

    empty = tmp_path / "empty.ini"
    empty.write_text("[default]\npassword = pa55-word\n")
    empty.chmod(0o600)
    for path, expected in ((empty, "holds no credentials: it needs a section [mlflow]"),
                           (tmp_path / "missing.ini", "does not exist: create it (mode 600)")):
        with pytest.raises(CredentialsError) as refused:
            apply_tracking_credentials(TrackingConfig(uri=uri, credentials_file=str(path)), uri)
        assert expected in str(refused.value) and "pa55-word" not in str(refused.value)
    with pytest.raises(CredentialsError, match="tracking.server_cert .*nowhere.pem does not exist"):
        apply_tracking_credentials(TrackingConfig(uri=uri, server_cert=str(tmp_path / "nowhere.pem")), uri)


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


def test_a_team_server_refuses_unsafe_or_unentitled_writers_before_any_run(own_environ, tmp_path,
                                                                           team_mlflow_server):
    """PostgreSQL + MLflow's auth app + TLS with a private CA, opened as every run opens its store: a
    credentials file others may read is refused, naming it and the chmod; the server's certificate without
    its CA is refused (never used unchecked); a user who may only read is refused, naming the experiment and
    EDIT; none leaves a run on the server. (In process: the exit code these errors give is tested with
    `cobench run` in test_tracking_server.py.)"""
    from harness.config import TrackingConfig
    from harness.recording.tracking import Tracker, TrackingError

    server = team_mlflow_server
    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                "MLFLOW_TRACKING_SERVER_CERT_PATH"):
        os.environ.pop(key, None)

    def connect(credentials: Path, cert: Path | None) -> str:
        cfg = TrackingConfig(uri=server.uri, credentials_file=str(credentials), server_cert=str(cert) if cert else None)
        with pytest.raises(TrackingError) as refused:
            Tracker.connect(cfg, tmp_path)
        return str(refused.value)

    readable = credentials_file(tmp_path, "writer", server.passwords["writer"], mode=0o644)
    message = connect(readable, server.ca)
    assert f"{readable} may be read by others (mode 644)" in message and f"chmod 600 {readable}" in message
    own = credentials_file(tmp_path, "writer", server.passwords["writer"])
    message = connect(own, None)
    assert f"the TLS certificate of {server.uri} is not trusted" in message and "tracking.server_cert=" in message
    reader = credentials_file(tmp_path, "reader", server.passwords["reader"])
    message = connect(reader, server.ca)
    assert "user 'reader' may not write to experiment 'cobench'" in message and "EDIT" in message
    wrong = credentials_file(tmp_path, "host0", "not-" + server.passwords["host0"])
    assert "refused these credentials (user 'host0')" in connect(wrong, server.ca)
    for secret in server.passwords.values():
        assert secret not in message
    with server.admin() as (client, _):
        assert client.search_runs([client.get_experiment_by_name("cobench").experiment_id]) == []


def test_a_writer_with_an_owner_only_credentials_file_writes_over_tls_and_no_secret_is_written(
        tmp_path, tmp_path_factory, calibration_cache, team_mlflow_server):
    """The writer's suite (one tiny benchmark), with an owner-only credentials file and tracking.server_cert,
    FINISHES on the team server, and a submission report is made from it. No password is in any file of the
    results folder (run folder, MLPerf logs, Hydra's folder), of the report, in any MLflow param, tag or
    metric name, or in anything printed."""
    server = team_mlflow_server
    secrets_dir = tmp_path_factory.mktemp("secrets")  # outside what cobench writes: the grep below is honest
    own = credentials_file(secrets_dir, "writer", server.passwords["writer"])
    cmd = cobench_cmd("suite", "smoke", "suite.only=[llama_tiny_train]", "runner.repetitions=1",
                      "runner.progress=false", "platform.calibrate=false", "tracking=server",
                      f"tracking.uri={server.uri}", f"tracking.credentials_file={own}",
                      f"tracking.server_cert={server.ca}", f"results_dir={tmp_path / 'results'}",
                      f"platform.calibration_cache={calibration_cache}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reader_env = {"MLFLOW_TRACKING_SERVER_CERT_PATH": str(server.ca)}  # and the reader's file as MLflow's own
    home = tmp_path_factory.mktemp("home")
    (home / ".mlflow").mkdir()
    credentials_file(home / ".mlflow", "reader", server.passwords["reader"]).rename(home / ".mlflow" / "credentials")
    report = subprocess.run(cobench_cmd("report", f"tracking.uri={server.uri}", "--out", str(tmp_path / "report")),
                            capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env=clean_env() | reader_env | {"HOME": str(home)})
    assert report.returncode == 0, report.stderr[-3000:]
    assert (tmp_path / "report" / "report.html").is_file()
    with server.admin() as (client, _):
        runs = client.search_runs([client.get_experiment_by_name("cobench").experiment_id])
        assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)  # the suite's and its benchmark's
        (child,) = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
        assert child.data.metrics["throughput"] > 0
        stored = [(k, v) for r in runs for k, v in [*r.data.params.items(), *r.data.tags.items()]]
        stored += [(k, "") for r in runs for k in r.data.metrics]
        artifacts = {a.path for a in client.list_artifacts(child.info.run_id)}
    assert {"config.yaml", "fingerprint.json", "metrics.json", "mllog_rep0.txt"} <= artifacts
    assert any(k == "tracking.credentials_file" for k, _ in stored)  # the file's name is no secret; its content is
    for secret in server.passwords.values():
        assert secret not in proc.stdout + proc.stderr + report.stdout + report.stderr
        assert files_holding(tmp_path, secret) == []
        assert [(k, v) for k, v in stored if secret in k or secret in v] == []


def test_a_permission_revoked_mid_run_keeps_the_run_for_upload(tmp_path, calibration_cache, team_mlflow_server):
    """host0 may write to experiment ``revoked`` when its run starts; the admin revokes that while it trains.
    The run finishes locally, keeps everything with upload_pending.json and exits 1 saying why (as when the
    server is away); granted again, `cobench upload` records it."""
    server = team_mlflow_server
    with server.admin() as (client, auth):
        experiment = client.create_experiment("revoked")
        auth.grant_user_permission("host0", "experiment", experiment, "EDIT")
    results = tmp_path / "results"
    # long enough (seconds) to revoke in: a run writes to the store when it opens and when it ends
    cmd = cobench_cmd("run", "tracking=server", f"tracking.uri={server.uri}", "tracking.experiment=revoked",
                      *SMALL, "runner.steps=1500", f"results_dir={results}",
                      f"platform.calibration_cache={calibration_cache}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env() | server.env("host0"), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not list(results.glob("runs/*/mllog_rep0.txt")):  # its MLflow run exists: it is training
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        with server.admin() as (_, auth):
            auth.revoke_user_permission("host0", "experiment", experiment)  # back to the default: READ
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    assert "user 'host0' may not write to experiment 'revoked'" in stdout + stderr
    assert "cobench upload" in stdout + stderr and "Response body" not in stdout + stderr
    (folder,) = (results / "runs").iterdir()
    record = json.loads((folder / "metrics.json").read_text())
    assert record["status"] == "FINISHED" and len(record["losses"]) >= 1500
    assert "may not write" in json.loads((folder / "upload_pending.json").read_text())["error"]

    with server.admin() as (_, auth):
        auth.grant_user_permission("host0", "experiment", experiment, "EDIT")
    up = subprocess.run(cobench_cmd("upload", str(folder)), capture_output=True, text=True, timeout=300,
                        env=clean_env() | server.env("host0"))
    assert up.returncode == 0, up.stderr[-3000:]
    with server.admin() as (client, _):
        run = client.get_run(record["mlflow"]["run_id"])
        assert run.info.status == "FINISHED" and run.data.metrics["throughput"] == record["metrics"]["throughput"]
        assert len(client.get_metric_history(run.info.run_id, "train_loss")) == len(record["losses"])


def test_sixteen_runs_from_four_hosts_at_once_into_the_team_server(tmp_path, team_mlflow_server):
    """Four processes, each a host with its own user (EDIT on experiment ``fleet``), each recording four runs
    at once through cobench's run path (tests/fleet_writer.py: the store opened as `cobench run` opens it,
    then open_run and write_and_publish on each run; no model is trained, so the 2-core CI machine spends
    its time on the writing): 16 runs in flight on the PostgreSQL-backed, authenticated TLS server. All
    FINISHED, every metric value there (counted), within a CI-sized time."""
    from fleet_writer import RUN_METRICS, RUN_STEPS

    server = team_mlflow_server
    hosts = ["host0", "host1", "host2", "host3"]
    with server.admin() as (client, auth):
        experiment = client.create_experiment("team-fleet")
        for host in hosts:
            auth.grant_user_permission(host, "experiment", experiment, "EDIT")
    writer = str(Path(__file__).parent / "fleet_writer.py")
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, writer, str(tmp_path / host), "4", "workload=llama", "platform=cpu",
                               "platform.calibrate=false", "tracking=server", f"tracking.uri={server.uri}",
                               "tracking.experiment=team-fleet", f"run_name={host}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=clean_env() | server.env(host) | {"PYTHONPATH": os.pathsep.join(sys.path)})
             for host in hosts]
    outputs = [p.communicate(timeout=300) for p in procs]
    wall_s = time.monotonic() - started
    assert [p.returncode for p in procs] == [0] * 4, [err[-2000:] for _, err in outputs]
    with server.admin() as (client, _):
        runs = client.search_runs([experiment], max_results=100)
        found = sum(len(client.get_metric_history(r.info.run_id, key)) for r in runs for key in r.data.metrics)
    expected = 16 * (RUN_METRICS + RUN_STEPS)
    print(f"team server: {len(runs)} runs from 4 processes, {found}/{expected} metric values, {wall_s:.1f} s")
    assert sorted(r.info.run_name for r in runs) == sorted(f"{h}-{i}" for h in hosts for i in range(4))
    assert all(r.info.status == "FINISHED" for r in runs)
    assert found == expected
    assert {r.data.tags["fleet_host"] for r in runs} and all(r.data.params for r in runs)


def test_eight_cobench_runs_at_once_into_one_embedded_store(tmp_path, calibration_cache):
    """The default set-up shared on one host: eight `cobench run` at once into one sqlite store (one results
    folder), a fresh one: they race to create it. All FINISHED with every metric value (counted against each
    run folder's metrics.json), no "database is locked" (the store is put in WAL mode when opened)."""
    results = tmp_path / "results"
    started = time.monotonic()
    procs = [subprocess.Popen(cobench_cmd("run", *SMALL, f"results_dir={results}", f"run_name=local{i}",
                                          f"seed={i}", f"platform.calibration_cache={calibration_cache}"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=tmp_path)
             for i in range(8)]
    outputs = [p.communicate(timeout=600) for p in procs]
    wall_s = time.monotonic() - started
    assert [p.returncode for p in procs] == [0] * 8, [err[-2000:] for _, err in outputs]
    assert not [err for _, err in outputs if "database is locked" in err]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    runs = mlflow_runs(results)
    records = [json.loads(p.read_text()) for p in results.glob("runs/*/metrics.json")]
    expected = sum(len(r["metrics"]) + len(r["losses"]) + sum(len(q) for _, q in r["quality_history"])
                   for r in records)
    found = sum(len(client.get_metric_history(r.info.run_id, key)) for r in runs for key in r.data.metrics
                if key != "peak_flops")
    print(f"embedded sqlite: {len(runs)} runs from 8 processes, {found}/{expected} metric values, {wall_s:.1f} s")
    assert sorted(r.info.run_name for r in runs) == [f"local{i}" for i in range(8)]
    assert all(r.info.status == "FINISHED" for r in runs)
    assert found == expected
