"""Shared helpers: run the real `cobench` command in a subprocess and read its MLflow store."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

# `nox -s tests` runs two xdist workers: the groups, and the lock that runs a timing-sensitive test with no neighbour
pytest_plugins = ["worker_groups"]

# What-if keeps what it measured for a bundle in the user's cache folder: the tests' go to a scratch one
# (in this process and in every command they start), not into the home of whoever runs them.
if "COBENCH_CACHE_DIR" not in os.environ:
    os.environ["COBENCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="cobench-test-cache-")
    atexit.register(shutil.rmtree, os.environ["COBENCH_CACHE_DIR"], ignore_errors=True)  # made here: gone after

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


def captured(step, bundle: Path, model=None) -> Path:
    """Capture ``step`` into ``bundle`` as the corpus tests do: one warm-up, one timed step, two traced steps."""
    from harness.traces.capture import capture

    with capture(bundle, steps=2, warmup=1, baseline_steps=1, model=model, announce=False) as cap:
        while not cap.done:
            with cap.step():
                step()
    return bundle


def replayed_op_by_op(step, bundle: Path, model=None):
    """Capture ``step`` (:func:`captured`), generate its spec and run its replay once op by op: returns the
    replayer and what failed in that dry run (op index → error)."""
    import torch

    from workloads.trace_replay.records import RankRecord
    from workloads.trace_replay.replay import Replayer
    from workloads.trace_replay.spec import generate_spec

    replayer = Replayer(RankRecord.from_json(generate_spec(captured(step, bundle, model))["ranks"][0]),
                        torch.device("cpu"), seed=3)
    replayer.materialize()
    return replayer, replayer.dry_run().errors


def mlflow_runs(results_dir: Path, experiment: str = "cobench") -> list:
    """All runs in the sqlite store under ``results_dir`` (read with MLflow's own client)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{results_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id], max_results=1000)


def run_ranks(target, store: str, world_size: int = 2, timeout: float = 120) -> tuple[list[dict], list[int | None]]:
    """``target(rank, store, results)`` in ``world_size`` spawned processes, each putting one dict with its
    ``rank`` on ``results``: those dicts by rank, and the processes' exit codes (one still running 30 s
    after the results came is killed)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, store, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        got = sorted((results.get(timeout=timeout) for _ in procs), key=lambda r: r["rank"])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return got, [p.exitcode for p in procs]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_mlflow_server(server_dir: Path, port: int, extra: tuple[str, ...] = (),
                        env: dict[str, str] | None = None) -> subprocess.Popen:
    """`mlflow server` on a sqlite store in ``server_dir`` (artifacts there too), answering its health check."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{server_dir / 'server.db'}", "--workers", "1", *extra],
        cwd=server_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
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


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory):
    """`mlflow server` on a sqlite store, started once per test session and shared: a test that counts or
    compares the runs it made logs them under an experiment of its own (``tracking.experiment=NAME``)."""
    port = _free_port()
    server_dir = tmp_path_factory.mktemp("server")
    proc = start_mlflow_server(server_dir, port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="session")
