"""How much memory one training step holds at its peak, read from the profiler's allocator events:
of a callable's steps run here, or of the steps a trace bundle's capture recorded."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, supported_activities

from harness.platform import synchronize
from workloads.trace_bundle import KINETO_FILE, STEP_ANNOTATION, read_json

# c10::DeviceType codes, as the profiler's memory events name devices (others: any non-CPU event)
_C10_DEVICE_TYPES = {"cpu": 0, "cuda": 1, "xpu": 12, "mps": 13, "privateuseone": 20}


def _memory_totals(events: list, device: torch.device) -> list[tuple[float, float, float]]:
    """(time, bytes, the allocator's running total after it) of the profiler's memory events for ``device``."""
    device_type = _C10_DEVICE_TYPES.get(device.type)
    return [(float(e["ts"]), float(e["args"].get("Bytes", 0)), float(e["args"]["Total Allocated"])) for e in events
            if isinstance(e, dict) and e.get("name") == "[memory]" and isinstance(e.get("args"), dict)
            and "Total Allocated" in e["args"] and isinstance(e.get("ts"), int | float)
            and (e["args"].get("Device Type") == device_type if device_type is not None
                 else e["args"].get("Device Type") != 0)]


def captured_step_peak_bytes(rank_dir: Path, device: torch.device) -> int | None:
    """The most memory one captured step held beyond what it started with, from the capture's own allocator
    events (its Kineto trace); None when the bundle has none."""
    events = read_json(rank_dir / KINETO_FILE, "Kineto trace").get("traceEvents", [])
    totals = _memory_totals(events, device)
    steps = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
             if isinstance(e, dict) and e.get("ph") == "X" and str(e.get("name", "")).startswith(STEP_ANNOTATION)
             and isinstance(e.get("ts"), int | float) and isinstance(e.get("dur"), int | float)]
    peaks = []
    for start, end in steps:
        inside = [(b, t) for ts, b, t in totals if start <= ts <= end]
        if inside:
            before = inside[0][1] - inside[0][0]  # the running total when the step began
            peaks.append(max(0.0, max(t for _, t in inside) - before))
    return int(max(peaks)) if peaks else None


def step_memory_peak_bytes(step: Callable[[], Any], device: torch.device, steps: int = 1) -> int:
    """The most memory ``steps`` calls of ``step`` hold at once beyond what was allocated before them.

    Read from the profiler's memory events for ``device``: the allocator's running total, less what it
    was when the first event came. The CPU's total counts from when profiling began; a caching device
    allocator's (CUDA's) counts everything the process holds, the other side's model and state
    included. No RSS, so another side's tensors in the same process do not count.
    """
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda" and ProfilerActivity.CUDA in supported_activities():
        activities.append(ProfilerActivity.CUDA)
    synchronize(device)
    with profile(activities=activities, profile_memory=True) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    with tempfile.TemporaryDirectory(prefix="cobench-memory-") as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    totals = sorted(_memory_totals(events, device))
    if not totals:
        return 0
    before = totals[0][2] - totals[0][1]  # the running total when the first step began
    return int(max(0.0, max(total for _, _, total in totals) - before))
