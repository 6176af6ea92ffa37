"""SLURM through Hydra's submitit launcher, against a real single-node cluster started for the session
(``slurm_cluster`` in conftest: munged, slurmctld, slurmd on this machine)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

# every benchmark of the smoke suite, a few steps each: what is tested is the launch, not the figures
FEW_STEPS = ["runner.warmup_steps=1", "runner.steps=4", "runner.eval_interval=2", "runner.repetitions=1",
             "runner.progress=false"]


def job_logs(results, chars: int = 1500) -> str:
    """The end of every SLURM job's log under ``results`` (a failed launch's assertion says what the jobs said)."""
    logs = sorted((results / "hydra").glob("multirun-*/.submitit/*/*_log.*"))
    return "".join(f"\n--- {log.name}\n{log.read_text(errors='replace')[-chars:]}" for log in logs)


def test_a_suite_on_slurm_one_job_per_benchmark_two_tasks_each_into_postgresql(
        cobench, tmp_path, slurm_cluster, postgres_mlflow_server):
    """`cobench suite smoke hydra/launcher=submitit_slurm` (its three training benchmarks): one SLURM job per
    benchmark, each two srun tasks joined into one process group, every run a child of the suite's parent in
    the PostgreSQL-backed server."""
    from mlflow.tracking import MlflowClient

    proc = cobench("suite", "smoke", "suite.only=[llama_tiny_train,dlrm_tiny_train,seqrec_tiny_train]",
                   "hydra/launcher=submitit_slurm",
                   f"hydra.launcher.partition={slurm_cluster['partition']}", "hydra.launcher.tasks_per_node=2",
                   "hydra.launcher.timeout_min=10", "tracking=server", f"tracking.uri={postgres_mlflow_server}",
                   "tracking.experiment=slurm", *FEW_STEPS, timeout=900, extra_env=slurm_cluster["env"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + job_logs(tmp_path / "results")
    for name in ("llama_tiny_train", "dlrm_tiny_train", "seqrec_tiny_train"):
        assert name in proc.stdout  # the summary came back from the jobs
    client = MlflowClient(tracking_uri=postgres_mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("slurm").experiment_id], max_results=100)
    (parent,) = [r for r in runs if r.data.tags.get("kind") == "suite"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FINISHED" and parent.data.metrics["benchmarks_failed"] == 0
    assert sorted(r.info.run_name for r in children) == ["dlrm_tiny_train", "llama_tiny_train", "seqrec_tiny_train"]
    for run in children:
        assert run.info.status == "FINISHED" and run.data.metrics["throughput"] > 0
        assert run.data.tags["world_size"] == "2"  # the job's two tasks trained as one process group
        assert parent.data.metrics[f"{run.info.run_name}.throughput"] == run.data.metrics["throughput"]
    # each job ran under SLURM: submitit's folder holds one job per benchmark, two tasks each
    logs = sorted((tmp_path / "results" / "hydra").glob("multirun-*/.submitit/*/*_log.out"))
    assert len(logs) == 6, logs


def test_a_sweep_on_slurm_brings_its_results_back(cobench, tmp_path, slurm_cluster):
    """`cobench run -m ... hydra/launcher=submitit_slurm`: the jobs run on the cluster, the submitting
    process prints every job's row (results travel back as JSON), exit 0."""
    from conftest import mlflow_runs

    proc = cobench("run", "-m", "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=8",
                   "workload=llama", "workload.preset=tiny", "workload.n_layers=1,2", *FEW_STEPS,
                   timeout=600, extra_env=slurm_cluster["env"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "n_layers=1" in proc.stdout and "n_layers=2" in proc.stdout
    runs = mlflow_runs(tmp_path / "results")
    assert sorted(r.data.params["workload.n_layers"] for r in runs) == ["1", "2"]
    assert all(r.info.status == "FINISHED" for r in runs)


def test_a_partition_that_does_not_exist_is_refused_before_anything_is_submitted(cobench, tmp_path, slurm_cluster):
    proc = cobench("suite", "smoke", "hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu_big",
                   *FEW_STEPS, extra_env=slurm_cluster["env"])
    assert proc.returncode == 2
    assert "hydra.launcher.partition" in proc.stderr and "'gpu_big'" in proc.stderr and "debug" in proc.stderr
    assert not (tmp_path / "results" / "mlflow.db").exists()  # no parent run, no job


def test_an_unreachable_scheduler_is_refused_with_what_to_check(cobench, tmp_path, slurm_cluster):
    from conftest import _free_port

    conf = tmp_path / "slurm.conf"  # the same cluster's config, pointing at a port no controller listens on
    text = slurm_cluster["conf"].read_text()
    port_line = next(line for line in text.splitlines() if line.startswith("SlurmctldPort="))
    conf.write_text(text.replace(port_line, f"SlurmctldPort={_free_port()}"))
    proc = cobench("run", "-m", "hydra/launcher=submitit_slurm", "workload.preset=tiny", *FEW_STEPS,
                   extra_env={"SLURM_CONF": str(conf)})
    assert proc.returncode == 2
    assert "SLURM controller is unreachable" in proc.stderr and str(conf) in proc.stderr
    assert not (tmp_path / "results" / "mlflow.db").exists()


def test_a_job_cancelled_on_the_cluster_is_a_failed_row_and_the_sweep_still_ends(
        tmp_path, slurm_cluster, calibration_cache):
    """A job cancelled mid-run (`scancel`: no result file will ever come) on a cluster that keeps no
    accounting, where `sacct` cannot say it ended: the submitting process sees it leave the queue, prints the
    other job's row and a FAILED row naming where the logs are, and exits 1 — it does not wait forever."""
    from conftest import clean_env, mlflow_runs

    env = clean_env() | slurm_cluster["env"]
    results = tmp_path / "results"
    proc = subprocess.Popen(
        [sys.executable, "-m", "suite.cli", "run", "-m", "hydra/launcher=submitit_slurm",
         "hydra.launcher.timeout_min=20", "workload=llama", "workload.preset=tiny", "runner.steps=4,1000000",
         "runner.warmup_steps=1", "runner.repetitions=1", "runner.progress=false", f"results_dir={results}",
         f"platform.calibration_cache={calibration_cache}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    sweeps: set[str] = set()  # the sweep's array ids: cancelled at the end whatever happens, so none runs on
    try:
        deadline = time.monotonic() + 300
        while True:  # the sweep's second job (a million steps) running: cancel it
            listed = subprocess.run(["squeue", "--noheader", "--array", "--format=%i %T"], env=env,
                                    capture_output=True, text=True).stdout.split()
            sweeps |= {job.split("_")[0] for job in listed[::2]}
            endless = [job for job, state in zip(listed[::2], listed[1::2], strict=True)
                       if job.endswith("_1") and state == "RUNNING"]
            if endless:
                break
            assert proc.poll() is None and time.monotonic() < deadline, "the sweep's second job never ran"
            time.sleep(1)
        subprocess.run(["scancel", endless[0]], env=env, check=True)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        if sweeps:
            subprocess.run(["scancel", *sorted(sweeps)], env=env, capture_output=True)
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    assert "a job failed" in err and ".submitit" in err
    assert "left no result" in out and "FAILED" in out
    finished = [r for r in mlflow_runs(results) if r.info.status == "FINISHED"]
    assert [r.data.params["runner.steps"] for r in finished] == ["4"]  # the other job's run came back whole
