"""Where each replayed tensor comes from: what every op reads, and what the replay must make itself.

An op's outputs feed later ops (views share storage, in-place ops mutate what later ops read).
Tensors the steps read but never produced (parameters, optimiser state, inputs) are *externals*:
synthesised once, before timing, with the value ranges and data their readers recorded. A storage
the program made itself between ops (a compiled graph's buffers, the spec's ``born``) and the step
reads is made at that point of each step instead. Outputs of uninitialised-memory ops that the
program filled unseen (``torch.tensor(list)``) get values: integers in their reader's range, floats
positive; and 0-dim inputs that were Python numbers in the program are passed as Python numbers again.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import torch

from workloads.trace_replay.ops import CompiledOp, OpUnavailable, TensorInfo, at, list_types, tensor_info
from workloads.trace_replay.parse import is_tensor_ref
from workloads.trace_replay.records import OpRecord


class InputUse(NamedTuple):
    """A tensor an op reads: its slot, layout, tensor index (the trace's key for recorded ranges and
    data: tensor inputs counted in order, list elements included) and schema argument name."""

    slot: int
    info: TensorInfo
    tensor_index: int
    arg_name: str


class External(NamedTuple):
    """A tensor the steps read before any op makes it: its layout, its reader's integer range, and
    whether it is an ``offsets`` argument (non-decreasing values)."""

    info: TensorInfo
    value_range: tuple[int, int] | None
    is_offsets: bool


class Constraint(NamedTuple):
    """What a reader recorded of an integer input: its range and, where saved, its data (base64)."""

    info: TensorInfo
    value_range: tuple[int, int] | None
    is_offsets: bool
    data: str | None


Birth = tuple[tuple[int, torch.dtype], list[int]]  # ((storage, dtype), slots viewing it)


def op_inputs(spec: OpRecord, slots: dict[tuple, int]) -> list[InputUse]:
    """Every tensor an op reads that has a slot (the others are pinned to recorded values everywhere)."""
    inputs = spec.inputs
    names: list[str] = []
    if not spec.name.startswith("c10d::"):
        try:
            names = [a.name for a in torch._C.parse_schema(spec.schema).arguments]
        except RuntimeError:
            names = []
    found = []
    tensor_index = -1
    for i, (value, et_type) in enumerate(zip(inputs.values, inputs.types, strict=False)):
        shape, stride = at(inputs.shapes, i), at(inputs.strides, i)
        items = [(value, shape, stride, et_type)]
        if et_type.startswith("GenericList[") and isinstance(value, list):
            types = list_types(et_type)
            items = [(v, at(shape, j), at(stride, j), types[j] if j < len(types) else "")
                     for j, v in enumerate(value)]
        for v, sh, st, t in items:
            if not t.startswith("Tensor("):
                continue
            tensor_index += 1
            if is_tensor_ref(v) and "nullptr" not in t:
                try:
                    info = tensor_info(v, sh, st, t)
                except OpUnavailable:
                    continue
                if info.key in slots:
                    found.append(InputUse(slots[info.key], info, tensor_index, names[i] if i < len(names) else ""))
    return found


def refill_pinned_reads(sequence: list[list[int]], ops: list[CompiledOp]) -> None:
    """Where an op reads an integer tensor as the recorded constant (:attr:`.ops.CompiledOp.pinned`) and a later op
    of the step reads the same tensor from its slot, the recorded values are written into the slot before the
    first op's call (its :attr:`~.ops.CompiledOp.refills`): every reader then sees the program's values. The
    replay's own ops made that tensor from inputs it made up, or from a mask with the captured count of True at
    other positions (:mod:`.masks`): labels' positions within their cluster came out of range (−14 into 60
    rows), which ``index_select`` read as recorded and its backward from the slot, out of bounds."""
    for step in sequence:
        last: dict[int, tuple[int, torch.Tensor]] = {}  # slot → (op index, values) of its latest constant read
        for position in step:
            op = ops[position]
            for slot in [s for _, _, s in op.arg_slots] + [s for _, _, s in op.kwarg_slots]:
                pinned = last.pop(slot, None)
                if pinned is None:
                    continue
                reader = ops[pinned[0]]
                if not any(s == slot and v is pinned[1] for s, v in reader.refills):
                    reader.refills.append((slot, pinned[1]))
            for slot, values in op.pinned:
                last[slot] = (position, values)


def find_externals(sequence: list[list[int]], ops: list[CompiledOp], specs: list[OpRecord],
                   inputs: list[list[InputUse]]) -> tuple[dict[int, External], list[Constraint]]:
    """Slots read before any op of the sequence writes them; and every integer input with a recorded value
    range or data, so that views derived from a synthesised storage (e.g. one table's slice of a batch's
    indices) get values valid for the op that reads them.

    A read of a storage an op of the same step allocated before it is of that op's output, not of a
    synthesised storage: its recorded values are left out. Storage ids come from data addresses, reused
    after frees, so an op's output can have the id of an external read in another step (a routing's
    ``topk`` indices in one step, a wrapped ``// 2`` in the next): written into that external, they made
    its divisor 0 when the first token's expert was 0."""
    produced: set[int] = set()
    externals: dict[int, External] = {}
    constraints: list[Constraint] = []
    for step in sequence:
        allocated: set[int] = set()  # storages this step's ops have allocated so far, and not freed since
        for position in step:
            spec = specs[position]
            for slot, info, tensor_index, arg_name in inputs[position]:
                rng = spec.tensor_range.get(str(tensor_index))
                rng = (int(rng[0]), int(rng[1])) if isinstance(rng, list) and len(rng) == 2 else None
                data = spec.tensor_data.get(str(tensor_index))
                if (rng is not None or data) and not info.dtype.is_floating_point \
                        and info.storage_id not in allocated:
                    constraints.append(Constraint(info, rng, arg_name == "offsets", data))
                if slot not in produced and slot not in externals:
                    externals[slot] = External(info, rng, arg_name == "offsets")
            produced.update(s for s in ops[position].out_slots if s is not None)
            allocated.update(spec.allocated)
            allocated.difference_update(spec.released)
    return externals, constraints


