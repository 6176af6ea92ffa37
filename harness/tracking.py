"""MLflow tracking through ``MlflowClient`` (no global "active run" state, so sweeps, suites and
nested runs in one process never step on each other).

Embedded default: ``sqlite:///<abs results_dir>/mlflow.db`` with artifacts in
``<results_dir>/mlartifacts``. A team server comes from ``tracking.uri`` or
``$MLFLOW_TRACKING_URI`` and is checked for reachability before any workload starts.
"""

from __future__ import annotations

import fcntl
import getpass
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from harness.config import TrackingConfig

MAX_PARAM_LENGTH = 6000  # MLflow's limit for a parameter value
BATCH_LIMIT = 100  # MLflow's limit of params (and tags) per log_batch call


class TrackingError(RuntimeError):
    """The tracking store cannot be used; the message says what to do."""


def resolve_tracking_uri(cfg: TrackingConfig, results_dir: Path) -> str:
    if cfg.uri:
        return cfg.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{results_dir / 'mlflow.db'}"


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


def check_server_reachable(uri: str, timeout_s: float) -> None:
    """Fail fast, with advice, if an HTTP tracking server does not answer its health check."""
    if not uri.startswith(("http://", "https://")):
        return
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (user's URI)
            if response.status == 200:
                return
            problem = f"HTTP {response.status}"
    except urllib.error.HTTPError as err:
        problem = f"HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        problem = str(getattr(err, "reason", err))
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


class Tracker:
    """One experiment in one tracking store; every call names its run explicitly."""

    def __init__(self, uri: str, experiment_id: str, results_dir: Path):
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.experiment_id = experiment_id
        self.results_dir = results_dir
        self.client = MlflowClient(tracking_uri=uri)

    @classmethod
    def connect(cls, cfg: TrackingConfig, results_dir: Path) -> Tracker:
        """Open (and on first use create) the store and the experiment."""
        uri = resolve_tracking_uri(cfg, results_dir)
        check_server_reachable(uri, cfg.connect_timeout_s)
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        # the store's own chatter (creating and migrating its tables) is not the user's business
        for name in ("mlflow.store.db.utils", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        is_local = uri.startswith("sqlite:")
        try:
            with _store_lock(results_dir) if is_local else nullcontext():
                client = MlflowClient(tracking_uri=uri)
                experiment = client.get_experiment_by_name(cfg.experiment)
                if experiment is None:
                    location = (results_dir / "mlartifacts").as_uri() if is_local else None
                    experiment_id = client.create_experiment(cfg.experiment, artifact_location=location)
                else:
                    experiment_id = experiment.experiment_id
        except MlflowException as err:
            raise TrackingError(f"cannot use MLflow tracking store {uri}: {err.message}") from err
        return cls(uri, experiment_id, results_dir)

    def start_run(self, name: str, tags: Mapping[str, Any], parent_run_id: str | None = None) -> str:
        all_tags = {"mlflow.user": getpass.getuser(), **{k: str(v) for k, v in tags.items()}}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        return run.info.run_id

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

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i : i + 1000])

    def log_series(self, run_id: str, key: str, values: list[float], first_step: int = 0) -> None:
        """A metric history, e.g. the loss per training step."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
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

