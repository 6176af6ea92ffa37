"""MLflow tracking through ``MlflowClient`` (no global "active run" state, so sweeps, suites and
nested runs in one process never step on each other).

Embedded default: ``sqlite:///<abs results_dir>/mlflow.db`` with artifacts in
``<results_dir>/mlartifacts``. A team server comes from ``tracking.uri`` or
``$MLFLOW_TRACKING_URI`` and is checked for reachability before any workload starts.

One truth per run: every run records the host and process that own it (tags ``cobench.host``,
``cobench.pid``, ``cobench.pid_started``); the runs a process has open are known
(:func:`close_open_runs` closes what an interrupt or a crash left); and a run still ``RUNNING``
whose process no longer exists is closed ``FAILED`` by the next :meth:`Tracker.connect` on that host
(:meth:`Tracker.reap_stale`, also ``cobench reap``).
"""

from __future__ import annotations

import fcntl
import getpass
import logging
import os
import socket
import sqlite3
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import closing, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from harness.config import CREDENTIALS_ADVICE, TrackingConfig, redacted_uri, uri_has_credentials
from harness.distributed import process_started
from harness.recording.credentials import (
    CredentialsError,
    apply_tracking_credentials,
    tls_context,
    untrusted_certificate_advice,
)

MAX_PARAM_LENGTH = 6000  # MLflow's limit for a parameter value
BATCH_LIMIT = 100  # MLflow's limit of params (and tags) per log_batch call


logger = logging.getLogger(__name__)

HOST_TAG, PID_TAG, PID_STARTED_TAG = "cobench.host", "cobench.pid", "cobench.pid_started"


class TrackingError(RuntimeError):
    """The tracking store cannot be used; the message says what to do."""


# Runs this process started and has not closed: (store URI, run id) → (tracker, run name). An
# interrupt or a crash that escapes the run path closes them (close_open_runs): none stays RUNNING.
_OPEN_RUNS: dict[tuple[str, str], tuple[Tracker, str]] = {}
_CLOSED_RUNS: list[tuple[str, str, str | None]] = []  # (name, status, reason), in closing order


def close_open_runs(status: str, reason: str) -> list[str]:
    """Close every run this process still has open; returns their names."""
    names = []
    for (_, run_id), (tracker, name) in list(_OPEN_RUNS.items()):
        try:
            tracker.end_run(run_id, status, reason)
        except Exception as err:  # noqa: BLE001 - the store may be what failed; say so, close the others
            logger.warning("could not close MLflow run %s (%s) as %s: %s", name, run_id, status, err)
        names.append(name)
    return names


def closed_runs(since: int = 0) -> list[tuple[str, str, str | None]]:
    """(name, status, reason) of the runs this process closed, oldest first; ``since``: skip the
    first ones (a command reports the runs it closed itself: pass ``len(closed_runs())`` from its start)."""
    return list(_CLOSED_RUNS[since:])


def _owner_tags() -> dict[str, str]:
    started = process_started(os.getpid()) or time.time()
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid()), PID_STARTED_TAG: f"{started:.3f}"}


def resolve_tracking_uri(cfg: TrackingConfig, results_dir: Path) -> str:
    """The store's URI: ``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else the embedded sqlite store.
    A URI with credentials in it is refused (it would be written down wherever the run is)."""
    uri = cfg.uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{results_dir / 'mlflow.db'}"
    if uri_has_credentials(uri):
        where = "tracking.uri" if cfg.uri else "MLFLOW_TRACKING_URI"
        raise TrackingError(f"{where} {redacted_uri(uri)} carries credentials; {CREDENTIALS_ADVICE}")
    return uri


def flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``: how nested config becomes MLflow params."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def store_refusal(uri: str, experiment: str, err: Any) -> str:
    """What to tell the user when the store said no (``err``: MLflow's exception): who was refused what,
    and what to do, without MLflow's raw response."""
    from mlflow.utils.credentials import read_mlflow_creds

    user = read_mlflow_creds().username  # MLflow's variable, else its own credentials file: whom the server saw
    if err.error_code == "UNAUTHENTICATED":
        given = f"user {user!r}" if user else ("a token" if os.environ.get("MLFLOW_TRACKING_TOKEN") else "none given")
        return (f"the server {uri} refused these credentials ({given}): set MLFLOW_TRACKING_USERNAME and "
                "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) to a user of its auth app")
    if err.error_code == "PERMISSION_DENIED":
        return (f"user {user!r} may not write to experiment {experiment!r} on {uri}: a run needs EDIT (or MANAGE) "
                "permission on it; its owner or an admin grants it (MLflow's auth app: "
                f"grant_user_permission({user!r}, 'experiment', <id>, 'EDIT')), or use an experiment you may write")
    return f"cannot use MLflow tracking store {uri}: {err.message}"