def find_births(sequence: list[list[int]], specs: list[OpRecord], inputs: list[list[InputUse]],
                externals: dict[int, External]) -> tuple[dict[int, list[Birth]], set[int]]:
    """Flat position → the (storage, slots viewing it) the program made right after that op, outside any
    op (the spec's ``born``), among the externals; and the slots so made.

    Such a storage is made in each step at that point rather than held from the start. A slot
    qualifies only if every step that reads it makes it first; else it stays a buffer that lives
    across steps.
    """
    births: dict[int, dict[tuple[int, torch.dtype], list[int]]] = {}
    verdict: dict[int, bool] = {}  # external slot → made before its first read in every step so far
    flat = 0
    for step in sequence:
        pending: dict[int, int] = {}  # storage id → the flat position it was made after
        first: set[int] = set()
        for position in step:
            for slot, info, _, _ in inputs[position]:
                if slot not in externals or slot in first:
                    continue
                first.add(slot)
                made = pending.get(info.storage_id)
                verdict[slot] = verdict.get(slot, True) and made is not None
                if made is not None:
                    births.setdefault(made, {}).setdefault((info.storage_id, info.dtype), []).append(slot)
            for storage in specs[position].born:
                pending[storage] = flat
            flat += 1
    # A storage is made only with all its views; a view that does not qualify keeps its storage (in
    # every step) a buffer that lives across steps, and with it the storage's other views.
    born = {slot for slot, ok in verdict.items() if ok}
    while True:
        dropped = {slot for groups in births.values() for slots in groups.values()
                   if not all(s in born for s in slots) for slot in slots} & born
        if not dropped:
            break
        born -= dropped
    return {k: [(key, slots) for key, slots in groups.items() if all(s in born for s in slots)]
            for k, groups in births.items()}, born


FLOAT_FILL_MAX_ELEMENTS = 2**16  # a larger uninitialised float buffer is a workspace some op fills, not data


