"""When the program allocated and freed its storages: each op's ``allocated``, ``released`` and ``born``.

From the allocator's events in the traced steps' Kineto trace (``profile_memory``): an allocation
inside an op, still held when it returned, whose size is one of its new output storages' is that
storage; the free at the same address, later, is placed after the last op that began before it. The
CPU's allocator reports the bytes asked for; a device's caching allocator (CUDA's, XPU's, ...) the
block it handed out, rounded up (:func:`fits`): there an allocation is the new output storage whose
block it can be, the closest first. A program holds memory longer than its last use says (a backward
formula's intermediates live until it returns, Python names until they are rebound): the replay frees
each buffer when the program did, so the peak is the program's. Bundles captured without memory events
get no ``released`` (the replay frees at last use).

``born`` on an op: storages the program allocated after it and before the next op, outside every
replayed op (a compiled graph's own buffers: inductor allocates them without an op), or inside a
composite op the replay keeps whole (``held_bytes``: all it allocated inside it and still held when it
returned, beyond its outputs; a recurrent layer's gates and states, saved for backward: there only the
storages its inner ops made, which the trace holds), that a later op of the step reads before any op
writes them. Without it the replay would hold such a buffer (e.g. an activation a compiled forward
saves for its backward) from the start as if it lived across steps; with it the replay makes the
buffer when the program did. An allocation is matched
to the first storage of its size (:func:`fits`) that the step reads without having made or read it, and
kept only if the program freed it within the traced steps and after that read (a temporary of the
same size freed at once is not it; what lives on is state). Below :data:`BORN_MIN_BYTES` (scalars
wrapped from Python numbers) the memory is immaterial and making it each step would cost the replay
host time the program did not spend: those stay held throughout, except inside a composite kept whole,
whose storages are laid over a few buffers made at once (:mod:`.synthesis`).
"""

from __future__ import annotations

import bisect
from typing import Any

from workloads.trace_replay.memory import laid_out_refs, view_extent
from workloads.trace_replay.parse import MemoryEvent, tensor_refs

BORN_MIN_BYTES = 1024  # smaller buffers a program makes outside any op are held by the replay throughout
# A device's caching allocator (c10's CachingDeviceAllocator, CUDA's) hands out blocks in multiples of
# BLOCK_ROUND bytes, and a block above SMALL_BLOCK whole where what it would leave is at most SMALL_BLOCK;
# it reports the block. Its roundup_power2_divisions setting rounds a small one up to a fraction of
# the next power of two instead: at most to that power.
BLOCK_ROUND = 512
SMALL_BLOCK = 1 << 20


