"""The harness's own cost per step: its timed loop against a bare ``for`` loop over the same steps.

The timed loop is the real one (``harness.running.loop._train``: step timer, memory sampling, loss
bookkeeping, progress callback, MLPerf block events); the bare loop calls ``workload.step()``
and nothing else. Two workloads: the smoke suite's tiny Llama (overhead as a share of a real
step) and a no-op step (the absolute cost per step in microseconds).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.config import compose_config, to_run_config
from harness.running.loop import MemoryMeter, RepetitionState, _train
from harness.running.timing import StepTimer
from workloads import discover
from workloads.base import RunContext, StepResult, WorkloadBase

STEPS = 200


class NoOpWorkload(WorkloadBase):
    def setup(self) -> None: ...

    def step(self) -> StepResult:
        return StepResult(samples=1, tokens=1, loss=0.0)


def _workload(kind: str, tmp: Path):
    if kind == "noop":
        return NoOpWorkload()
    cfg = to_run_config(compose_config(["workload.preset=tiny"]))
    ctx = RunContext(device=torch.device("cpu"), seed=0, work_dir=tmp)
    workload = discover()["llama"].factory(cfg.workload, ctx)
    workload.setup()
    workload.evaluate = lambda: {}  # time the steps only
    return workload


class _Log:
    def __getattr__(self, name):
        return lambda *a, **k: None


def _timed_loop(workload, runner, ctx):
    state = RepetitionState(repetition=0)
    _train(workload, runner, ctx, _Log(), state, None, StepTimer(ctx.device), MemoryMeter(ctx.device), [],
           lambda: None)
    return state


def _bare_loop(workload, steps):
    for _ in range(steps):
        workload.step()


@pytest.mark.parametrize("kind", ["noop", "llama_tiny"])
@pytest.mark.parametrize("loop", ["bare", "harness"])
def test_loop(benchmark, tmp_path, kind, loop):
    workload = _workload(kind, tmp_path)
    steps = STEPS if kind == "llama_tiny" else 20_000
    runner = to_run_config(compose_config([f"runner.steps={steps}", "runner.warmup_steps=0"])).runner
    ctx = RunContext(device=torch.device("cpu"), seed=0, work_dir=tmp_path)
    benchmark.group = f"{steps} steps, {kind}"
    if loop == "bare":
        benchmark.pedantic(_bare_loop, args=(workload, steps), rounds=5, warmup_rounds=1)
    else:
        benchmark.pedantic(_timed_loop, args=(workload, runner, ctx), rounds=5, warmup_rounds=1)
    benchmark.extra_info["us_per_step_median"] = benchmark.stats.stats.median / steps * 1e6
