"""workload=collectives: nccl-tests' conventions, the sweep table's format, and 2-rank gloo runs under torchrun."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import clean_env, mlflow_runs

from workloads.collectives.ops import _expect, bus_factor, moe_routing, sweep_sizes
from workloads.collectives.table import COLUMNS, SweepRow, read_sweep_table, write_sweep_table


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    for name in ("all_gather", "reduce_scatter", "all_to_all", "all_to_all_moe"):
        assert bus_factor(name, 8) == pytest.approx(7 / 8)
    for name in ("broadcast", "reduce", "send_recv"):
        assert bus_factor(name, 8) == 1.0
    with pytest.raises(ValueError, match="one of all_reduce"):
        bus_factor("allreduce", 8)


def test_size_sweep_is_b_e_f():
    assert sweep_sizes(1024, 16384, 4) == [1024, 4096, 16384]
    assert sweep_sizes(8, 100, 2) == [8, 16, 32, 64]


def test_moe_routing_is_skewed_shared_and_conserves_tokens():
    counts = moe_routing(8, 4096, skew=1.5, seed=3)
    assert counts.sum(dim=1).tolist() == [4096] * 8  # every rank sends all its tokens
    assert torch.equal(counts, moe_routing(8, 4096, skew=1.5, seed=3))  # every rank derives the same matrix
    received = counts.sum(dim=0)
    assert received.max() > 2.5 * received.float().mean()  # a hot expert, as MoE routing has
    uniform = moe_routing(8, 4096, skew=0.0, seed=3).sum(dim=0).float()
    assert uniform.max() < 1.1 * uniform.mean()
    assert not torch.equal(counts, moe_routing(8, 4096, skew=1.5, seed=4))  # the hot expert moves


def test_a_wrong_result_is_reported_with_where_and_what():
    want = torch.tensor([3.0, 4.0, 5.0], dtype=torch.float64)
    _expect("all_reduce", torch.tensor([3.0, 4.0, 5.0]), want, torch.float32, 0)
    with pytest.raises(AssertionError, match=r"all_reduce on rank 1: 1 of 3 elements wrong \(first at 2: got 6.0"):
        _expect("all_reduce", torch.tensor([3.0, 4.0, 6.0]), want, torch.float32, 1)


def test_sweep_table_round_trips_in_its_documented_columns(tmp_path):
    assert COLUMNS == ("collective", "world_size", "backend", "device", "dtype", "bytes", "time_us_p50",
                       "time_us_p99", "algbw_gbps", "busbw_gbps", "samples")
    rows = [SweepRow("all_reduce", 2, "gloo", "cpu", "float32", 1024 * 4**i, 100.0 * (i + 1), 150.0 * (i + 1),
                     0.5 * i, 0.5 * i, 20) for i in range(3)]
    paths = write_sweep_table(rows, tmp_path / "collectives_all_reduce", {"device_name": "test"})
    assert [p.name for p in paths] == ["collectives_all_reduce.csv", "collectives_all_reduce.json",
                                       "collectives_all_reduce.png"]
    assert read_sweep_table(paths[0]) == rows == read_sweep_table(paths[1])
    (tmp_path / "other.json").write_text('{"format": "something else", "rows": []}')
    with pytest.raises(ValueError, match="not a cobench.collectives.sweep v1 table"):
        read_sweep_table(tmp_path / "other.json")


def test_bad_collective_and_single_rank_are_refused_before_a_run(cobench, tmp_path):
    proc = cobench("run", "workload=collectives", "workload.collective=allreduce")
    assert proc.returncode != 0
    assert "workload.collective" in proc.stderr and "all_reduce" in proc.stderr
    proc = cobench("run", "workload=collectives", "runner.progress=false")
    assert proc.returncode != 0
    assert "at least 2 ranks" in proc.stderr and "torchrun" in proc.stderr
    assert mlflow_runs(tmp_path / "results") == []  # nothing started


@pytest.mark.slow
def test_two_rank_suite_logs_one_run_per_collective_with_its_sweep(tmp_path, calibration_cache):
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "suite.cli", "suite", "collectives", f"results_dir={results}",
           f"platform.calibration_cache={calibration_cache}", "runner.warmup_steps=1", "runner.steps=3",
           "runner.progress=false", "workload.min_bytes=256", "workload.max_bytes=65536", "workload.dtype=bfloat16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = [r for r in mlflow_runs(results) if r.data.tags.get("collective")]
    by_name = {r.data.tags["collective"]: r for r in runs}
    assert set(by_name) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_moe",
                            "broadcast", "reduce", "send_recv"}
    for name, run in by_name.items():
        assert run.info.status == "FINISHED", name
        metrics = run.data.metrics
        assert metrics["busbw_gbps"] == pytest.approx(metrics["algbw_gbps"] * bus_factor(name, 2)), name
        assert metrics["latency_us_p50"] > 0 and metrics["pg_startup_s"] > 0
        assert metrics["largest_bytes"] <= 65536
        run_dir = next(p for p in (results / "runs").iterdir() if (p / f"collectives_{name}.json").exists()
                       and run.info.run_id in (p / "metrics.json").read_text())
        rows = read_sweep_table(run_dir / f"collectives_{name}.csv")
        assert [r.bytes for r in rows][-1] == metrics["largest_bytes"] and len(rows) == 5  # 256 … 65536, ×4
        assert {r.world_size for r in rows} == {2} and {r.backend for r in rows} == {"gloo"}
        assert all(r.samples == 3 and r.time_us_p99 >= r.time_us_p50 > 0 for r in rows)  # warm-up left out
        assert (run_dir / f"collectives_{name}.png").stat().st_size > 0
    compare = subprocess.run([sys.executable, "-m", "suite.cli", "compare", "--suite", "collectives", "--metric",
                              "busbw_gbps", "--results-dir", str(results), "--out", str(tmp_path / "cmp")],
                             capture_output=True, text=True, timeout=120, env=clean_env(), cwd=tmp_path)
    assert compare.returncode == 0, compare.stderr[-2000:]
    table = (tmp_path / "cmp" / "compare.csv").read_text()
    assert all(name in table for name in by_name)
