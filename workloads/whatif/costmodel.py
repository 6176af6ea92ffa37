"""Per-op cost models calibrated on the platform: how an op's time changes when its shapes do.

Two curves, measured by microbenchmarks on this machine (:mod:`workloads.trace_predict.costmodel`:
each point the fastest of several rounds, curves non-decreasing) and cached as JSON beside the
bundle: a GEMM's time against its FLOPs (square matmuls
from 32 to 1024), and a memory-bound op's time against the bytes it moves (an elementwise add from
1 KB to 64 MB). An op is re-timed by the *ratio* of the curve at its new size to the curve at its
captured size, applied to its captured time, so what the curve does not know about the op (its own
kernel, its fixed cost) stays as measured. GEMMs and attention go by FLOPs, every other op with
tensors by bytes; views do not change. The curves are measured on the CPU with this process's
intra-op threads (a what-if for an accelerator needs its curves measured on the device: not built).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from pathlib import Path

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
