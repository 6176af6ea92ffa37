"""Cost-model calibration that holds on a shared machine.

:func:`workloads.whatif.costmodel.calibrate` times each point as the median of 7 single calls: on a busy
2-core host a point whose calls were descheduled comes out ~1000x too slow (seen: a 64×64 GEMM at 7.4 ms,
a 16 KB add at 7.3 ms), and since ops are re-timed by the curve's *ratio* between two sizes, one bad point
turned a 2x batch into a 2,500 % prediction. Here each point is the fastest of several rounds of a few
calls timed together (pre-emption only ever adds time, so the minimum is the machine's own cost), and
the curve is made non-decreasing in size (more work never takes less time; a dip is noise) — also
applied to a calibration read from a file. Same curves, same JSON (:class:`Calibration`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from workloads.whatif.costmodel import BYTES_SIZES, GEMM_SIZES, Calibration, Curve

ROUNDS = 9
WARMUP_CALLS = 3


def _fastest_us(fn, budget_s: float = 0.02) -> float:  # noqa: ANN001
    """The fastest per-call time over :data:`ROUNDS` rounds, each of as many calls as fit ``budget_s``/ROUNDS."""
    for _ in range(WARMUP_CALLS):
        fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, min(1000, int(budget_s / ROUNDS / once)))
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def monotone(curve: Curve) -> Curve:
    """``curve`` with each time at least the time of every smaller size (sizes sorted)."""
    points = sorted(zip(curve.sizes, curve.times_us, strict=True))
    times, floor = [], 0.0
    for _, t in points:
        floor = max(floor, t)
        times.append(floor)
    return Curve([s for s, _ in points], times)


def calibrate(platform: str = "cpu", threads: int | None = None) -> Calibration:
    """GEMM FLOPs → µs and bytes moved → µs on this process's CPU (``threads``: intra-op threads)."""
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        flops, gemm_us = [], []
        for n in GEMM_SIZES:
            a, b = torch.randn(n, n), torch.randn(n, n)
            gemm_us.append(_fastest_us(lambda a=a, b=b: torch.mm(a, b)))
            flops.append(2.0 * n ** 3)
        moved, memory_us = [], []
        for size in BYTES_SIZES:
            x = torch.randn(max(1, size // 12))  # add: two reads and a write of 4-byte floats
            moved.append(float(x.numel() * 12))
            memory_us.append(_fastest_us(lambda x=x: torch.add(x, x)))
        return Calibration(platform, torch.get_num_threads(), monotone(Curve(flops, gemm_us)),
                           monotone(Curve(moved, memory_us)))
    finally:
        torch.set_num_threads(saved)


def load_or_calibrate(path: Path | None, platform: str = "cpu", threads: int | None = None) -> Calibration:
    """The calibration cached at ``path`` (its curves made non-decreasing), made there first if missing."""
    if path is not None and path.exists():
        found = Calibration.from_json(json.loads(path.read_text()), path)
        return Calibration(found.platform, found.threads, monotone(found.gemm), monotone(found.memory))
    calibration = calibrate(platform, threads)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(calibration.to_json(), indent=1))
    return calibration


def read_calibration(path: Path) -> Calibration:
    """Another platform's calibration file (curves made non-decreasing)."""
    found = Calibration.from_json(json.loads(path.read_text()), path)
    return Calibration(found.platform, found.threads, monotone(found.gemm), monotone(found.memory))