def fits(size: int, event: MemoryEvent) -> bool:
    """Whether an allocation of ``event.nbytes`` can be a storage of ``size`` bytes: exactly on the CPU,
    as its block on a device (:data:`BLOCK_ROUND`, :data:`SMALL_BLOCK`)."""
    if event.device_type == 0:
        return event.nbytes == size
    block = -(-size // BLOCK_ROUND) * BLOCK_ROUND
    most = max(block, 1 << max(0, size - 1).bit_length()) if size <= SMALL_BLOCK else block + SMALL_BLOCK
    return size <= event.nbytes <= most


def _closest(sizes: list[tuple[Any, int]], event: MemoryEvent, *, within: bool = False) -> int | None:
    """The index in ``sizes`` ((key, bytes), in order) of the storage ``event`` allocated: of those it can be,
    the one it rounds up least, the first of equals; None where none fits. ``within``: a storage whose views
    reach no further than the allocation can be it too (later ops may read only part of it: an LSTM's
    backward reads three of a time step's four gate chunks)."""
    found = [(event.nbytes - size, k) for k, (_, size) in enumerate(sizes)
             if fits(size, event) or within and 0 < size <= event.nbytes]
    return min(found)[1] if found else None


def _storage_bytes(io: dict[str, Any], seen: set[int]) -> dict[int, int]:
    """Storage id → the bytes its views among an op's inputs or outputs (``io``) reach, for storages not in
    ``seen``. A view reaches its offset plus its extent, not its element count: an LSTM's gate chunk (6 × 24 of
    a 6 × 96 storage, at offset 72) reaches the storage's 2,304 bytes, where 72 + 144 elements said 864."""
    found: dict[int, int] = {}
    for ref, shape, stride in laid_out_refs(io):
        if ref[1] not in seen and ref[3] > 0:
            found[ref[1]] = max(found.get(ref[1], 0), (ref[2] + view_extent(shape, stride)) * ref[4])
    return found


def _first_uses(timed: list[dict[str, Any]]) -> tuple[list[dict[int, int]], list[tuple[int, int, int]]]:
    """Per timed op, the output storages it may have made (id → bytes): those it does not read, an id seen
    earlier in the step too (an id is an address's, reused after a free: a convolution's input gradient at
    the address its forward's batch norm output had), which an allocation inside the op confirms; and the
    storages each step reads before it makes or reads them, as (first reader, storage, bytes)."""
    seen: set[int] = set()  # storages that existed before an op in its step: its inputs, earlier outputs
    fresh: list[dict[int, int]] = []
    orphans: list[tuple[int, int, int]] = []
    for k, op in enumerate(timed):
        if k and op["step"] != timed[k - 1]["step"]:
            seen.clear()
        orphans.extend((k, sid, size) for sid, size in _storage_bytes(op["inputs"], seen).items())
        read = {ref[1] for ref in tensor_refs(op["inputs"].get("values", []))}
        seen.update(read)
        fresh.append(_storage_bytes(op["outputs"], read))
        seen.update(ref[1] for ref in tensor_refs(op["outputs"].get("values", [])))
    return fresh, orphans


def _last_reads(timed: list[dict[str, Any]], orphans: list[tuple[int, int, int]]) -> dict[tuple[int, int], int]:
    """(first reader, storage) of each of ``orphans`` → the last op of its step that reads the storage before
    an op makes it anew (an id is an address's, reused after a free)."""
    starting: dict[int, list[int]] = {}
    for reader, sid, _ in orphans:
        starting.setdefault(reader, []).append(sid)
    active: dict[int, tuple[int, int]] = {}
    last: dict[tuple[int, int], int] = {}
    for k, op in enumerate(timed):
        if k and op["step"] != timed[k - 1]["step"]:
            active.clear()
        for sid in starting.get(k, []):
            active[sid] = (k, sid)
        for ref in tensor_refs(op["inputs"].get("values", [])):
            if ref[1] in active:
                last[active[ref[1]]] = k
        for ref in tensor_refs(op["outputs"].get("values", [])):
            if ref[1] in active and active[ref[1]][0] != k:
                del active[ref[1]]
    return last


def _free_times(memory: list[MemoryEvent]) -> dict[int, float]:
    """Each allocation's index in ``memory`` → when the same address was freed next (allocations never
    freed are left out)."""
    live: dict[tuple[int, int], int] = {}
    freed: dict[int, float] = {}
    for n, event in enumerate(memory):
        where = (event.device_type, event.addr)
        if event.nbytes > 0:
            live[where] = n
        elif event.nbytes < 0 and where in live:
            freed[live.pop(where)] = event.ts
    return freed


def mark_source_releases(ops: list[dict[str, Any]], memory: list[MemoryEvent],
                         inner: dict[int, set[int]] | None = None) -> None:
    """Set ``allocated``, ``released`` and ``born`` on each op from the allocator's events (in time order);
    ``inner``: each composite kept whole (``held_bytes``), by op id, with the storages its inner ops made."""
    timed = [op for op in ops if op["ts_us"] is not None and op["dur_us"] is not None]
    if not memory or not timed:
        return
    starts = [op["ts_us"] for op in timed]
    fresh, orphans = _first_uses(timed)
    last = _last_reads(timed, orphans)
    for op in ops:
        op["allocated"], op["released"], op["born"] = [], [], []
    # (device, address) → the storage allocated there, while it lives; or (op, orphan) made between ops
    owner: dict[tuple[int, int], int] = {}
    unconfirmed: dict[tuple[int, int], tuple[dict[str, Any], tuple[int, int, int]]] = {}
    freed = _free_times(memory)
    inside: dict[int, list[int]] = {}  # a composite kept whole → [its bytes allocated less freed so far, their peak]
    for n, event in enumerate(memory):
        at = bisect.bisect_right(starts, event.ts) - 1  # the last op that began before the event
        where = (event.device_type, event.addr)
        if at < 0:
            continue
        if "held_bytes" in timed[at] and event.ts <= timed[at]["ts_us"] + timed[at]["dur_us"]:
            running = inside.setdefault(at, [0, 0])
            running[0] += event.nbytes
            running[1] = max(running[1], running[0])
        if event.nbytes > 0:
            op = timed[at]
            if event.ts <= op["ts_us"] + op["dur_us"]:
                if freed.get(n, float("inf")) <= op["ts_us"] + op["dur_us"]:
                    continue  # freed before the op returned: its workspace (a wrapped scalar, a buffer), no output
                made = list(fresh[at].items())
                if (k := _closest(made, event)) is not None:
                    del fresh[at][made[k][0]]
                    owner[where] = made[k][0]
                    op["allocated"].append(made[k][0])
                    continue
                if "held_bytes" not in op:
                    continue
                # a composite kept whole: what it made inside it and still held, made right after it; a
                # storage of it that a later op reads is one of those (below), of any size: the replay lays
                # them all over the few buffers it makes for them
                op["held_bytes"] += event.nbytes
                held = True
            else:
                held = False
            # between ops: the first storage of this size the step reads later without having made it
            later = [(i, size) for i, (reader, _, size) in enumerate(orphans)
                     if reader > at and timed[reader]["step"] == op["step"]]
            if held:
                # a storage one of its inner ops made (the trace holds their outputs); sizes alone matched a
                # GRU tagger's labels (192 int64) to a time step's hidden state (8 × 48 floats) in six captures of six
                made_inside = (inner or {}).get(op["id"], set())
                later = [(i, size) for i, size in later if orphans[i][1] in made_inside]
            if held and n in freed:
                # of a composite's many storages of one size (an LSTM's gates, a time step each, read back in
                # reverse), the one last read just before this allocation was freed
                gone = bisect.bisect_right(starts, freed[n]) - 1
                later = sorted(((gone - last[orphans[i][:2]], size), i, size) for i, size in later
                               if last.get(orphans[i][:2], gone + 1) <= gone)
                later = [(i, size) for _, i, size in later]
            k = None if event.nbytes < BORN_MIN_BYTES and not held else _closest(later, event, within=held)
            if k is not None:
                unconfirmed[where] = (op, orphans.pop(later[k][0]))
        elif event.nbytes < 0 and where in unconfirmed:
            made_by, orphan = unconfirmed.pop(where)
            if at >= orphan[0]:  # alive when read and freed within the steps: the step's buffer, not state
                made_by["born"].append(orphan[1])
                timed[at]["released"].append(orphan[1])
            else:  # a temporary of that size, gone before the read: the storage may still match a later one
                bisect.insort(orphans, orphan)
        elif event.nbytes < 0 and where in owner:
            timed[at]["released"].append(owner.pop(where))
    # a composite's peak inside it above what it held at its return (its own workspace: a GRU's input projection
    # for every time step, freed as it returns, beside the gates it keeps), which the replay's op, run without
    # grad, never reaches (a GRU over a random crop: 15.7 % of the program's memory short)
    for at, (end, peak) in inside.items():
        timed[at]["transient_bytes"] = max(0, peak - end)