def check_server_reachable(uri: str, timeout_s: float) -> None:
    """Fail fast, with advice, if an HTTP tracking server does not answer its health check."""
    if not uri.startswith(("http://", "https://")):
        return
    url = uri.rstrip("/") + "/health"
    context = tls_context() if uri.startswith("https://") else None
    try:
        # the user's own tracking URI, http(s) only (checked above)
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as response:
            if response.status == 200:
                return
            problem = f"HTTP {response.status}"
    except urllib.error.HTTPError as err:
        problem = f"HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, ssl.SSLCertVerificationError):  # up, but not to be trusted: never go on insecurely
            raise TrackingError(untrusted_certificate_advice(uri, reason)) from None
        problem = str(reason)
    raise TrackingError(
        f"MLflow tracking server {uri} is unreachable ({problem}). Start it (e.g. `mlflow server "
        f"--backend-store-uri sqlite:///mlflow.db --port 5000`), fix tracking.uri / "
        f"MLFLOW_TRACKING_URI, or use the local store with tracking=sqlite."
    )


@contextmanager
def _store_lock(results_dir: Path) -> Iterator[None]:
    """Serialise schema creation/upgrade of a fresh sqlite store across processes."""
    results_dir.mkdir(parents=True, exist_ok=True)
    with open(results_dir / ".mlflow.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _write_ahead_log(uri: str) -> None:
    """Put a sqlite store in WAL mode (kept in the file: once is enough). Runs on one host share one store
    while others read it (`cobench compare`, `cobench report`, `mlflow ui`): in WAL mode a reader never holds
    up a writer's commit, and writers wait on each other only for a commit (MLflow waits up to 20 s)."""
    path = uri.removeprefix("sqlite:///")
    if not path or path == ":memory:" or uri.startswith("sqlite:///file:"):
        return
    with closing(sqlite3.connect(path, timeout=30)) as db:
        if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            db.execute("PRAGMA journal_mode=WAL")


def _tag_last_writer(client: Any, experiment_id: str, writer: str, attempts: int = 5) -> None:
    """Tag the experiment with who writes to it. MLflow's SQL store sets a tag by looking it up, then
    inserting it: several runs starting at once against one server (a fleet) can all find it missing,
    and every insert but the first then fails its unique key. Those try again and update it instead."""
    from mlflow.exceptions import MlflowException

    for attempt in range(attempts):
        try:
            client.set_experiment_tag(experiment_id, "cobench.last_writer", writer)
            return
        except MlflowException as err:
            lost_race = err.error_code == "BAD_REQUEST" and any(word in str(err).lower()
                                                                for word in ("unique", "duplicate"))
            if not lost_race or attempt == attempts - 1:
                raise
            time.sleep(0.05 * (attempt + 1))


class Tracker:
    """One experiment in one tracking store; every call names its run explicitly."""

    def __init__(self, uri: str, experiment_id: str, results_dir: Path, experiment: str | None = None):
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.experiment_id = experiment_id
        self.experiment = experiment or f"id {experiment_id}"  # its name, where known: for messages
        self.results_dir = results_dir
        self.client = MlflowClient(tracking_uri=uri)

    def failure(self, err: Exception) -> str:
        """Why a write failed, for the user: a refusal (credentials gone, permission revoked) said plainly
        (:func:`store_refusal`), anything else as raised."""
        if getattr(err, "error_code", None) in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            return store_refusal(self.uri, self.experiment, err)
        return f"{type(err).__name__}: {err}"

    @classmethod
    def connect(cls, cfg: TrackingConfig, results_dir: Path, reap: bool = True) -> Tracker:
        """Open (and on first use create) the store and the experiment; with ``reap``, close the
        runs this host's dead processes left RUNNING (:meth:`reap_stale`), each with a warning."""
        uri = resolve_tracking_uri(cfg, results_dir)
        try:
            apply_tracking_credentials(cfg, uri)
        except CredentialsError as err:
            raise TrackingError(str(err)) from None
        check_server_reachable(uri, cfg.connect_timeout_s)
        if uri.startswith(("http://", "https://")):
            # MLflow's client retries a lost server for minutes by default; a run that ends while the
            # server is away should say so soon and keep its record locally (cobench upload)
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(10, int(cfg.connect_timeout_s))))
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        # the store's own chatter (creating and migrating its tables) is not the user's business
        for name in ("mlflow.store.db.utils", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        is_local = uri.startswith("sqlite:")
        try:
            with _store_lock(results_dir) if is_local else nullcontext():
                client = MlflowClient(tracking_uri=uri)
                experiment_id = cls._experiment_id(client, cfg.experiment,
                                                   (results_dir / "mlartifacts").as_uri() if is_local else None)
                if is_local:
                    _write_ahead_log(uri)
                else:  # a run writes: a user who may only read is refused now, before any run exists
                    _tag_last_writer(client, experiment_id, f"{getpass.getuser()}@{socket.gethostname()}")
        except MlflowException as err:
            raise TrackingError(store_refusal(uri, cfg.experiment, err)) from err
        tracker = cls(uri, experiment_id, results_dir, cfg.experiment)
        for run_id, name, reason in tracker.reap_stale() if reap else []:
            logger.warning("closed a stale MLflow run %s (%s) as FAILED: %s", name, run_id, reason)
        return tracker

    @staticmethod
    def _experiment_id(client: Any, name: str, location: str | None) -> str:
        """The experiment's id, creating it on first use. Several processes may start at once against
        one server (a fleet, a sweep): the ones that lose the race to create it take the winner's."""
        from mlflow.exceptions import MlflowException

        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def start_run(self, name: str, tags: Mapping[str, Any], parent_run_id: str | None = None) -> str:
        all_tags = {"mlflow.user": getpass.getuser(), **_owner_tags(), **{k: str(v) for k, v in tags.items()}}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        _OPEN_RUNS[(self.uri, run.info.run_id)] = (self, name)
        return run.info.run_id

    def reap_stale(self) -> list[tuple[str, str, str]]:
        """Close as FAILED the runs still RUNNING whose owner process on this host is gone.

        A run is stale when its ``cobench.host`` is this host and its ``cobench.pid`` is no longer
        running, or is a newer process that reused the pid. Runs of other hosts cannot be checked
        from here and are left alone. Returns (run id, run name, reason) of those closed.
        """
        host = socket.gethostname()
        runs = self.client.search_runs(
            [self.experiment_id], filter_string=f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = '{host}'",
            max_results=1000,
        )
        closed = []
        for run in runs:
            tags = run.data.tags
            try:
                pid, owner_started = int(tags[PID_TAG]), float(tags.get(PID_STARTED_TAG, "0"))
            except (KeyError, ValueError):
                continue
            if pid == os.getpid():
                continue
            started = process_started(pid)
            if started is not None and (not owner_started or started <= owner_started + 1.0):
                continue  # its process is still there
            reason = (f"process {pid} on {host} ended without closing this run (killed, or the machine went "
                      f"down); closed by cobench at {time.strftime('%Y-%m-%d %H:%M:%S')}")
            self.end_run(run.info.run_id, "FAILED", reason)
            closed.append((run.info.run_id, run.info.run_name, reason))
        return closed

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in flatten(params).items()]
        for i in range(0, len(items), BATCH_LIMIT):
            self.client.log_batch(run_id, params=items[i : i + BATCH_LIMIT])

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in tags.items()]
        for i in range(0, len(items), BATCH_LIMIT):
            self.client.log_batch(run_id, tags=items[i : i + BATCH_LIMIT])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int = 0,
                    timestamp_ms: int | None = None) -> None:
        from mlflow.entities import Metric

        now = timestamp_ms or int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i : i + 1000])

    def log_series(self, run_id: str, key: str, values: list[float], first_step: int = 0,
                   timestamp_ms: int | None = None) -> None:
        """A metric history, e.g. the loss per training step."""
        from mlflow.entities import Metric

        now = timestamp_ms or int(time.time() * 1000)
        items = [Metric(key, float(v), now, first_step + i) for i, v in enumerate(values)]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i : i + 1000])

    def log_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def end_run(self, run_id: str, status: str, reason: str | None = None) -> None:
        """Close a run FINISHED, FAILED or KILLED; a failure's reason goes into tag ``error``."""
        if reason:
            self.set_tags(run_id, {"error": reason})
        self.client.set_terminated(run_id, status=status)
        opened = _OPEN_RUNS.pop((self.uri, run_id), None)
        if opened is not None:
            _CLOSED_RUNS.append((opened[1], status, reason))

