"""Device-synchronised step timing and the statistics reported from it.

On an accelerator each step is bracketed by device events recorded on the current stream, so the
time is the device's, not the launch queue's; the events are read once, after a single
synchronisation at the end, so timing does not stall the pipeline. On the CPU, work is
synchronous and ``perf_counter`` is the clock.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch


class StepTimer:
    """Times consecutive steps: ``start()`` … ``stop()`` per step, then ``durations_s()``."""

    def __init__(self, device: torch.device):
        self.device = device
        self._use_events = device.type != "cpu"
        self._pending: list[tuple[object, object]] = []
        self._cpu_durations: list[float] = []
        self._t0 = 0.0

    def start(self) -> None:
        if self._use_events:
            event = torch.Event(device=self.device, enable_timing=True)
            event.record()
            self._pending.append((event, None))
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._use_events:
            event = torch.Event(device=self.device, enable_timing=True)
            event.record()
            start, _ = self._pending[-1]
            self._pending[-1] = (start, event)
        else:
            self._cpu_durations.append(time.perf_counter() - self._t0)

    def durations_s(self) -> list[float]:
        """All finished steps' durations in seconds (synchronises the device once)."""
        if not self._use_events:
            return list(self._cpu_durations)
        torch.accelerator.synchronize(self.device)
        return [start.elapsed_time(end) / 1e3 for start, end in self._pending if end is not None]


@dataclass(frozen=True)
class StepStats:
    """Summary of one repetition's timed steps."""

    steps: int
    total_s: float
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    min_ms: float
    max_ms: float
    cv: float  # coefficient of variation of step time (std / mean)


def step_stats(durations_s: list[float]) -> StepStats:
    if not durations_s:
        raise ValueError("no timed steps to summarise")
    ms = np.asarray(durations_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    mean = float(ms.mean())
    return StepStats(
        steps=len(ms),
        total_s=float(ms.sum() / 1e3),
        mean_ms=mean,
        p50_ms=float(p50),
        p90_ms=float(p90),
        p99_ms=float(p99),
        min_ms=float(ms.min()),
        max_ms=float(ms.max()),
        cv=float(ms.std(ddof=1) / mean) if len(ms) > 1 and mean > 0 else 0.0,
    )


def olympic_mean(values: list[float]) -> float:
    """MLPerf's olympic mean: drop the fastest and the slowest, average the rest.

    With fewer than three values nothing can be dropped, so it is the plain mean.
    """
    if not values:
        raise ValueError("olympic mean of no values")
    ordered = sorted(values)
    kept = ordered[1:-1] if len(ordered) >= 3 else ordered
    return float(sum(kept) / len(kept))


def coefficient_of_variation(values: list[float]) -> float:
    """Sample std / mean; 0 for a single value (no spread is measurable)."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    if mean == 0:
        return math.inf
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return math.sqrt(var) / mean
