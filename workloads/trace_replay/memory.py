"""The memory a spec's replay needs, and what the device has to give.

Every storage is sized from its widest view and live from the first op that touches it to the
last: the peak of their sum is what a spec is refused on when it exceeds the device's available
memory.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from workloads.device import free_memory_bytes
from workloads.trace_replay.ops import at, list_types


def estimate_peak_bytes(rank_spec: dict[str, Any]) -> int:
    """Peak bytes of the replay's tensors: each storage sized from its widest view, live from the first
    op that touches it to the last (storages read before any op writes them live throughout), and what a
    composite op kept whole held at its return (``held_bytes``), live to its step's end, with its peak inside it
    above that (``transient_bytes``) beside it as it returns."""
    size: dict[int, int] = {}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for position, op in enumerate(rank_spec["ops"]):
        for side in ("inputs", "outputs"):
            for ref, shape, stride in laid_out_refs(op[side]):
                sid, offset, itemsize = ref[1], ref[2], ref[4]
                extent = view_extent(shape, stride)
                size[sid] = max(size.get(sid, 0), (offset + extent) * itemsize)
                first.setdefault(sid, position)
                last[sid] = position
    events: dict[int, int] = {}
    ops = rank_spec["ops"]
    step_end = {op.get("step"): position for position, op in enumerate(ops)}
    for position, op in enumerate(ops):  # what a composite kept whole held, made after it: to its step's end
        if held := op.get("held_bytes"):
            freed = step_end[op.get("step")] + 1
            events[position] = events.get(position, 0) + held
            events[freed] = events.get(freed, 0) - held
        if transient := op.get("transient_bytes"):  # and its peak inside above that, beside it for an instant
            events[position] = events.get(position, 0) + transient
            events[position + 0.5] = events.get(position + 0.5, 0) - transient
    for sid, nbytes in size.items():
        events[first[sid]] = events.get(first[sid], 0) + nbytes
        events[last[sid] + 1] = events.get(last[sid] + 1, 0) - nbytes
    live = peak = 0
    for position in sorted(events):
        live += events[position]
        peak = max(peak, live)
    return peak


def available_memory_bytes(device: torch.device) -> int:
    """What the device can still give: free accelerator memory (the allocator's unused cache counted as free),
    or the host's available memory."""
    if device.type != "cpu":
        return free_memory_bytes(device)
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def laid_out_refs(io: dict[str, Any]) -> Iterator[tuple[list, Any, Any]]:
    """Each tensor reference among an op's inputs or outputs (``io``; lists' elements included), with its shape
    and strides as recorded; undefined tensors (``Tensor(nullptr (uninitialized))``: an index list's ``None``)
    left out."""
    for value, et_type, shape, stride in zip(io.get("values", []), io.get("types", []), io.get("shapes", []),
                                             io.get("strides", []), strict=False):
        if et_type.startswith("Tensor(") and "nullptr" not in et_type and _is_ref(value):
            yield value, shape, stride
        elif et_type.startswith("GenericList[") and isinstance(value, list):
            items = list_types(et_type)
            for j, item in enumerate(value):
                if j < len(items) and items[j].startswith("Tensor(") and "nullptr" not in items[j] and _is_ref(item):
                    yield item, at(shape, j), at(stride, j)


def view_extent(shape: Any, stride: Any) -> int:
    """Elements of its storage a view of ``shape`` and ``stride`` spans from its offset (0 when it is empty)."""
    sizes = shape if isinstance(shape, list) else []
    if any(s == 0 for s in sizes):
        return 0
    if not (isinstance(stride, list) and len(stride) == len(sizes)):
        return math.prod(sizes)
    return 1 + sum((s - 1) * st for s, st in zip(sizes, stride, strict=True))


def _is_ref(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 6 and all(type(v) is int for v in value[:5])
