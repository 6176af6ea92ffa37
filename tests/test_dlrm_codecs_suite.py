"""The DLRM codec comparison as users run it: a suite under torchrun, 2 gloo ranks, one MLflow parent."""

from __future__ import annotations

import subprocess
import sys

from conftest import clean_env, mlflow_runs


def test_codec_suite_on_two_ranks(tmp_path, calibration_cache):
    results = tmp_path / "results"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        "-m", "suite.cli", "suite", "dlrm_codecs", f"results_dir={results}",
        f"platform.calibration_cache={calibration_cache}", "runner.steps=6", "runner.warmup_steps=1",
        "runner.progress=false",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = {r.info.run_name: r for r in mlflow_runs(results)}
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
