"""FreeScale-style balancing figures for ``workload=seqrec`` (reported in ``extra_info``, never gates).

- ``test_partition_time``: what one partition of a global batch costs (16 histories per rank) at
  2 and 256 ranks, with the predicted bubble of the even split and of the balancer beside it.
- ``test_two_rank_run``: the real thing on 2 ranks (``torchrun``, gloo): bubble fraction with the
  even split vs balanced (the same run, the same global batches), the bubble reduction, the
  throughput gain, how well the simulator predicted the measured bubbles and rank times, and its
  prediction at 256 ranks. Once with TorchRec's ``TrainPipelineSparseDist`` (overlap on), once
  with ``TrainPipelineBase`` (off); compare their ``samples_per_s`` for the overlap's effect.

On a shared CPU machine the measured bubbles have a floor set by timing noise (co-tenants, the
communication threads), which the simulator does not model; ``*_p50`` are the steadier figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from workloads.seqrec.balance import BALANCERS, CostModel, bubble_fraction, partition
from workloads.seqrec.data import LengthDistribution

# A representative CPU cost model (what the tiny preset fits on a 2-core Xeon): seconds.
COST_MODEL = CostModel(a=2e-8, b=1.2e-5, c=4e-5, fixed=3e-3)
STEPS = 60  # timed steps: 30 even-split and 30 balanced, paired on the same global batches
FIGURES = [
    "bubble_fraction_even", "bubble_fraction", "bubble_reduction", "bubble_fraction_even_p50", "bubble_fraction_p50",
    "throughput_gain", "samples_per_s_even", "samples_per_s_balanced", "compute_critical_path_gain",
    "sim_bubble_fraction_even", "sim_bubble_fraction", "sim_bubble_reduction", "sim_rank_time_error_pct",
    "sim_bubble_reduction_at_256", "sim_throughput_gain_at_256", "cost_model_r2", "step_time_ms_p50", "hr_at_10",
]


@pytest.mark.parametrize("world", [2, 256])
@pytest.mark.parametrize("method", BALANCERS)
def test_partition_time(benchmark, method, world):
    lengths = LengthDistribution("lognormal", 128).sample(16 * world, np.random.default_rng(0))
    benchmark.group = f"partition {16 * world} histories over {world} ranks"
    parts = benchmark.pedantic(partition, args=(lengths, COST_MODEL, world, method), rounds=5, warmup_rounds=1)
    even = partition(lengths, COST_MODEL, world, "even")
    benchmark.extra_info["predicted_bubble_even"] = bubble_fraction(COST_MODEL.rank_times(lengths, even))
    benchmark.extra_info["predicted_bubble_balanced"] = bubble_fraction(COST_MODEL.rank_times(lengths, parts))


@pytest.mark.parametrize("overlap", [True, False], ids=["TrainPipelineSparseDist", "TrainPipelineBase"])
def test_two_rank_run(benchmark, tmp_path: Path, overlap: bool):
    results = tmp_path / "results"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        "-m", "suite.cli", "run", "workload=seqrec", f"results_dir={results}",
        f"platform.calibration_cache={tmp_path / 'calibration.json'}", "runner.progress=false",
        f"runner.steps={STEPS}", f"workload.overlap={str(overlap).lower()}", "tracking.enabled=false",
    ]

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)

    benchmark.group = "seqrec, 2 CPU ranks"
    proc = benchmark.pedantic(run, rounds=1, iterations=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (summary,) = (results / "runs").glob("*/metrics.json")
    metrics = json.loads(summary.read_text())["metrics"]
    benchmark.extra_info.update({name: metrics[name] for name in FIGURES if name in metrics})
    benchmark.extra_info["samples_per_s"] = metrics["throughput"]
