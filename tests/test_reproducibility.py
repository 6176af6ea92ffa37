"""Same seed, same config: the same numbers, bit for bit; another seed: other numbers."""

from __future__ import annotations

import json

from conftest import TINY

from harness.config import compose_config, to_run_config
from harness.running.runner import run_benchmark


def _run(tmp_path, calibration_cache, seed: int) -> dict:
    cfg = to_run_config(compose_config([
        *TINY, "tracking=off", "deterministic=true", f"seed={seed}",
        f"results_dir={tmp_path}", f"platform.calibration_cache={calibration_cache}",
    ]))
    result = run_benchmark(cfg)
    assert result.status == "FINISHED", result.error
    fingerprint = json.loads((result.run_dir / "fingerprint.json").read_text())
    return {"loss": result.metrics["loss"], "eval_loss": result.metrics["eval_loss"], **fingerprint}


def test_same_seed_reproduces_losses_exactly(tmp_path, calibration_cache):
    first = _run(tmp_path, calibration_cache, seed=5)
    second = _run(tmp_path, calibration_cache, seed=5)
    other = _run(tmp_path, calibration_cache, seed=6)
    assert (first["loss"], first["eval_loss"]) == (second["loss"], second["eval_loss"])
    assert first["loss"] != other["loss"]
    assert first["config_hash"] == second["config_hash"] != other["config_hash"]
    for key in ("git_sha", "git_dirty", "libraries", "cpu", "torch_threads", "host"):
        assert key in first
    assert first["libraries"]["torch"].startswith("2.")
