"""Boolean masks whose count of True decides a shape: found in the trace, given the captured count on replay.

``x[mask]``, ``nonzero(mask)``, ``masked_select`` and ``x[mask] = v`` make (or read) as many rows as
the mask holds True values. The captured output shapes say how many; :func:`mask_counts` reads that
count off an op, :func:`find_mask_pins` has the op that last writes each such mask write one with
exactly that count.
"""

from __future__ import annotations

import math
from collections.abc import Container
from typing import Any

import torch

from workloads.trace_replay.ops import CompiledOp, OpUnavailable, TensorInfo, at, list_types, tensor_info
from workloads.trace_replay.parse import is_tensor_ref
from workloads.trace_replay.records import OpRecord

# Ops whose output shape follows a boolean mask's count of True, with the mask's argument position
# (``aten::index`` and ``index_put``, whose masks sit in an index list, are read apart).
_MASK_ARGUMENT = {"aten::nonzero": 0, "aten::argwhere": 0, "aten::nonzero_numpy": 0, "aten::where": 0,
                  "aten::masked_select": 1, "aten::masked_scatter": 1, "aten::masked_scatter_": 1}
_NONZERO = ("aten::nonzero", "aten::argwhere", "aten::nonzero_numpy", "aten::where")  # one row per True


def find_mask_pins(sequence: list[list[int]], ops: list[CompiledOp], specs: list[OpRecord], slots: dict[tuple, int],
                   externals: Container[int], generator: torch.Generator,
                   device: torch.device) -> dict[int, torch.Tensor]:
    """Boolean masks whose count of True decides a shape get exactly the captured count.

    ``x[mask]``, ``nonzero(mask)``, ``masked_select`` and ``x[mask] = v`` make (or read) as many rows
    as the mask holds True values; a mask computed from synthesised floats would hold another
    number, and every shape after it — and any recorded integer data it meets, such as a loss's
    targets — would disagree. The captured shapes say how many: the op that last wrote the mask
    before such a reader writes a mask with exactly that many True values (positions drawn from
    the replay's seed) after it runs (:attr:`.ops.CompiledOp.pins`); a mask the steps read but never
    made gets it when synthesised: returned, by slot.
    """
    decided: set[tuple[int, int]] = set()
    external_masks: dict[int, torch.Tensor] = {}  # masks the steps read but never make
    for step in sequence:
        writer: dict[int, CompiledOp] = {}
        for position in step:
            op = ops[position]
            for slot, info, count in mask_counts(specs[position], slots):
                if (op.step, slot) in decided or not 0 <= count <= math.prod(info.shape):
                    continue
                decided.add((op.step, slot))
                flat = torch.zeros(math.prod(info.shape), dtype=torch.bool)
                flat[torch.randperm(flat.numel(), generator=generator)[:count]] = True
                mask = flat.reshape(info.shape).to(device)
                if slot in writer:
                    writer[slot].pins.append((slot, mask))
                elif slot in externals:
                    external_masks[slot] = mask
            writer.update((slot, op) for slot in op.out_slots if slot is not None)
    return external_masks


def mask_counts(spec: OpRecord, slots: dict[tuple, int]) -> list[tuple[int, TensorInfo, int]]:
    """(slot, layout, captured count of True) of each boolean mask this op's output shape depends on."""
    name, inputs = spec.name, spec.inputs
    shapes = [s if isinstance(s, list) else [] for s in inputs.shapes]
    out = spec.outputs.shapes[0] if spec.outputs.shapes and isinstance(spec.outputs.shapes[0], list) else None
    if out is None or not any("Tensor(bool)" in t for t in inputs.types):
        return []
    while out and isinstance(out[0], list):  # a list of tensors (``where(condition)``): the first one's
        out = out[0]
    if name == "aten::where" and len(inputs.values) != 1:
        return []  # where(condition, x, y) keeps its shape whatever the condition holds

    def slot_of(value: Any, shape: Any, stride: Any, et_type: str) -> tuple[int, TensorInfo] | None:
        if not is_tensor_ref(value) or et_type != "Tensor(bool)":
            return None
        try:
            info = tensor_info(value, shape, stride, et_type)
        except OpUnavailable:
            return None
        return (slots[info.key], info) if info.key in slots else None

    if name in _MASK_ARGUMENT:
        arg = _MASK_ARGUMENT[name]
        found = slot_of(inputs.values[arg], at(inputs.shapes, arg), at(inputs.strides, arg), inputs.types[arg]) \
            if len(inputs.values) > arg else None
        if found is None or not out:
            return []
        slot, info = found
        if name in _NONZERO:
            return [(slot, info, int(out[0]))]
        if name.startswith("aten::masked_scatter"):  # reads as many source elements as the mask holds
            source = shapes[2] if len(shapes) > 2 else []
            return [(slot, info, min(math.prod(info.shape), math.prod(source)))]
        # masked_select: the mask broadcasts against self; each True counts once per repetition
        spread = math.prod(torch.broadcast_shapes(tuple(shapes[0]), info.shape)) // max(math.prod(info.shape), 1)
        return [(slot, info, int(out[0]) // spread)] if spread and int(out[0]) % spread == 0 else []
    if name not in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        return []
    if len(inputs.values) < 2 or not inputs.types[1].startswith("GenericList[") or not shapes[0]:
        return []
    items, types = inputs.values[1], list_types(inputs.types[1])
    tensors = [j for j, t in enumerate(types) if t.startswith("Tensor(") and "nullptr" not in t and j < len(items)
               and is_tensor_ref(items[j])]
    if len(tensors) != 1 or types[tensors[0]] != "Tensor(bool)":
        return []  # a lone mask among None entries: mixed advanced indexing broadcasts otherwise
    j = tensors[0]
    found = slot_of(items[j], at(inputs.shapes[1], j), at(inputs.strides[1], j) if isinstance(
        at(inputs.strides, 1), list) else None, types[j])
    if found is None:
        return []
    slot, info = found
    if name == "aten::index":
        return [(slot, info, int(out[j]))] if len(out) > j else []
    # index_put: the values broadcast to self[:j] + [count] + self[j + mask dims:], aligned right
    values = shapes[2] if len(shapes) > 2 else []
    expected = len(shapes[0]) - len(info.shape) + 1
    from_right = expected - 1 - j
    if len(values) <= from_right or values[len(values) - 1 - from_right] == 1:
        return []  # broadcast along the masked rows: any count fits
    return [(slot, info, int(values[len(values) - 1 - from_right]))]
