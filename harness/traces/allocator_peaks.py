"""How much memory one training step holds at its peak, read from the profiler's allocator events:
of a callable's steps run here, or of the steps a trace bundle's capture traced."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, supported_activities

from harness.platform import synchronize
from workloads.trace_bundle import KINETO_FILE, STEP_ANNOTATION, read_json, read_meta

# c10::DeviceType codes, as the profiler's memory events name devices (others: any non-CPU event)
_C10_DEVICE_TYPES = {"cpu": 0, "cuda": 1, "xpu": 12, "mps": 13, "privateuseone": 20}
MEMORY_STEP = "cobench_memory_step"  # record_function name marking one call measured for its memory peak


def _memory_totals(events: list, device: torch.device) -> list[tuple[float, float, float]]:
    """(time, bytes, the allocator's running total after it) of the profiler's memory events for ``device``."""
    device_type = _C10_DEVICE_TYPES.get(device.type)
    return [(float(e["ts"]), float(e["args"].get("Bytes", 0)), float(e["args"]["Total Allocated"])) for e in events
            if isinstance(e, dict) and e.get("name") == "[memory]" and isinstance(e.get("args"), dict)
            and "Total Allocated" in e["args"] and isinstance(e.get("ts"), int | float)
            and (e["args"].get("Device Type") == device_type if device_type is not None
                 else e["args"].get("Device Type") != 0)]


def _step_peaks(events: list, device: torch.device, annotation: str) -> list[float]:
    """Each step's peak in bytes (a step: an event named ``annotation``), from ``device``'s memory events
    inside it: the most the running total reached over what it was when the step's first event came."""
    totals = sorted(_memory_totals(events, device))
    steps = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
             if isinstance(e, dict) and e.get("ph") == "X" and str(e.get("name", "")).startswith(annotation)
             and isinstance(e.get("ts"), int | float) and isinstance(e.get("dur"), int | float)]
    peaks = []
    for start, end in steps:
        inside = [(b, t) for ts, b, t in totals if start <= ts <= end]
        if inside:
            before = inside[0][1] - inside[0][0]  # the running total when the step began
            peaks.append(max(0.0, max(t for _, t in inside) - before))
    return peaks


def captured_step_peak_bytes(rank_dir: Path, device: torch.device) -> int | None:
    """The most memory one captured step held beyond what it started with; None when the bundle records none.

    The capture runs its traced steps once more after them, each with the random draws it had, under the
    memory profiler alone (``step_peak_bytes`` in its metadata): under the execution-trace observer, the
    copies it makes of integer inputs to record their values and ranges are allocations too (the index the
    backward of ``index_select`` on a 100 × 16 table hands ``index_add_`` and ``scatter_add_``, expanded over
    the rows' width, 300 × 16 × 8 bytes: 47,224 bytes at the traced steps' peak against the program's 21,604).
    A bundle without that figure: the traced steps' own allocator events (its Kineto trace)."""
    peaks = read_meta(rank_dir).step_peak_bytes or traced_step_peaks(rank_dir, device)
    return max(peaks) if peaks else None


def traced_step_peaks(rank_dir: Path, device: torch.device) -> list[int]:
    """Each traced step's peak (bytes) as its own allocator events show it, in the bundle's Kineto trace: the
    execution-trace observer's copies included."""
    return [int(peak) for peak in _step_peaks(read_json(rank_dir / KINETO_FILE, "Kineto trace").get(
        "traceEvents", []), device, STEP_ANNOTATION)]


class StepPeaks:
    """Each step's memory peak over a block of steps profiled together, each step marked on its own: what
    :func:`step_memory_peak_bytes` measures, for steps a caller runs one at a time (a capture's loop).

        peaks = StepPeaks(device)
        peaks.start()
        for ...:
            with peaks.step():
                train_step()
        print(peaks.stop())   # bytes, one figure a step
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._profiler: profile | None = None

    def start(self) -> None:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda" and ProfilerActivity.CUDA in supported_activities():
            activities.append(ProfilerActivity.CUDA)
        synchronize(self.device)
        self._profiler = profile(activities=activities, profile_memory=True)
        self._profiler.start()

    @contextmanager
    def step(self) -> Iterator[None]:
        with record_function(MEMORY_STEP):
            yield
            synchronize(self.device)

    def stop(self) -> list[int]:
        """The peak of each marked step that allocated anything (bytes), in order; the profiler ends."""
        if self._profiler is None:
            return []
        self._profiler.stop()
        with tempfile.TemporaryDirectory(prefix="cobench-memory-") as tmp:
            path = Path(tmp) / "trace.json"
            self._profiler.export_chrome_trace(str(path))
            events = json.loads(path.read_text()).get("traceEvents", [])
        self._profiler = None
        return [int(peak) for peak in _step_peaks(events, self.device, MEMORY_STEP)]

    def abandon(self) -> None:
        """End the profiler without reading it (the loop failed)."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None


def step_memory_peak_bytes(step: Callable[[], Any], device: torch.device, steps: int = 1) -> int:
    """The most memory one of ``steps`` calls of ``step`` holds at once beyond what was allocated when it began.

    Read from the profiler's memory events for ``device``, each call on its own: the allocator's running
    total, less what it was when the call's first event came (as :func:`captured_step_peak_bytes` reads a
    captured step). The CPU's total counts from when profiling began; a caching device allocator's
    (CUDA's) counts everything the process holds, the other side's model and state included. No RSS, so
    another side's tensors in the same process do not count. Not one window over all the calls: the
    CPU's total never takes back a block freed on a thread the profiler does not follow (a gloo
    worker's, finishing an asynchronous collective), so over several steps it climbs (TorchRec's DLRM:
    142 KiB a step, 142 to 351 KiB over 8 steps from one block of 8 to the next).
    """
    peaks = StepPeaks(device)
    peaks.start()
    try:
        for _ in range(steps):
            with peaks.step():
                step()
    except BaseException:
        peaks.abandon()
        raise
    return max(peaks.stop(), default=0)