def auth_mlflow_server(tmp_path_factory: pytest.TempPathFactory):
    """An MLflow server with its own auth app (``--app-name basic-auth``), started once per test session:
    an admin; ``writer``, granted EDIT on the ``cobench`` experiment; ``reader``, with the default READ.
    Yields (uri, {user: password}, a function counting the experiment's runs as the admin)."""
    import secrets

    pytest.importorskip("flask_wtf", reason="MLflow's auth app needs mlflow[auth] (Flask-WTF)")
    from mlflow.server import get_app_client
    from mlflow.tracking import MlflowClient

    server_dir = tmp_path_factory.mktemp("auth_server")
    passwords = {user: f"{user}-{secrets.token_hex(8)}" for user in ("admin", "writer", "reader")}
    ini = server_dir / "auth.ini"
    ini.write_text(f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{server_dir / 'auth.db'}\n"
                   f"admin_username = admin\nadmin_password = {passwords['admin']}\n"
                   "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    env = clean_env() | {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16)}
    proc = start_mlflow_server(server_dir, port, ("--app-name", "basic-auth"), env)
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}

    def as_admin() -> None:
        os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = "admin", passwords["admin"]

    def restore() -> None:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)

    try:
        as_admin()
        auth = get_app_client("basic-auth", tracking_uri=uri)
        for user in ("writer", "reader"):
            auth.create_user(user, passwords[user])
        experiment = MlflowClient(uri).create_experiment("cobench")
        auth.grant_user_permission("writer", "experiment", experiment, "EDIT")
        restore()

        def runs() -> list:
            as_admin()
            try:
                return MlflowClient(uri).search_runs([experiment])
            finally:
                restore()

        yield uri, passwords, runs
    finally:
        restore()
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


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A single-node SLURM cluster on this machine for the whole test session (Debian's `slurm-wlm` and
    `munge`; .ci/run installs them): munged with its own key and socket, slurmctld and slurmd on free
    loopback ports, one partition `debug` with this machine's CPUs. Yields the environment a client
    needs (SLURM_CONF) and the partition's name."""
    import shutil

    missing = [c for c in ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "srun") if shutil.which(c) is None]
    if missing:
        pytest.skip(f"SLURM is not installed here ({', '.join(missing)} missing; Debian: apt-get install "
                    "slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("the scratch SLURM cluster runs its daemons as root (slurmd starts jobs as their user)")
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="hydra-submitit-launcher is not installed")
    base = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "log"):
        (base / sub).mkdir()
    key = base / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket_path = base / "munge.socket"
    subprocess.run([shutil.which("munged"), "--force", f"--socket={socket_path}", f"--key-file={key}",
                    f"--log-file={base / 'log' / 'munged.log'}", f"--pid-file={base / 'munged.pid'}",
                    f"--seed-file={base / 'munged.seed'}"], check=True, capture_output=True)
    memory_mb = int(open("/proc/meminfo").read().split()[1]) // 1024 // 2
    node = socket.gethostname().split(".")[0]
    conf = base / "slurm.conf"
    conf.write_text(f"""ClusterName=cobench-test
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={base / 'state'}
SlurmdSpoolDir={base / 'spool'}
SlurmctldPidFile={base / 'slurmctld.pid'}
SlurmdPidFile={base / 'slurmd.pid'}
SlurmctldLogFile={base / 'log' / 'slurmctld.log'}
SlurmdLogFile={base / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    subprocess.run([shutil.which("slurmctld"), "-f", str(conf)], check=True, env=env, capture_output=True)
    subprocess.run([shutil.which("slurmd"), "-f", str(conf)], check=True, env=env, capture_output=True)
    try:
        deadline = time.monotonic() + 60
        while "idle" not in subprocess.run(["sinfo", "--noheader", "--format=%T"], env=env, capture_output=True,
                                           text=True).stdout:
            if time.monotonic() > deadline:
                logs = (base / "log" / "slurmctld.log").read_text()[-2000:]
                pytest.fail(f"the scratch SLURM cluster did not come up: {logs}")
            time.sleep(0.5)
        yield {"env": {"SLURM_CONF": str(conf)}, "partition": "debug", "conf": conf}
    finally:
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munged.pid"):
            try:
                os.kill(int((base / pid_file).read_text()), signal.SIGTERM)
            except (OSError, ValueError):
                pass


@pytest.fixture
def one_thread():
    """Tiny ops gain nothing from 2 threads, and spinning ones crawl when other jobs share the CPU."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tls_ca(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A private CA made here, and a server certificate it signed for 127.0.0.1 and localhost (PEM files):
    {"ca": CA certificate, "cert": server certificate, "key": server key}."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = tmp_path_factory.mktemp("tls")
    now = datetime.datetime.now(datetime.UTC)
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cobench test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    server = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
              .issuer_name(ca_name).public_key(server_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
              .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                          x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                             critical=False)
              .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
              .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA256()))
    paths = {"ca": folder / "ca.pem", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(server_key.private_bytes(serialization.Encoding.PEM,
                                                      serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    paths["key"].chmod(0o600)
    return paths


class TeamServer:
    """A team's MLflow server as a fleet runs it (:func:`team_mlflow_server`): its https URI, the CA that signed
    its certificate, each user's password; :meth:`admin` acts as its admin in this process."""

    def __init__(self, uri: str, ca: Path, passwords: dict[str, str]):
        self.uri, self.ca, self.passwords = uri, ca, passwords

    def env(self, user: str) -> dict[str, str]:
        """What a host's `cobench` needs in its environment to write as ``user``."""
        return {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": self.passwords[user],
                "MLFLOW_TRACKING_SERVER_CERT_PATH": str(self.ca)}

    @contextlib.contextmanager
    def admin(self):
        """(MLflow client, auth app client), as the admin, for the ``with`` block (MLflow's clients read
        credentials from the environment only: it is set, then put back)."""
        from mlflow.server import get_app_client
        from mlflow.tracking import MlflowClient

        keys = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_SERVER_CERT_PATH")
        saved = {k: os.environ.get(k) for k in keys}
        os.environ.update(self.env("admin"))
        try:
            yield MlflowClient(self.uri), get_app_client("basic-auth", tracking_uri=self.uri)
        finally:
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


@pytest.fixture(scope="session")
def team_mlflow_server(postgres_uri: str, tls_ca: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """The team fleet of docs/fleets.md, once per test session: `mlflow server` on PostgreSQL (runs and, in a
    database of its own, the auth app's users and permissions) with MLflow's auth app, over TLS with a
    certificate from a private CA (uvicorn's own TLS), default permission READ. Users: ``admin``, ``writer``
    (EDIT on experiment ``cobench``), ``reader`` (READ only), ``host0``..``host3`` (no grant yet)."""
    import secrets
    import ssl
    from urllib.parse import urlsplit

    pytest.importorskip("flask_wtf", reason="MLflow's auth app needs mlflow[auth] (Flask-WTF)")
    pg = urlsplit(postgres_uri)
    for database in ("team", "team_auth"):  # its own databases: the session's other server keeps `mlflow`
        subprocess.run([_postgres_binary("createdb"), "-h", pg.hostname, "-p", str(pg.port), "-U", pg.username,
                        database], check=True, capture_output=True)
    store_uri = f"postgresql://{pg.username}@{pg.hostname}:{pg.port}/team"
    server_dir = tmp_path_factory.mktemp("team_server")
    users = ("admin", "writer", "reader", "host0", "host1", "host2", "host3")
    passwords = {user: f"{user}-{secrets.token_hex(8)}" for user in users}
    ini = server_dir / "auth.ini"
    ini.write_text(f"[mlflow]\ndefault_permission = READ\n"
                   f"database_uri = {store_uri}_auth\n"
                   f"admin_username = admin\nadmin_password = {passwords['admin']}\n"
                   "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                   # a password check costs the server ~0.3 s of CPU; a fleet's writers make many requests each
                   "auth_cache_ttl_seconds = 60\n")
    ini.chmod(0o600)
    port = _free_port()
    uri = f"https://127.0.0.1:{port}"
    env = clean_env() | {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
                         "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # GenAI job runners: a results store needs none
    log = (server_dir / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", store_uri, "--artifacts-destination", str(server_dir / "artifacts"),
         "--app-name", "basic-auth", "--workers", "1",
         "--uvicorn-opts", f"--ssl-certfile {tls_ca['cert']} --ssl-keyfile {tls_ca['key']}"],
        cwd=server_dir, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    context = ssl.create_default_context(cafile=str(tls_ca["ca"]))
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2, context=context) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                tail = (server_dir / "server.log").read_text()[-3000:]
                pytest.fail(f"the team's mlflow server did not come up: {tail}")
            time.sleep(0.5)
        server = TeamServer(uri, tls_ca["ca"], passwords)
        with server.admin() as (client, auth):
            for user in users[1:]:
                auth.create_user(user, passwords[user])
            auth.grant_user_permission("writer", "experiment", client.create_experiment("cobench"), "EDIT")
        yield server
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # `mlflow server` and the uvicorn it started
        try:
            proc.wait(timeout=10)  # uvicorn waits for idle keep-alive connections: no need to
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
