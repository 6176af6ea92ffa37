"""A team's tracking server: `mlflow server` on loopback, reached through tracking=server."""

from __future__ import annotations

from conftest import TINY


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
