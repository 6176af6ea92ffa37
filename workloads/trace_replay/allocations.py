"""When the program allocated and freed its storages: each op's ``allocated``, ``released`` and ``born``.

From the allocator's events in the traced steps' Kineto trace (``profile_memory``): an allocation
inside an op whose size is one of its new output storages' is that storage; the free at the same
address, later, is placed after the last op that began before it. A program holds memory longer
than its last use says (a backward formula's intermediates live until it returns, Python names
until they are rebound): the replay frees each buffer when the program did, so the peak is the
program's. Bundles captured without memory events get no ``released`` (the replay frees at last use).

``born`` on an op: storages the program allocated after it and before the next op, outside every
replayed op (a compiled graph's own buffers: inductor allocates them without an op), that a later
op of the step reads before any op writes them. Without it the replay would hold such a buffer
(e.g. an activation a compiled forward saves for its backward) from the start as if it lived
across steps; with it the replay makes the buffer when the program did. An allocation is matched
to the first storage of its exact size that the step reads without having made or read it, and
kept only if the program freed it within the traced steps and after that read (a temporary of the
same size freed at once is not it; what lives on is state). Below :data:`BORN_MIN_BYTES` (scalars
wrapped from Python numbers) the memory is immaterial and making it each step would cost the replay
host time the program did not spend: those stay held throughout.
"""

from __future__ import annotations

import bisect
from typing import Any

from workloads.trace_replay.parse import MemoryEvent, tensor_refs

BORN_MIN_BYTES = 1024  # smaller buffers a program makes outside any op are held by the replay throughout


def _storage_bytes(values: list[Any], seen: set[int]) -> dict[int, int]:
    """Storage id → the bytes its views among ``values`` reach, for storages not in ``seen``."""
    found: dict[int, int] = {}
    for ref in tensor_refs(values):
        if ref[1] not in seen and ref[3] > 0:
            found[ref[1]] = max(found.get(ref[1], 0), (ref[2] + ref[3]) * ref[4])
    return found


def _first_uses(timed: list[dict[str, Any]]) -> tuple[list[dict[int, int]], list[tuple[int, int, int]]]:
    """Per timed op, its new output storages (id → bytes); and the storages each step reads before it
    makes or reads them, as (first reader, storage, bytes)."""
    seen: set[int] = set()  # storages that existed before an op in its step: its inputs, earlier outputs
    fresh: list[dict[int, int]] = []
    orphans: list[tuple[int, int, int]] = []
    for k, op in enumerate(timed):
        if k and op["step"] != timed[k - 1]["step"]:
            seen.clear()
        inputs = op["inputs"].get("values", [])
        orphans.extend((k, sid, size) for sid, size in _storage_bytes(inputs, seen).items())
        seen.update(ref[1] for ref in tensor_refs(inputs))
        new: dict[int, int] = {}
        for ref in tensor_refs(op["outputs"].get("values", [])):
            if ref[1] not in seen and ref[3] > 0:
                new[ref[1]] = max(new.get(ref[1], 0), (ref[2] + ref[3]) * ref[4])
            seen.add(ref[1])
        fresh.append(new)
    return fresh, orphans


def mark_source_releases(ops: list[dict[str, Any]], memory: list[MemoryEvent]) -> None:
    """Set ``allocated``, ``released`` and ``born`` on each op from the allocator's events (in time order)."""
    timed = [op for op in ops if op["ts_us"] is not None and op["dur_us"] is not None]
    if not memory or not timed:
        return
    starts = [op["ts_us"] for op in timed]
    fresh, orphans = _first_uses(timed)
    for op in ops:
        op["allocated"], op["released"], op["born"] = [], [], []
    owner: dict[int, int] = {}  # address → the storage allocated there, while it lives
    unconfirmed: dict[int, tuple[dict[str, Any], tuple[int, int, int]]] = {}  # address → (op, orphan) made between ops
    for event in memory:
        at = bisect.bisect_right(starts, event.ts) - 1  # the last op that began before the event
        if at < 0:
            continue
        if event.nbytes > 0:
            op = timed[at]
            if event.ts <= op["ts_us"] + op["dur_us"]:
                storage = next((sid for sid, size in fresh[at].items() if size == event.nbytes), None)
                if storage is not None:
                    del fresh[at][storage]
                    owner[event.addr] = storage
                    op["allocated"].append(storage)
                continue
            # between ops: the first storage of this size the step reads later without having made it
            match = None if event.nbytes < BORN_MIN_BYTES else next(
                (i for i, (reader, _, size) in enumerate(orphans)
                 if reader > at and size == event.nbytes and timed[reader]["step"] == op["step"]), None)
            if match is not None:
                unconfirmed[event.addr] = (op, orphans.pop(match))
        elif event.nbytes < 0 and event.addr in unconfirmed:
            made, orphan = unconfirmed.pop(event.addr)
            if at >= orphan[0]:  # alive when read and freed within the steps: the step's buffer, not state
                made["born"].append(orphan[1])
                timed[at]["released"].append(orphan[1])
            else:  # a temporary of that size, gone before the read: the storage may still match a later one
                bisect.insort(orphans, orphan)
        elif event.nbytes < 0 and event.addr in owner:
            timed[at]["released"].append(owner.pop(event.addr))
