"""One repetition of a benchmark: MLPerf's init → run_start → blocks/evals → run_stop.

Warm-up steps are the first training steps of the repetition (they count as trained samples
but not in step-time statistics). Evaluation runs between timed intervals, so its time never
enters a step time. State accumulates in :class:`RepetitionState` as it happens, so a run
interrupted halfway still reports what it measured.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
from mlperf_logging.mllog import constants as C

from harness.config import CobenchConfig, RunnerConfig
from harness.platform import synchronize
from harness.recording.mlperf_log import MLPerfLogWriter
from harness.running.timing import StepTimer
from workloads.base import QualityTarget, RunContext, Workload
from workloads.device import max_memory_allocated, reset_peak_memory_stats


@dataclass
class RepetitionState:
    """What one rank measured in one repetition (plain data, gathered across ranks)."""

    repetition: int
    step_times_s: list[float] = field(default_factory=list)
    data_wait_s: list[float] = field(default_factory=list)  # timed steps' waits for their batch, when measured
    losses: list[float] = field(default_factory=list)  # warm-up and timed steps, in order
    timed_samples: int = 0
    timed_tokens: int = 0
    trained_samples: int = 0  # this rank's, warm-up included
    steps_done: int = 0  # warm-up included; every step trains one global batch on all ranks
    global_batch_size: int = 0
    peak_memory_bytes: int = 0
    quality: dict[str, float] = field(default_factory=dict)  # last evaluation
    quality_history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    target_reached: bool | None = None  # None: the workload declares no target
    target: QualityTarget | None = None  # the workload's quality target, when it has one
    time_to_train_s: float | None = None
    flops_per_step: float | None = None
    extras: dict[str, float] = field(default_factory=dict)  # the workload's own metrics
    status: str = "running"  # running | success | aborted

    @property
    def global_samples(self) -> int:
        """Samples trained by all ranks (exact even when ranks hold different shares, e.g. balanced)."""
        return self.steps_done * self.global_batch_size


def seed_everything(seed: int, deterministic: bool) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; harmless elsewhere
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # set both ways (sweeps share a process), but only when it changes: the call imports torch._inductor and
    # torch._dynamo (seconds of CPU at every start) to tell inductor too
    if (torch.are_deterministic_algorithms_enabled() != deterministic
            or (deterministic and torch.is_deterministic_algorithms_warn_only_enabled())):
        torch.use_deterministic_algorithms(deterministic)


class MemoryMeter:
    """Peak memory during timed steps: the allocator's peak on accelerators, else process RSS."""

    def __init__(self, device: torch.device):
        self.device = device
        self._process = psutil.Process()
        self.peak = 0
        reset_peak_memory_stats(device)  # the accelerator's allocator; nothing on the CPU

    @property
    def source(self) -> str:
        return "allocator" if self.device.type != "cpu" else "process_rss"

    def sample(self) -> None:
        if self.device.type == "cpu":
            self.peak = max(self.peak, self._process.memory_info().rss)

    def read(self) -> int:
        if self.device.type != "cpu":
            return max_memory_allocated(self.device)
        self.sample()
        return self.peak


def _to_float(loss: torch.Tensor | float | None) -> float:
    if loss is None:
        return float("nan")
    return float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else float(loss)


def run_repetition(
    workload: Workload,
    cfg: CobenchConfig,
    ctx: RunContext,
    writer: MLPerfLogWriter | None,
    state: RepetitionState,
    platform_name: str,
    advance: Callable[[], None] = lambda: None,
) -> RepetitionState:
    """Drive ``workload`` through one repetition, filling ``state`` as it goes."""
    runner = cfg.runner
    info = workload.mlperf_info()
    log = writer if writer is not None else _NullWriter()
    log.submission(cfg.mllog, platform_name, info.benchmark)
    log.event(C.CACHE_CLEAR, True)
    log.start(C.INIT_START)
    log.hyperparameters(info, ctx.seed)
    state.global_batch_size = info.global_batch_size
    seed_everything(ctx.seed, ctx.deterministic)
    workload.setup()
    state.flops_per_step = workload.flops_per_step()
    target = state.target = workload.quality_target()
    log.end(C.INIT_STOP)
    synchronize(ctx.device)
    log.start(C.RUN_START)
    run_start = time.perf_counter()
    timer = StepTimer(ctx.device)
    memory = MemoryMeter(ctx.device)
    pending_losses: list[torch.Tensor | float | None] = []
    try:
        _train(workload, runner, ctx, log, state, target, timer, memory, pending_losses, advance, info.train_samples)
    except BaseException:
        # Interrupted or failed: keep what was measured, close the MLPerf log as aborted.
        state.step_times_s = timer.durations_s()
        state.losses = [_to_float(loss) for loss in pending_losses]
        state.status = "aborted"
        log.run_stop("aborted", state.global_samples)
        raise
    state.step_times_s = timer.durations_s()
    state.peak_memory_bytes = memory.read()
    workload.observe_step_times(list(state.step_times_s))  # e.g. a replay judges its own step times
    state.extras = workload.extra_metrics()
    state.losses = [_to_float(loss) for loss in pending_losses]
    synchronize(ctx.device)
    state.time_to_train_s = time.perf_counter() - run_start
    state.status = "success" if state.target_reached in (None, True) else "aborted"
    log.run_stop(state.status, state.global_samples)
    return state


