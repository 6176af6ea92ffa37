"""Per-op cost models calibrated on the platform: how an op's time changes when its shapes do.

Two curves, measured by microbenchmarks on this machine and cached as JSON beside the bundle: a GEMM's
time against its FLOPs (square matmuls from 32 to 1024), and a memory-bound op's time against the bytes
it moves (an elementwise add from 1 KB to 64 MB). An op is re-timed by the *ratio* of the curve at its new
size to the curve at its captured size, applied to its captured time, so what the curve does not know
about the op (its own kernel, its fixed cost) stays as measured. GEMMs and attention go by FLOPs, every
other op with tensors by bytes; views do not change. The curves are measured on the CPU with this
process's intra-op threads (a what-if for an accelerator needs its curves measured on the device: not
built).

Calibration that holds on a shared machine: each point is the fastest of several rounds of a few calls
timed together, the rounds going round-robin over all the points (pre-emption only ever adds time, so
the minimum is the machine's own cost; the median of single calls put a 64×64 GEMM at 7.4 ms on a busy
2-core host, and since ops are re-timed by a curve's ratio one such point turned a 2× batch into a
+2,500 % prediction), and a curve is made non-decreasing in size by lowering a point that took longer
than a larger size (more work never takes less time), also when read from a file.
"""

from __future__ import annotations

import bisect
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

GEMM_SIZES = (32, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
BYTES_SIZES = tuple(2 ** k for k in range(10, 27, 2))  # 1 KB ... 64 MB
CALIBRATION_SCHEMA = "cobench-whatif-calibration/1"


@dataclass
class Curve:
    """Measured (size, time) points; :meth:`at` interpolates log-log, extrapolates from the end slopes."""

    sizes: list[float]
    times_us: list[float]

    def at(self, size: float) -> float:
        if size <= 0:
            return min(self.times_us)
        xs = [math.log(s) for s in self.sizes]
        ys = [math.log(t) for t in self.times_us]
        x = math.log(size)
        i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return math.exp(ys[i - 1] + slope * (x - xs[i - 1]))


@dataclass
class Calibration:
    """A platform's curves (``threads``: the intra-op threads they were measured with)."""

    platform: str
    threads: int
    gemm: Curve  # FLOPs → µs
    memory: Curve  # bytes moved → µs

    def to_json(self) -> dict:
        return {"schema": CALIBRATION_SCHEMA, "platform": self.platform, "threads": self.threads,
                "gemm": {"flops": self.gemm.sizes, "us": self.gemm.times_us},
                "memory": {"bytes": self.memory.sizes, "us": self.memory.times_us}}

    @classmethod
    def from_json(cls, raw: dict, path: Path) -> Calibration:
        if not isinstance(raw, dict) or raw.get("schema") != CALIBRATION_SCHEMA:
            raise ValueError(f"{path}: not a what-if calibration (schema {CALIBRATION_SCHEMA!r} expected)")
        try:
            return cls(str(raw["platform"]), int(raw["threads"]),
                       Curve([float(x) for x in raw["gemm"]["flops"]], [float(x) for x in raw["gemm"]["us"]]),
                       Curve([float(x) for x in raw["memory"]["bytes"]], [float(x) for x in raw["memory"]["us"]]))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: malformed what-if calibration ({err})") from None


ROUNDS = 15
WARMUP_CALLS = 3


def _fastest_us(fns: list[Callable[[], object]], budget_s: float = 0.02) -> list[float]:
    """Each callable's fastest per-call time over :data:`ROUNDS` rounds of as many calls as fit its share of
    ``budget_s``. The rounds go round-robin over all the points, so one point's rounds are spread over
    the whole calibration: a burst of someone else's work on a shared host spoils a round of every
    point, not every round of one."""
    calls = []
    for fn in fns:
        for _ in range(WARMUP_CALLS):
            fn()
        start = time.perf_counter()
        fn()
        once = max(time.perf_counter() - start, 1e-7)
        calls.append(max(1, min(1000, int(budget_s / ROUNDS / once))))
    best = [float("inf")] * len(fns)
    for _ in range(ROUNDS):
        for k, (fn, n) in enumerate(zip(fns, calls, strict=True)):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            best[k] = min(best[k], (time.perf_counter() - start) / n)
    return [b * 1e6 for b in best]


def monotone(curve: Curve) -> Curve:
    """``curve`` made non-decreasing in size (sizes sorted): where a smaller size took longer than a larger
    one, its time was inflated (pre-emption only ever adds time), so it takes the larger size's — a
    spike is lowered rather than carried up to every larger size."""
    points = sorted(zip(curve.sizes, curve.times_us, strict=True))
    times, ceiling = [], float("inf")
    for _, t in reversed(points):
        ceiling = min(ceiling, t)
        times.append(ceiling)
    return Curve([s for s, _ in points], times[::-1])


def calibrate(platform: str = "cpu", threads: int | None = None) -> Calibration:
    """GEMM FLOPs → µs and bytes moved → µs on this process's CPU (``threads``: intra-op threads)."""
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        flops, gemms = [], []
        for n in GEMM_SIZES:
            a, b = torch.randn(n, n), torch.randn(n, n)
            gemms.append(lambda a=a, b=b: torch.mm(a, b))
            flops.append(2.0 * n ** 3)
        moved, adds = [], []
        for size in BYTES_SIZES:
            x = torch.randn(max(1, size // 12))  # add: two reads and a write of 4-byte floats
            moved.append(float(x.numel() * 12))
            adds.append(lambda x=x: torch.add(x, x))
        times = _fastest_us(gemms + adds)
        return Calibration(platform, torch.get_num_threads(), monotone(Curve(flops, times[:len(gemms)])),
                           monotone(Curve(moved, times[len(gemms):])))
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
