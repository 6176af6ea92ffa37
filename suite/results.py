"""Reading benchmark runs back from MLflow (the embedded sqlite store or any tracking server)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.config import TrackingConfig
from harness.recording.credentials import apply_tracking_credentials
from harness.recording.tracking import TrackingError, check_server_reachable

if TYPE_CHECKING:  # mlflow is imported when a store is opened
    from mlflow.tracking import MlflowClient

# Parent runs (suites, qualifications) carry a `kind` tag; benchmark runs do not.
PARENT_KINDS = ("suite", "qualification")


@dataclass
class RunRecord:
    run_id: str
    name: str
    status: str
    start: dt.datetime
    tags: dict[str, str]
    metrics: dict[str, float]
    parent_run_id: str | None
    params: dict[str, str] = field(default_factory=dict)  # the resolved config, flattened (MLflow params)

    @property
    def platform(self) -> str:
        return self.tags.get("platform", "?")


def open_store(uri: str | None, results_dir: Path, timeout_s: float = 10.0) -> MlflowClient:
    """An MlflowClient for ``uri`` (default: the sqlite store under ``results_dir``), checked first."""
    from mlflow.tracking import MlflowClient

    if uri is None:
        db = Path(results_dir).expanduser().resolve() / "mlflow.db"
        if not db.is_file():
            raise TrackingError(f"no tracking store at {db}: run a benchmark first (`cobench suite smoke`), or "
                                f"point --results-dir / --tracking-uri at the store to read")
        uri = f"sqlite:///{db}"
    # a reader's credentials come as a writer's do: MLflow's variables or an owner-only file; a private CA
    apply_tracking_credentials(TrackingConfig(uri=uri), uri)
    check_server_reachable(uri, timeout_s)
    return MlflowClient(tracking_uri=uri)


def parse_date(text: str | None, flag: str) -> dt.datetime | None:
    if text is None:
        return None
    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a date (use YYYY-MM-DD or an ISO time)") from None
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def find_runs(client: Any, *, experiment: str = "cobench", suite: str | None = None, workload: str | None = None,
              benchmark: str | None = None, tags: dict[str, str] | None = None, since: dt.datetime | None = None,
              until: dt.datetime | None = None, status: str | None = "FINISHED") -> list[RunRecord]:
    """Benchmark runs (not suite parents) matching every filter given, oldest first."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    clauses = []
    for key, value in [("suite", suite), ("workload", workload), ("benchmark", benchmark), *(tags or {}).items()]:
        if value is not None:
            clauses.append(f"tags.`{key}` = '{value}'")
    if status:
        clauses.append(f"attributes.status = '{status}'")
    if since is not None:
        clauses.append(f"attributes.start_time >= {int(since.timestamp() * 1000)}")
    if until is not None:
        clauses.append(f"attributes.start_time < {int(until.timestamp() * 1000)}")
    records, token = [], None
    while True:
        page = client.search_runs([exp.experiment_id], filter_string=" and ".join(clauses), max_results=1000,
                                  order_by=["attributes.start_time ASC"], page_token=token)
        for run in page:
            if run.data.tags.get("kind") in PARENT_KINDS:
                continue
            records.append(RunRecord(
                run.info.run_id, run.info.run_name or "", run.info.status,
                dt.datetime.fromtimestamp(run.info.start_time / 1000, dt.UTC), dict(run.data.tags),
                dict(run.data.metrics), run.data.tags.get("mlflow.parentRunId"), dict(run.data.params),
            ))
        token = page.token
        if not token:
            return records
