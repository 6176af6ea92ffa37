"""When the replay frees each tensor: per position of the replayed sequence, the slots to release after it.

A slot is freed after its last use, or later where the program held it longer: for a storage the
spec saw allocated (``allocated``, from the allocator's events), after the op that the program
freed it after (``released``), or at the end of its step when the program kept it past the step.
Other slots (and every slot of a spec without that record) are freed at last use. Tensors a step
reads before any op of it writes them (made before the capture, or by an earlier step) live across
steps; those the program made between ops (``born``) are made again in each step and freed as the
program freed them.
"""

from __future__ import annotations

from workloads.trace_replay.dataflow import Birth, External, InputUse
from workloads.trace_replay.ops import CompiledOp
from workloads.trace_replay.records import OpRecord


def plan_clears(sequence: list[list[int]], ops: list[CompiledOp], specs: list[OpRecord],
                inputs: list[list[InputUse]], externals: dict[int, External], births: dict[int, list[Birth]],
                born_slots: set[int]) -> list[list[int]]:
    """Per position of the flattened sequence: the slots to free after it runs."""
    flat = [p for step in sequence for p in step]
    # read before written: live across steps and cycles, as is what one step hands the next
    carried = (set(externals) | _handed_on(sequence, ops, inputs)) - born_slots
    last_use: dict[int, int] = {}
    for k, position in enumerate(flat):
        for use in inputs[position]:
            last_use[use.slot] = k
        for slot in ops[position].out_slots:
            if slot is not None:
                last_use.setdefault(slot, k)
                last_use[slot] = max(last_use[slot], k)
    held = _source_lifetimes(flat, ops, specs, carried)
    clears: list[list[int]] = [[] for _ in flat]
    for slot, k in last_use.items():
        if slot not in carried and slot not in born_slots:
            clears[max(k, held.get(slot, k))].append(slot)
    _born_lifetimes(sequence, flat, specs, inputs, births, clears)
    return clears


def _handed_on(sequence: list[list[int]], ops: list[CompiledOp], inputs: list[list[InputUse]]) -> set[int]:
    """The slots a step reads before it writes them: what an earlier step made and handed on (an optimiser's
    history made anew each step, as LBFGS keeps it; a hidden state carried to the next batch). Freed at its last
    read, a step could not run again before the one that makes it (the calibrations run a step over and over)."""
    handed: set[int] = set()
    for step in sequence:
        written: set[int] = set()
        for position in step:
            handed.update(use.slot for use in inputs[position] if use.slot not in written)
            written.update(slot for slot in ops[position].out_slots if slot is not None)
    return handed


def _born_lifetimes(sequence: list[list[int]], flat: list[int], specs: list[OpRecord], inputs: list[list[InputUse]],
                    births: dict[int, list[Birth]], clears: list[list[int]]) -> None:
    """Add to ``clears`` the end of every lifetime of a storage made between ops: made again in each
    step, it lives to its last read in that step, or later to the op the program freed it after, or to
    the step's end when the program kept it past the step."""
    start = 0
    for step in sequence:
        end = start + len(step) - 1
        born: dict[int, tuple[int, int]] = {}  # slot → (made after, storage)
        last: dict[int, int] = {}
        freed: dict[int, int] = {}  # storage → the first position after its making it was freed after
        for k in range(start, end + 1):
            for use in inputs[flat[k]]:
                if use.slot in born:
                    last[use.slot] = k
            for storage in specs[flat[k]].released:
                if any(sid == storage for _, sid in born.values()):
                    freed.setdefault(storage, k)
            for (storage, _), slots in births.get(k, []):
                born.update((slot, (k, storage)) for slot in slots)
        for slot, (made, storage) in born.items():
            clears[max(last.get(slot, made), freed.get(storage, end))].append(slot)
        start = end + 1


def _source_lifetimes(flat: list[int], ops: list[CompiledOp], specs: list[OpRecord],
                      carried: set[int]) -> dict[int, int]:
    """Slot → the last flat position the program held its storage (see :func:`plan_clears`)."""
    held: dict[int, int] = {}
    # storage allocated in this step → its lifetimes, oldest first, each the slots viewing it: an id is an
    # address's, so an op may make a storage at the address one freed within it had (that one's release
    # is then this op's too, and ends the older lifetime)
    live: dict[int, list[list[int]]] = {}
    step_of = [ops[p].step for p in flat]
    for k, position in enumerate(flat):
        op, allocated = ops[position], specs[position].allocated
        made: dict[int, list[int]] = {}
        for slot, info in zip(op.out_slots, op.out_infos, strict=False):
            if slot is not None and info is not None and slot not in carried and info.storage_id in allocated:
                made.setdefault(info.storage_id, []).append(slot)
        for storage, slots in made.items():
            live.setdefault(storage, []).append(slots)
        for storage in specs[position].released:
            if live.get(storage):
                for slot in live[storage].pop(0):
                    held[slot] = max(held.get(slot, k), k)
        if k + 1 == len(flat) or step_of[k + 1] != step_of[k]:  # kept past the step: to its end
            for lifetimes in live.values():
                for slot in (slot for slots in lifetimes for slot in slots):
                    held[slot] = max(held.get(slot, k), k)
            live.clear()
    return held