def _train(
    workload: Workload,
    runner: RunnerConfig,
    ctx: RunContext,
    log: MLPerfLogWriter | _NullWriter,
    state: RepetitionState,
    target: QualityTarget | None,
    timer: StepTimer,
    memory: MemoryMeter,
    pending_losses: list[torch.Tensor | float | None],
    advance: Callable[[], None],
    epoch_samples: int = 0,
) -> None:
    """Warm-up steps, then timed steps in blocks, each block followed by an evaluation."""
    for _ in range(runner.warmup_steps):
        result = workload.step()
        workload.between_steps()
        pending_losses.append(result.loss)
        state.trained_samples += result.samples
        state.steps_done += 1
        advance()

    block = runner.eval_interval or runner.steps
    step = 0
    while step < runner.steps:
        log.start(C.BLOCK_START, metadata={C.SAMPLES_COUNT: state.global_samples})
        for _ in range(min(block, runner.steps - step)):
            timer.start()
            result = workload.step()
            timer.stop()
            workload.between_steps()
            memory.sample()
            pending_losses.append(result.loss)
            state.timed_samples += result.samples
            state.timed_tokens += result.tokens
            if result.data_wait_s is not None:
                state.data_wait_s.append(result.data_wait_s)
            state.trained_samples += result.samples
            state.steps_done += 1
            step += 1
            advance()
        global_samples = state.global_samples
        log.end(C.BLOCK_STOP, metadata={C.SAMPLES_COUNT: global_samples})
        _evaluate(workload, log, state, target, global_samples, epoch_samples)
        if runner.stop_at_target and state.target_reached:
            break


def _evaluate(
    workload: Workload,
    log: MLPerfLogWriter | _NullWriter,
    state: RepetitionState,
    target: QualityTarget | None,
    samples_count: int,
    epoch_samples: int = 0,
) -> None:
    log.start(C.EVAL_START, metadata={C.SAMPLES_COUNT: samples_count})
    quality = workload.evaluate()
    if quality:
        headline = target.metric if target is not None and target.metric in quality else next(iter(quality))
        # Both positions MLPerf's checkers look for: samples so far, and epochs (samples ÷ epoch size)
        # — the DLRM rules want epoch_num, the LLM rules samples_count.
        metadata: dict[str, float] = {C.SAMPLES_COUNT: samples_count}
        if epoch_samples > 0:
            metadata[C.EPOCH_NUM] = samples_count / epoch_samples
        log.event(C.EVAL_ACCURACY, quality[headline], metadata=metadata)
    log.end(C.EVAL_STOP, metadata={C.SAMPLES_COUNT: samples_count})
    state.quality = quality
    state.quality_history.append((samples_count, quality))
    if target is not None:
        if target.metric not in quality:
            raise ValueError(f"target metric {target.metric!r} not among evaluate()'s {sorted(quality)}")
        state.target_reached = bool(state.target_reached) or target.reached(quality[target.metric])


class _NullWriter(MLPerfLogWriter):
    """Stands in for the MLPerf log on ranks other than 0: the writer's own methods, each writing nothing
    (a misspelt method fails here as on rank 0)."""

    def __init__(self) -> None:  # no file
        self.run_stopped = False

    def close(self) -> None:
        pass

    def event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def start(self, *args: Any, **kwargs: Any) -> None:
        pass

    def end(self, *args: Any, **kwargs: Any) -> None:
        pass
