"""Two ranks with gloo under torchrun: one MLflow run, metrics from every rank."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import TINY, clean_env, mlflow_runs


@pytest.mark.parametrize("parallelism", ["fsdp2", "ddp"])
def test_two_rank_gloo_run(tmp_path, calibration_cache, parallelism):
    results = tmp_path / "results"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        "-m", "suite.cli", "run", f"results_dir={results}",
        f"platform.calibration_cache={calibration_cache}", f"workload.parallelism={parallelism}",
        *TINY,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = mlflow_runs(results)  # rank 0 logs; rank 1 does not make a second run
    assert run.info.status == "FINISHED"
    assert run.data.tags["world_size"] == "2"
    metrics = run.data.metrics
    assert {"step_time_ms_p50_rank0", "step_time_ms_p50_rank1", "rank_imbalance"} <= set(metrics)
    assert metrics["eval_loss"] > 0 and metrics["throughput"] > 0
    assert len(list((results / "runs").iterdir())) == 1  # one run folder, shared by the ranks
