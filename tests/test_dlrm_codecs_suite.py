"""The DLRM codec comparison as users run it: a suite under torchrun, 2 gloo ranks, one MLflow parent; and
DLRM's sharded all-to-all at 2 ranks, measured and compressed (the suite's uncompressed and INT8 runs, and a
column-wise sharded run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY, clean_env, mlflow_runs


@pytest.fixture(scope="module")
def codec_suite(tmp_path_factory: pytest.TempPathFactory, calibration_cache: str):
    """`suite dlrm_codecs` under torchrun at 2 ranks, once: (the command's output, its runs by name)."""
    tmp = tmp_path_factory.mktemp("codecs")
    results = tmp / "results"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        "-m", "suite.cli", "suite", "dlrm_codecs", f"results_dir={results}",
        f"platform.calibration_cache={calibration_cache}", "runner.steps=6", "runner.warmup_steps=1",
        "runner.progress=false",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=clean_env(), cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, {r.info.run_name: r for r in mlflow_runs(results)}


def test_codec_suite_on_two_ranks(codec_suite):
    proc, runs = codec_suite
    assert runs["suite-dlrm_codecs"].info.status == "FINISHED"
    assert "fp8" not in runs and "fp8: SKIPPED" in proc.stdout  # CUDA-only codec: said, not crashed
    for name in ("none", "fp16", "bf16", "int8", "eb_rel_fixed", "eb_rel_agreed", "eb_abs_agreed", "eb_abs_range"):
        assert runs[name].info.status == "FINISHED", name
    table_wise = runs["eb_abs_range"].data.metrics  # table-wise bounds: measured, within their own bounds
    assert table_wise["codec_forward_bound_violations"] == 0 and "codec_forward_table_scale_max" in table_wise
    eb = runs["eb_rel_agreed"].data.metrics
    assert eb["codec_forward_bound_violations"] == 0 and eb["codec_backward_bound_violations"] == 0
    assert 0 < eb["codec_forward_max_error_over_bound"] <= 1
    # the error-bounded codec beats INT8's ratio at a 1 % relative bound on these embeddings
    assert eb["a2a_compression_ratio"] > runs["int8"].data.metrics["a2a_compression_ratio"]
    assert "auc_delta" in eb and "auc_delta" not in runs["none"].data.metrics
    assert eb["codec_block_size"] >= 16  # fitted to the sharding plan, not a fixed guess
    for name in ("fp16", "int8", "eb_rel_fixed"):  # every codec timed the same way, FBGEMM's included
        metrics = runs[name].data.metrics
        assert metrics["codec_ms_per_step"] > 0 and metrics["codec_break_even_gbps"] > 0, name
    assert "codec_break_even_gbps" not in runs["none"].data.metrics


def two_rank_run(tmp_path: Path, calibration_cache: str, *overrides: str) -> dict[str, float]:
    tmp_path.mkdir()
    results = tmp_path / "results"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        "-m", "suite.cli", "run", "workload=dlrm", f"results_dir={results}",
        f"platform.calibration_cache={calibration_cache}", *TINY, *overrides,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = mlflow_runs(results)
    assert run.info.status == "FINISHED"
    assert run.data.tags["world_size"] == "2"
    return run.data.metrics


@pytest.mark.slow
def test_two_rank_sharded_runs_measure_and_compress_the_all_to_all(codec_suite, tmp_path, calibration_cache):
    """Uncompressed and INT8 are the suite's runs (table-wise, DLRM's default sharding, 2 ranks); column-wise
    sharding with FP16 is launched here."""
    _, runs = codec_suite
    for name in ("none", "int8"):
        assert runs[name].info.status == "FINISHED" and runs[name].data.tags["world_size"] == "2"
        assert runs[name].data.params["workload.sharding"] == "table_wise"
    plain, int8 = runs["none"].data.metrics, runs["int8"].data.metrics
    fp16_cw = two_rank_run(tmp_path / "fp16", calibration_cache, "workload.sharding=column_wise",
                           "workload.comm_codec=fp16")
    for metrics in (plain, int8, fp16_cw):
        assert metrics["a2a_calls_per_step"] == 2  # one forward, one backward all-to-all per step
        assert metrics["a2a_time_ms"] > 0 and metrics["auc"] > 0
    # uncompressed, the measured bytes are exactly what the sharding plan predicts
    assert plain["a2a_bytes_per_step"] == plain["a2a_fp32_bytes_per_step"] > 0
    assert plain["a2a_compression_ratio"] == 1.0
    assert int8["a2a_bytes_per_step"] < plain["a2a_bytes_per_step"] / 2.5  # 1 byte + a row scale and bias
    assert fp16_cw["a2a_bytes_per_step"] == fp16_cw["a2a_fp32_bytes_per_step"] / 2
    assert fp16_cw["a2a_bytes_per_step"] < plain["a2a_bytes_per_step"]
