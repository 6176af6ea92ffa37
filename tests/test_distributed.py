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


def test_two_nodes_through_c10d_rendezvous(tmp_path, calibration_cache):
    """`torchrun --nnodes 2` as on a cluster: two agents (two "nodes" on this machine) meet at a c10d
    rendezvous; one run, and the record says 2 nodes."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = tmp_path / "results"
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "cobench-test",
            "-m", "suite.cli", "run", f"results_dir={results}", f"platform.calibration_cache={calibration_cache}",
            *TINY]
    procs = [subprocess.Popen(node, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                              cwd=tmp_path) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outputs]
    (run,) = mlflow_runs(results)
    assert run.info.status == "FINISHED"
    assert run.data.tags["world_size"] == "2" and run.data.tags["nodes"] == "2"
    fingerprint = json.loads(next((results / "runs").glob("*/fingerprint.json")).read_text())
    assert fingerprint["nodes"] == 2 and fingerprint["ranks_per_node"] == 1
