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
    assert [p.returncode for p in procs] == [0] * 8, [err[-1500:] for _, err in outputs]
    client = MlflowClient(tracking_uri=postgres_mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("fleet").experiment_id], max_results=100)
    assert sorted(r.info.run_name for r in runs) == [f"node{i}" for i in range(8)]
    for run in runs:
        assert run.info.status == "FINISHED" and run.data.metrics["throughput"] > 0
        assert len(client.get_metric_history(run.info.run_id, "train_loss")) >= 4
        assert "fingerprint.json" in {a.path for a in client.list_artifacts(run.info.run_id)}
