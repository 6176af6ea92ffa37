"""A run that fails mid-way ends FAILED in MLflow with its reason, and keeps what it measured."""

from __future__ import annotations

from dataclasses import dataclass

from conftest import mlflow_runs

from harness.config import compose_config, to_run_config
from harness.recording.mlperf_log import read_mllog
from harness.running.runner import run_benchmark
from workloads.base import MLPerfInfo, StepResult, WorkloadBase, register


@dataclass
class BreaksConfig:
    name: str = "breaks_at_step"
    fail_at: int = 4


@register("breaks_at_step", BreaksConfig, "test-only: raises at a given step")
class BreaksAtStep(WorkloadBase):
    """Stands for a workload whose device fails mid-run."""

    def __init__(self, config: BreaksConfig, ctx):
        self.config, self.calls = config, 0

    def setup(self) -> None:
        pass

    def step(self) -> StepResult:
        self.calls += 1
        if self.calls == self.config.fail_at:
            raise RuntimeError("device fell off the bus")
        return StepResult(samples=2, loss=1.0 / self.calls)

    def mlperf_info(self) -> MLPerfInfo:
        return MLPerfInfo("breaks_at_step", global_batch_size=2, train_samples=20, eval_samples=0)


def test_failure_mid_run_ends_failed_with_reason_and_partial_metrics(tmp_path, calibration_cache):
    cfg = to_run_config(compose_config([
        "runner.warmup_steps=1", "runner.steps=10", "runner.progress=false", f"results_dir={tmp_path}",
        f"platform.calibration_cache={calibration_cache}",
    ]))
    cfg.workload = BreaksConfig()
    result = run_benchmark(cfg)
    assert result.status == "FAILED"
    assert "device fell off the bus" in result.error
    (run,) = mlflow_runs(tmp_path)
    assert run.info.status == "FAILED"
    assert "RuntimeError: device fell off the bus" in run.data.tags["error"]
    assert run.data.metrics["throughput"] > 0  # the two timed steps before the failure
    assert "Traceback" in (result.run_dir / "error.txt").read_text()
    stops = [line for line in read_mllog(result.run_dir / "mllog_rep0.txt") if line["key"] == "run_stop"]
    assert [s["metadata"]["status"] for s in stops] == ["aborted"]


def test_a_sigterm_while_the_failure_is_being_recorded_leaves_the_run_failed(tmp_path, calibration_cache,
                                                                                monkeypatch):
    """torchrun SIGTERMs a surviving rank right after a peer died, often while that rank is recording
    its failed collective: the run still ends FAILED with the failure, and only then does the
    interrupt propagate (it was closed KILLED by the command's catch-all, the store saying the user
    cancelled a run that had failed)."""
    import os
    import signal
    import sys
    import traceback

    import pytest

    from harness.running import runner
    from harness.running.interrupts import sigterm_as_interrupt

    format_exc = traceback.format_exc

    def format_exc_then_signalled():
        if sys._getframe(1).f_globals["__name__"] == "harness.running.runner":  # the failure handler, before the close
            os.kill(os.getpid(), signal.SIGTERM)
        return format_exc()

    monkeypatch.setattr(runner.traceback, "format_exc", format_exc_then_signalled)
    previous = signal.getsignal(signal.SIGTERM)
    sigterm_as_interrupt()
    cfg = to_run_config(compose_config([
        "runner.warmup_steps=1", "runner.steps=10", "runner.progress=false", f"results_dir={tmp_path}",
        f"platform.calibration_cache={calibration_cache}",
    ]))
    cfg.workload = BreaksConfig()
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            run_benchmark(cfg)
    finally:
        signal.signal(signal.SIGTERM, previous)
    (run,) = mlflow_runs(tmp_path)
    assert run.info.status == "FAILED" and run.info.end_time is not None
    assert "RuntimeError: device fell off the bus" in run.data.tags["error"]