def _written_arguments(schema: str) -> set[str]:
    """The schema's arguments the op writes (``Tensor(a!)``: in-place, ``out=``)."""
    try:
        return {a.name for a in torch._C.parse_schema(schema).arguments
                if a.alias_info is not None and a.alias_info.is_write}
    except RuntimeError:
        return set()


def find_uninitialised_fills(ops: list[CompiledOp], specs: list[OpRecord], inputs: list[list[InputUse]]) -> None:
    """Outputs of uninitialised-memory ops (``aten::empty*``) that the program filled by a copy the trace does
    not show (``torch.tensor(list)``, ``torch.as_tensor(list)``) get values (:attr:`.ops.CompiledOp.fills`):
    integer ones, in the range their first reader recorded; floating ones of up to
    :data:`FLOAT_FILL_MAX_ELEMENTS` elements whose first reader reads rather than writes them, positive
    values (as every synthesised float: :func:`.tensors.fill_view`) — left as they were, they held whatever
    the memory held (Faster R-CNN's image std: 1e-20, and the normalised images infinite)."""
    pending: dict[int, CompiledOp] = {}
    for op in ops:
        written: set[str] | None = None
        for slot, info, tensor_index, arg_name in inputs[op.index]:
            maker = pending.pop(slot, None)
            if maker is None:
                continue
            if info.dtype.is_floating_point:
                written = _written_arguments(specs[op.index].schema) if written is None else written
                if arg_name not in written:
                    maker.fills.append((slot, None))
                continue
            rng = specs[op.index].tensor_range.get(str(tensor_index))
            if isinstance(rng, list) and len(rng) == 2:
                maker.fills.append((slot, (int(rng[0]), int(rng[1]))))
        if re.fullmatch(r"aten::(empty|empty_strided|empty_like|new_empty|new_empty_strided)", op.name):
            for slot, info in zip(op.out_slots, op.out_infos, strict=False):
                if slot is None or info is None or info.dtype == torch.bool:
                    continue
                if not info.dtype.is_floating_point or math.prod(info.shape) <= FLOAT_FILL_MAX_ELEMENTS:
                    pending[slot] = op


def find_wrapped_numbers(ops: list[CompiledOp], inputs: list[list[InputUse]],
                         externals: dict[int, External]) -> dict[int, list[int]]:
    """Op index → its 0-dim inputs that were Python numbers in the program (``loss * 1e-3``).

    A Python number passed where an op takes a tensor becomes a 0-dim double (or long) "wrapped
    number", which never promotes the other operand: ``float32 scalar × 1e-3`` stays float32. The
    trace shows only a 0-dim double tensor; synthesised as one, it would promote the result to
    double and every op after it would disagree. Such an input (made by no op, of a binary op whose
    captured result type only a wrapped number explains) is passed as a Python number instead
    (the synthesis puts its value in).
    """
    wrapped: dict[int, list[int]] = {}
    wrappable = (torch.float64, torch.int64, torch.complex128, torch.bool)

    def probe(info: TensorInfo) -> torch.Tensor:
        return torch.empty((1,) * min(len(info.shape), 1), dtype=info.dtype)

    for op in ops:
        out = op.out_infos[0] if op.out_infos else None
        infos = {use.slot: use.info for use in inputs[op.index]}
        tensors = [(slot, infos[slot]) for _, sub, slot in op.arg_slots if sub < 0 and slot in infos]
        if op.error is not None or out is None or len(tensors) != 2 or len(op.arg_slots) != 2:
            continue
        (slot_a, a), (slot_b, b) = tensors
        if torch.result_type(probe(a), probe(b)) == out.dtype:
            continue
        for slot, info, other in ((slot_b, b, a), (slot_a, a, b)):
            if info.shape == () and info.dtype in wrappable and slot in externals \
                    and torch.result_type(probe(other), probe(info).item()) == out.dtype:
                wrapped.setdefault(op.index, []).append(slot)
                break
    return wrapped
