"""Replay one rank's captured steps on any device: a short facade over the pieces that do the work.

- :mod:`.ops` makes each captured op callable (the dispatcher op its schema names, its call
  template, the value slots its tensors come from and go to); collectives (``c10d::``) run through
  ``torch.distributed`` on the replay's process group (rank i replays captured rank i).
- Here: the dataflow. An op's outputs feed later ops (views share storage, in-place ops mutate what
  later ops read). Tensors the steps read but never produced (parameters, optimiser state, inputs)
  are synthesised once, before timing: one buffer per captured storage, sized from the true extent
  of every view of it, each view laid over it; tensors are released after their last use. A
  storage the program made itself between ops (a compiled graph's buffers) and the step reads is
  made at that point of each step instead (the spec's ``born``), and freed when the program freed it.
- :mod:`.tensors` gives every synthesised tensor defined contents: recorded integer data where the
  trace has it (data-dependent indices and shapes replay as captured), values in the reading op's
  recorded range otherwise, finite floats; stand-ins for ops that could not run.
- :mod:`.codegen` turns each step into straight-line code (one direct C++ op call per op), with
  the program's host time spent in the gaps between ops when asked to.

An op that cannot run here is recorded with its error and replaced by stand-in outputs of the
captured shapes, so everything after it still runs; coverage says what was lost. What may run at
all is :mod:`.safety`'s policy, checked before a replay is built.
"""

from __future__ import annotations

import math
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from workloads.trace_bundle import STEP_ANNOTATION
from workloads.trace_replay.codegen import generate_step, seconds
from workloads.trace_replay.host_time import kineto_host_gaps
from workloads.trace_replay.ops import (
    LAYOUTS,
    MEMORY_FORMATS,
    SCALAR_TYPES,
    CompiledOp,
    OpRefused,
    OpUnavailable,
    TensorInfo,
    at,
    describe,
    fit_length,
    list_types,
    resolve_op,
    tensor_info,
    waited,
)
from workloads.trace_replay.parse import is_tensor_ref, read_kineto
from workloads.trace_replay.records import OpRecord, RankRecord, ValueStats
from workloads.trace_replay.safety import op_refusal
from workloads.trace_replay.tensors import copy_recorded, fill_view, match_values, recorded_view, stand_in

# Ops whose output shape follows a boolean mask's count of True, with the mask's argument position
# (``aten::index`` and ``index_put``, whose masks sit in an index list, are read apart).
_MASK_ARGUMENT = {"aten::nonzero": 0, "aten::argwhere": 0, "aten::nonzero_numpy": 0, "aten::where": 0,
                  "aten::masked_select": 1, "aten::masked_scatter": 1, "aten::masked_scatter_": 1}
_NONZERO = ("aten::nonzero", "aten::argwhere", "aten::nonzero_numpy", "aten::where")  # one row per True


# Kernels whose outputs depend on autograd being on (the workspace their backward reads).
GRAD_MODE_OPS = frozenset({"aten::mkldnn_rnn_layer", "aten::_cudnn_rnn", "aten::miopen_rnn"})


def _with_autograd(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.enable_grad():
            return fn(*args, **kwargs)

    return call


@dataclass
class ReplayStats:
    """What the dry run found: ops that could not run, by index, with their errors."""

    errors: dict[int, str] = field(default_factory=dict)


class Replayer:
    """Replays one rank's ops; :meth:`run_step` replays the next captured step."""

    def __init__(self, rank_spec: RankRecord, device: torch.device, *, repeat: int = 1,
                 process_group: Any = None, seed: int = 0, host_gaps: bool = False, trust: bool = False):
        self.device, self.repeat, self.group = device, repeat, process_group
        self.trust = trust  # run ops the safety policy refuses (the user vouched for this spec)
        self.host_gaps = host_gaps
        self.generator = torch.Generator().manual_seed(seed)
        self.ops_spec = rank_spec.ops
        self.step_indices = sorted({op.step for op in self.ops_spec})
        tails = {s.index: s.tail_gap_us for s in rank_spec.steps}
        # the capture's per-step host-time measurements the gaps' median came from
        self.gap_samples_us = next((list(s.host_gap_samples_us) for s in rank_spec.steps if s.host_gap_samples_us), [])
        self._tail_gaps_us = [tails.get(step, 0.0) for step in self.step_indices]
        # A training step (its backward ran): kernels that keep what their backward needs only with autograd on
        # (an RNN layer's workspace) run with it on, as in the program's forward; nothing the replay makes
        # requires grad, so no graph is recorded. Every other op runs with autograd off (its overhead off too).
        self.training = any(s.startswith("autograd::engine::") for op in self.ops_spec for s in op.scopes)
        self._slots: dict[tuple, int] = {}
        self._inputs_cache: dict[int, list[tuple[int, TensorInfo, int, str]]] = {}
        self.ops: list[CompiledOp] = [self._compile(i, op) for i, op in enumerate(self.ops_spec)]
        # The replay sequence: each step's ops, repeated; positions index into self.ops.
        self.sequence: list[list[int]] = []
        for step in self.step_indices:
            members = [op.index for op in self.ops if op.step == step]
            self.sequence.append(members * repeat)
        self.vals: list[Any] = [None] * len(self._slots)
        self._externals = self._find_externals()
        self._births = self._find_births()  # flat position → storages made right after it
        self._birth_plans: dict[int, tuple[dict, list]] = {}
        self._find_uninitialised_fills()
        self._external_masks: dict[int, torch.Tensor] = {}
        self._find_mask_pins()
        self._wrapped = self._find_wrapped_numbers()
        self._clears = self._liveness()
        self._next = 0
        self._steps: list[tuple[Callable[[list[Any]], None], int] | None] = [None] * len(self.sequence)
        self.errors: dict[int, str] = {}  # op index → why it did not run (compile, dry run or later)
        self.divergent: dict[int, str] = {}  # op index → how what it made differs from what the program made
        self.call_s = 0.0  # the replay's own host time per op call: set by calibrate_host_cost()
        self.call_samples_s: list[float] = []
        self.static_bytes = 0  # synthesised tensors (parameters, optimiser state, inputs): set by materialize()
        self.external_values = rank_spec.external_values  # what the program's own floating inputs held
        self._values_of: dict[tuple[int, torch.dtype], ValueStats] = {}
        self._initial_values: list[tuple[torch.Tensor, torch.Tensor]] = []  # (storage's bytes, their copy)

    # -- compilation -------------------------------------------------------------------------------------
    def _slot(self, info: TensorInfo) -> int:
        return self._slots.setdefault(info.key, len(self._slots))

    def _compile(self, index: int, op: OpRecord) -> CompiledOp:
        compiled = CompiledOp(index, op.name, op.category, op.step, None, [], {}, [], [], [], [], op.dur_us)
        refusal = None if self.trust else op_refusal(op.name, op.schema)
        if refusal is not None:  # check_spec refuses such a spec first: this is the last line of defence
            raise OpRefused(f"op #{index} {op.schema.split('(', 1)[0]}: {refusal}")
        try:
            self._compile_outputs(op, compiled)
            if op.name.startswith("c10d::"):
                compiled.fn = self._collective(op.name)
                self._compile_args(op, compiled, schema_args=None)
                compiled.out_slots = []  # collectives write into their (input) buffers in place
            elif op.name.startswith("_c10d_functional::") and op.name != "_c10d_functional::wait_tensor":
                fn = resolve_op(op.schema)
                wait = torch.ops._c10d_functional.wait_tensor.default
                # The program waited later, inside another op the trace shows only as a whole.
                compiled.fn = lambda *args, _fn=fn, **kwargs: waited(_fn(*args, **kwargs), wait)
                self._compile_args(op, compiled, torch._C.parse_schema(op.schema).arguments)
            else:
                compiled.fn = resolve_op(op.schema)
                if self.training and op.name in GRAD_MODE_OPS:
                    compiled.fn = _with_autograd(compiled.fn)
                self._compile_args(op, compiled, torch._C.parse_schema(op.schema).arguments)
        except Exception as err:  # noqa: BLE001 - an op this build cannot express is recorded, not fatal
            compiled.error = f"{type(err).__name__}: {err}"
            compiled.fn = None
        return compiled

    def _compile_outputs(self, op: OpRecord, compiled: CompiledOp) -> None:
        outputs = op.outputs
        compiled.single_output = len(outputs.types) == 1 and outputs.types[0].startswith("Tensor(")
        for value, shape, stride, et_type in zip(outputs.values, outputs.shapes, outputs.strides, outputs.types,
                                                 strict=False):
            if is_tensor_ref(value) and et_type.startswith("Tensor("):
                info = self._info_or_none(value, shape, stride, et_type)
                compiled.out_slots.append(self._slot(info) if info else None)
                compiled.out_infos.append(info)
            elif isinstance(value, list) and et_type.startswith("GenericList["):
                types = list_types(et_type)
                for j, item in enumerate(value):
                    info = None
                    if is_tensor_ref(item) and j < len(types):
                        info = self._info_or_none(item, at(shape, j), at(stride, j), types[j])
                    compiled.out_slots.append(self._slot(info) if info else None)
                    compiled.out_infos.append(info)
            else:
                compiled.out_slots.append(None)
                compiled.out_infos.append(None)

    @staticmethod
    def _info_or_none(ref: list, shape: Any, stride: Any, et_type: str) -> TensorInfo | None:
        try:
            return tensor_info(ref, shape, stride, et_type)
        except OpUnavailable:
            return None

    def _compile_args(self, op: OpRecord, compiled: CompiledOp, schema_args: list | None) -> None:
        values, types = op.inputs.values, op.inputs.types
        shapes, strides = op.inputs.shapes, op.inputs.strides
        if schema_args is not None and len(values) != len(schema_args):
            raise OpUnavailable(f"the trace passes {len(values)} inputs, the schema takes {len(schema_args)}")
        tensor_index = [-1]  # counts tensor inputs as the trace does (list elements included)
        data = op.tensor_data
        for i, (value, et_type) in enumerate(zip(values, types, strict=False)):
            arg = schema_args[i] if schema_args is not None else None
            arg_type = str(arg.type) if arg is not None else ""
            converted, slots = self._convert(value, et_type, at(shapes, i), at(strides, i), arg_type,
                                             tensor_index, data)
            if arg is not None and arg.kwarg_only:
                compiled.kwargs[arg.name] = converted
                compiled.kwarg_slots.extend((arg.name, sub, slot) for sub, slot in slots)
            else:
                compiled.arg_slots.extend((len(compiled.args), sub, slot) for sub, slot in slots)
                compiled.args.append(converted)

    def _convert(self, value: Any, et_type: str, shape: Any, stride: Any, arg_type: str,
                 tensor_index: list[int], data: dict[str, str]) -> tuple[Any, list]:
        """A trace value → (call-template value, [(list index or −1, slot)])."""
        if et_type.startswith("Tensor("):
            tensor_index[0] += 1
            if not is_tensor_ref(value) or "nullptr" in et_type:
                return None, []
            info = tensor_info(value, shape, stride, et_type)
            pinned = self._pinned(info, data.get(str(tensor_index[0])))
            return (pinned, []) if pinned is not None else (None, [(-1, self._slot(info))])
        if et_type.startswith("GenericList["):
            types = list_types(et_type)
            if any(t.startswith("Tensor(") for t in types):
                slots, template = [], []
                for j, item in enumerate(value):
                    template.append(None)
                    if not types[j].startswith("Tensor(") if j < len(types) else True:
                        continue
                    tensor_index[0] += 1
                    if is_tensor_ref(item) and "nullptr" not in types[j]:  # an undefined tensor: None
                        info = tensor_info(item, at(shape, j), at(stride, j), types[j])
                        pinned = self._pinned(info, data.get(str(tensor_index[0])))
                        if pinned is not None:
                            template[j] = pinned
                        else:
                            slots.append((j, self._slot(info)))
                return template, slots
            return list(value), []
        if et_type == "None" or value == "<None>":
            return None, []
        if et_type == "Device":
            return self.device, []
        if et_type == "Int" and "ScalarType" in arg_type:
            return SCALAR_TYPES[int(value)], []
        if et_type == "Int" and "Layout" in arg_type:
            return LAYOUTS[int(value)], []
        if et_type == "Int" and "MemoryFormat" in arg_type:
            return MEMORY_FORMATS[int(value)], []
        if et_type == "Double" and isinstance(value, str):
            return float(value), []
        if et_type in ("Object", "Generator"):
            return None, []
        return value, []

    def _pinned(self, info: TensorInfo, data: str | None) -> torch.Tensor | None:
        """The program's own values for an integer input the trace recorded, as a constant.

        Index tensors are often computed from data (``nonzero``, cumulative sums of lengths …); from
        synthetic inputs they would come out with other values or even other shapes. Feeding the
        recorded values keeps every lookup in range and every data-dependent shape as captured.
        """
        if data is None or info.dtype.is_floating_point:
            return None
        values = recorded_view(data, info.dtype, info.shape, info.stride)
        # clone: a tensor of its own, not a view of the buffer (ops like detach_ refuse views)
        return None if values is None else values.clone().to(self.device)

    def _collective(self, name: str) -> Callable[..., Any]:
        """The ``torch.distributed`` call for a captured ``c10d::`` op (its process-group arguments dropped)."""
        if not dist.is_initialized():
            raise OpUnavailable(f"{name} needs a process group: replay under torchrun with the captured world size")
        group = self.group
        table: dict[str, Callable[..., Any]] = {
            "c10d::allreduce_": lambda tensors, *_: [dist.all_reduce(t, group=group) for t in tensors],
            "c10d::_allgather_base_": lambda out, inp, *_: dist.all_gather_into_tensor(out, inp, group=group),
            "c10d::allgather_into_tensor_coalesced_": lambda outs, ins, *_: [
                dist.all_gather_into_tensor(o, i, group=group) for o, i in zip(outs, ins, strict=False)],
            "c10d::_reduce_scatter_base_": lambda out, inp, *_: dist.reduce_scatter_tensor(out, inp, group=group),
            "c10d::reduce_scatter_tensor_coalesced_": lambda outs, ins, *_: [
                dist.reduce_scatter_tensor(o, i, group=group) for o, i in zip(outs, ins, strict=False)],
            "c10d::alltoall_base_": lambda out, inp, _pg, out_splits, in_splits, *_: dist.all_to_all_single(
                out, inp, list(out_splits) or None, list(in_splits) or None, group=group),
            "c10d::alltoall_": lambda outs, ins, *_: dist.all_to_all(list(outs), list(ins), group=group),
            "c10d::broadcast_": lambda tensors, _pg, root, *_: [
                dist.broadcast(t, src=int(root), group=group) for t in tensors],
            "c10d::barrier": lambda *_: dist.barrier(group=group),
        }
        if name not in table:
            raise OpUnavailable(f"collective {name} is not replayed yet (known: {', '.join(sorted(table))})")
        return table[name]

    # -- tensors -----------------------------------------------------------------------------------------
    def _find_externals(self) -> dict[int, tuple[TensorInfo, tuple[int, int] | None, bool]]:
        """Slots read before any op of the sequence writes them: (layout, int range, is offsets).

        Also collects :attr:`_constraints`: every integer input with a recorded value range, so that
        views derived from a synthesised storage (e.g. one table's slice of a batch's indices) get
        values valid for the op that reads them.
        """
        produced: set[int] = set()
        externals: dict[int, tuple[TensorInfo, tuple[int, int] | None, bool]] = {}
        self._constraints: list[tuple[TensorInfo, tuple[int, int] | None, bool, str | None]] = []
        for step in self.sequence:
            for position in step:
                op, spec = self.ops[position], self.ops_spec[position]
                for slot, info, tensor_index, arg_name in self._inputs_of(position):
                    rng = spec.tensor_range.get(str(tensor_index))
                    rng = (int(rng[0]), int(rng[1])) if isinstance(rng, list) and len(rng) == 2 else None
                    data = spec.tensor_data.get(str(tensor_index))
                    if (rng is not None or data) and not info.dtype.is_floating_point:
                        self._constraints.append((info, rng, arg_name == "offsets", data))
                    if slot not in produced and slot not in externals:
                        externals[slot] = (info, rng, arg_name == "offsets")
                produced.update(s for s in op.out_slots if s is not None)
        return externals

    def _find_births(self) -> dict[int, list[tuple[tuple[int, torch.dtype], list[int]]]]:
        """Flat position → the (storage, slots viewing it) the program made right after that op, outside
        any op (the spec's ``born``), among the externals.

        Such a storage is made in each step at that point (:meth:`_give_birth`) rather than held from
        the start. A slot qualifies only if every step that reads it makes it first; else it stays a
        buffer that lives across steps.
        """
        births: dict[int, dict[tuple[int, torch.dtype], list[int]]] = {}
        verdict: dict[int, bool] = {}  # external slot → made before its first read in every step so far
        flat = 0
        for step in self.sequence:
            pending: dict[int, int] = {}  # storage id → the flat position it was made after
            first: set[int] = set()
            for position in step:
                for slot, info, _, _ in self._inputs_of(position):
                    if slot not in self._externals or slot in first:
                        continue
                    first.add(slot)
                    made = pending.get(info.storage_id)
                    verdict[slot] = verdict.get(slot, True) and made is not None
                    if made is not None:
                        births.setdefault(made, {}).setdefault((info.storage_id, info.dtype), []).append(slot)
                for storage in self.ops_spec[position].born:
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
        self._born_slots = born
        return {k: [(key, slots) for key, slots in groups.items() if all(s in born for s in slots)]
                for k, groups in births.items()}

    def _find_uninitialised_fills(self) -> None:
        """Integer ``aten::empty*`` outputs whose first reader recorded a value range get values in it."""
        pending: dict[int, CompiledOp] = {}
        for op in self.ops:
            for slot, _info, tensor_index, _ in self._inputs_of(op.index):
                maker = pending.pop(slot, None)
                rng = self.ops_spec[op.index].tensor_range.get(str(tensor_index))
                if maker is not None and isinstance(rng, list) and len(rng) == 2:
                    maker.fills.append((slot, (int(rng[0]), int(rng[1]))))
            if re.fullmatch(r"aten::(empty|empty_strided|empty_like|new_empty|new_empty_strided)", op.name):
                for slot, info in zip(op.out_slots, op.out_infos, strict=False):
                    if slot is not None and info is not None and not info.dtype.is_floating_point \
                            and info.dtype != torch.bool:
                        pending[slot] = op

    def _find_mask_pins(self) -> None:
        """Boolean masks whose count of True decides a shape get exactly the captured count.

        ``x[mask]``, ``nonzero(mask)``, ``masked_select`` and ``x[mask] = v`` make (or read) as many rows
        as the mask holds True values; a mask computed from synthesised floats would hold another
        number, and every shape after it — and any recorded integer data it meets, such as a loss's
        targets — would disagree. The captured shapes say how many: the op that last wrote the mask
        before such a reader writes a mask with exactly that many True values (positions drawn from
        the replay's seed) after it runs (:attr:`CompiledOp.pins`); a mask the steps read but never
        made gets it when synthesised.
        """
        decided: set[tuple[int, int]] = set()
        for step in self.sequence:
            writer: dict[int, CompiledOp] = {}
            for position in step:
                op = self.ops[position]
                for slot, info, count in self._mask_counts(position):
                    if (op.step, slot) in decided or not 0 <= count <= math.prod(info.shape):
                        continue
                    decided.add((op.step, slot))
                    flat = torch.zeros(math.prod(info.shape), dtype=torch.bool)
                    flat[torch.randperm(flat.numel(), generator=self.generator)[:count]] = True
                    mask = flat.reshape(info.shape).to(self.device)
                    if slot in writer:
                        writer[slot].pins.append((slot, mask))
                    elif slot in self._externals:
                        self._external_masks[slot] = mask
                writer.update((slot, op) for slot in op.out_slots if slot is not None)

    def _find_wrapped_numbers(self) -> dict[int, list[int]]:
        """Op index → its 0-dim inputs that were Python numbers in the program (``loss * 1e-3``).

        A Python number passed where an op takes a tensor becomes a 0-dim double (or long) "wrapped
        number", which never promotes the other operand: ``float32 scalar × 1e-3`` stays float32. The
        trace shows only a 0-dim double tensor; synthesised as one, it would promote the result to
        double and every op after it would disagree. Such an input (made by no op, of a binary op whose
        captured result type only a wrapped number explains) is passed as a Python number instead
        (:meth:`materialize` puts its value in).
        """
        wrapped: dict[int, list[int]] = {}
        wrappable = (torch.float64, torch.int64, torch.complex128, torch.bool)
        for op in self.ops:
            out = op.out_infos[0] if op.out_infos else None
            infos = {slot: info for slot, info, *_ in self._inputs_of(op.index)}
            tensors = [(slot, infos[slot]) for _, sub, slot in op.arg_slots if sub < 0 and slot in infos]
            if op.error is not None or out is None or len(tensors) != 2 or len(op.arg_slots) != 2:
                continue

            def probe(info: TensorInfo) -> torch.Tensor:
                return torch.empty((1,) * min(len(info.shape), 1), dtype=info.dtype)

            (slot_a, a), (slot_b, b) = tensors
            if torch.result_type(probe(a), probe(b)) == out.dtype:
                continue
            for slot, info, other in ((slot_b, b, a), (slot_a, a, b)):
                if info.shape == () and info.dtype in wrappable and slot in self._externals \
                        and torch.result_type(probe(other), probe(info).item()) == out.dtype:
                    wrapped.setdefault(op.index, []).append(slot)
                    break
        return wrapped

    def _mask_counts(self, position: int) -> list[tuple[int, TensorInfo, int]]:
        """(slot, layout, captured count of True) of each boolean mask this op's output shape depends on."""
        spec = self.ops_spec[position]
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
            return (self._slots[info.key], info) if info.key in self._slots else None

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

    def _inputs_of(self, position: int) -> list[tuple[int, TensorInfo, int, str]]:
        """(slot, layout, tensor index, schema argument name) of every tensor an op reads.

        The tensor index counts tensor inputs in order, list elements included: the key the
        execution trace uses for recorded value ranges and data.
        """
        if position in self._inputs_cache:
            return self._inputs_cache[position]
        spec = self.ops_spec[position]
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
                    if info.key in self._slots:  # else pinned to recorded values everywhere it is read
                        found.append((self._slots[info.key], info, tensor_index, names[i] if i < len(names) else ""))
        self._inputs_cache[position] = found
        return found

    def _liveness(self) -> list[list[int]]:
        """Per position of the flattened sequence: slots to free after it runs.

        A slot is freed after its last use, or later where the program held it longer: for a storage
        the spec saw allocated (``allocated``, from the allocator's events), after the op that the
        program freed it after (``released``), or at the end of its step when the program kept it
        past the step. Other slots (and every slot of a spec without that record) are freed at last use.
        """
        flat = [p for step in self.sequence for p in step]
        carried = set(self._externals) - self._born_slots  # read before written: live across steps and cycles
        last_use: dict[int, int] = {}
        for k, position in enumerate(flat):
            for slot, *_ in self._inputs_of(position):
                last_use[slot] = k
            for slot in self.ops[position].out_slots:
                if slot is not None:
                    last_use.setdefault(slot, k)
                    last_use[slot] = max(last_use[slot], k)
        held = self._source_lifetimes(flat, carried)
        clears: list[list[int]] = [[] for _ in flat]
        for slot, k in last_use.items():
            if slot not in carried and slot not in self._born_slots:
                clears[max(k, held.get(slot, k))].append(slot)
        self._born_lifetimes(flat, clears)
        return clears

    def _born_lifetimes(self, flat: list[int], clears: list[list[int]]) -> None:
        """Add to ``clears`` the end of every lifetime of a storage made between ops (:meth:`_find_births`):
        made again in each step, it lives to its last read in that step, or later to the op the program
        freed it after, or to the step's end when the program kept it past the step."""
        start = 0
        for step in self.sequence:
            end = start + len(step) - 1
            born: dict[int, tuple[int, int]] = {}  # slot → (made after, storage)
            last: dict[int, int] = {}
            freed: dict[int, int] = {}  # storage → the first position after its making it was freed after
            for k in range(start, end + 1):
                for slot, *_ in self._inputs_of(flat[k]):
                    if slot in born:
                        last[slot] = k
                for storage in self.ops_spec[flat[k]].released:
                    if any(sid == storage for _, sid in born.values()):
                        freed.setdefault(storage, k)
                for (storage, _), slots in self._births.get(k, []):
                    born.update((slot, (k, storage)) for slot in slots)
            for slot, (made, storage) in born.items():
                clears[max(last.get(slot, made), freed.get(storage, end))].append(slot)
            start = end + 1

    def _source_lifetimes(self, flat: list[int], carried: set[int]) -> dict[int, int]:
        """Slot → the last flat position the program held its storage (see :meth:`_liveness`)."""
        held: dict[int, int] = {}
        live: dict[int, list[int]] = {}  # storage allocated in this step → the slots viewing it
        step_of = [self.ops[p].step for p in flat]
        for k, position in enumerate(flat):
            op, allocated = self.ops[position], self.ops_spec[position].allocated
            for slot, info in zip(op.out_slots, op.out_infos, strict=False):
                if slot is not None and info is not None and slot not in carried and info.storage_id in allocated:
                    live.setdefault(info.storage_id, []).append(slot)
            for storage in self.ops_spec[position].released:
                for slot in live.pop(storage, []):
                    held[slot] = max(held.get(slot, k), k)
            if k + 1 == len(flat) or step_of[k + 1] != step_of[k]:  # kept past the step: to its end
                for slots in live.values():
                    for slot in slots:
                        held[slot] = max(held.get(slot, k), k)
                live.clear()
        return held

    def materialize(self) -> None:
        """Synthesise every external tensor that lives across steps: one buffer per captured storage,
        views laid over it (those the program makes during a step are made there: :meth:`_give_birth`)."""
        static = {slot: entry for slot, entry in self._externals.items() if slot not in self._born_slots}
        self._values_of = match_values([((info.storage_id, info.dtype), info.shape, info.dtype)
                                        for info, _, _ in static.values() if info.dtype.is_floating_point],
                                       self.external_values)
        self.static_bytes = self._lay_out(static)  # what lives across steps
        for slot, mask in self._external_masks.items():
            if slot in static:
                self.vals[slot].copy_(mask)
        for index, slots in self._wrapped.items():  # Python numbers in the program: Python numbers again
            op = self.ops[index]
            for pos, sub, slot in [entry for entry in op.arg_slots if entry[2] in slots and entry[1] < 0]:
                if isinstance(self.vals[slot], torch.Tensor):
                    op.args[pos] = self.vals[slot].item()
                    op.arg_slots.remove((pos, sub, slot))
        self._initial_values, seen = [], set()  # the floating state as made, for restore_values()
        for slot, (info, _, _) in static.items():
            value = self.vals[slot]
            if info.dtype.is_floating_point and isinstance(value, torch.Tensor) and value.numel():
                storage = value.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    whole = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
                    self._initial_values.append((whole, whole.to("cpu", copy=True)))

    def restore_values(self) -> None:
        """Put the floating state carried across steps (parameters, optimiser state) back as it was made.

        A replay runs the same captured steps again and again, on the same batches: its optimiser
        drives the parameters where those batches' loss is least, its softmaxes saturate and its
        gradients sink into subnormal floats that the program, on fresh batches, never computes
        with (GPT-2: 113 op calls with subnormal inputs per step after some 300 replayed steps, 2 in
        the program) — and a CPU's kernels slow down on them. Restoring between measurements keeps
        the replay where the program was. The copy is in host memory; this costs a copy, not a step.
        """
        with torch.no_grad():
            for whole, initial in self._initial_values:
                whole.copy_(initial)

    def _give_birth(self, k: int) -> None:
        """Make the storages the program made right after flat position ``k``, with defined contents."""
        if k not in self._birth_plans:  # each step pays for the buffers, not for working out their layout
            externals = {slot: self._externals[slot] for _, slots in self._births.get(k, []) for slot in slots}
            keys = {(info.storage_id, info.dtype) for info, _, _ in externals.values()}
            constraints = [c for c in self._constraints if (c[0].storage_id, c[0].dtype) in keys]
            # floating storages without recorded constraints (on the CPU, where the generator lives): one
            # buffer each, filled whole in one call, views laid over it; else the general path
            fast = [(max(self._externals[s][0].offset + self._externals[s][0].extent for s in slots), dtype,
                     [(s, self._externals[s][0]) for s in slots]) for (_, dtype), slots in self._births.get(k, [])]
            if constraints or self.device.type != "cpu" or any(not dtype.is_floating_point for _, dtype, _ in fast):
                fast = []
            self._birth_plans[k] = (externals, constraints, fast)
        externals, constraints, fast = self._birth_plans[k]
        if not fast:
            self._lay_out(externals, constraints)
            return
        for numel, dtype, views in fast:
            whole = torch.empty(max(numel, 1), dtype=dtype, device=self.device)
            whole.uniform_(0.1, 1.0, generator=self.generator)  # see tensors.fill_view: positive, defined
            for slot, info in views:
                self.vals[slot] = whole.as_strided(info.shape, info.stride, info.offset)

    def _lay_out(self, externals: dict[int, tuple[TensorInfo, tuple[int, int] | None, bool]],
                 constraints: list[tuple[TensorInfo, tuple[int, int] | None, bool, str | None]] | None = None) -> int:
        """Buffers for these external slots, their views in :attr:`vals` with defined contents (``constraints``:
        the readers' recorded ranges and data that may apply, default all); returns the bytes allocated."""
        # Keyed by storage and dtype: the observer's storage ids come from data addresses, reused after
        # frees, so a step counter (int64) and a bias correction (float64) freed and made in turn can
        # arrive with one id; views of one storage in two dtypes are otherwise rare.
        nbytes: dict[tuple[int, torch.dtype], int] = {}
        for info, _, _ in externals.values():
            end = (info.offset + info.extent) * info.itemsize
            key = (info.storage_id, info.dtype)
            nbytes[key] = max(nbytes.get(key, 0), end)
        storages = {sid: torch.empty(max(n, 1), dtype=torch.uint8, device=self.device).untyped_storage()
                    for sid, n in nbytes.items()}
        # Wide views first: a narrower view of the same storage (e.g. one table's slice of a
        # jagged batch's offsets) carries its own reader's range, so it is written last and wins.
        ordered = sorted(externals.items(), key=lambda item: -item[1][0].extent)
        for slot, (info, rng, is_offsets) in ordered:
            view = torch.empty(0, dtype=info.dtype, device=self.device)
            view.set_(storages[(info.storage_id, info.dtype)], info.offset, info.shape, info.stride)
            fill_view(view, rng, is_offsets, self.generator, self._values_of.get((info.storage_id, info.dtype)))
            self.vals[slot] = view
        # Then what the readers recorded, on every view of a synthesised storage: ranges from the
        # widest view to the narrowest, recorded data last (it is the program's own values).
        constraints = self._constraints if constraints is None else constraints
        for info, rng, is_offsets, data in sorted(constraints, key=lambda c: (c[3] is not None, -c[0].extent)):
            if (info.storage_id, info.dtype) in storages:
                view = torch.empty(0, dtype=info.dtype, device=self.device)
                view.set_(storages[(info.storage_id, info.dtype)], info.offset, info.shape, info.stride)
                if data is None or not copy_recorded(view, data):
                    fill_view(view, rng, is_offsets, self.generator)
        return sum(max(n, 1) for n in nbytes.values())

    def nonfinite_tensors(self) -> int:
        """How many of the tensors carried across steps (parameters, optimiser state, inputs) now hold an
        infinite or NaN element: 0 in a sane replay. (A step's intermediates may hold them by design,
        e.g. a division masked afterwards, as in the program itself.)"""
        carried = (self.vals[slot] for slot in self._externals)
        return sum(1 for v in carried if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()
                   and not bool(torch.isfinite(v).all()))

    def _stand_in(self, op: CompiledOp) -> None:
        """Outputs of the captured shapes for an op that could not run, so its consumers still run."""
        for slot, info in zip(op.out_slots, op.out_infos, strict=False):
            if slot is not None and info is not None and self.vals[slot] is None:
                self.vals[slot] = stand_in(info.shape, info.stride, info.offset, info.extent, info.dtype, self.device)

    # -- running -----------------------------------------------------------------------------------------
    def exclude(self, reasons: dict[int, str]) -> None:
        """Never run these ops (e.g. they crashed a probe process); they count as failed, with the reason."""
        for index, reason in reasons.items():
            self.ops[index].error = reason
        self._steps = [None] * len(self.sequence)

    def dry_run(self, before_op: Callable[[int], object] | None = None, steps: list[int] | None = None) -> ReplayStats:
        """Run every step (or ``steps``) once op by op; ops that fail are recorded and stood in for from then on.

        ``before_op(index)`` is called before each op runs (the crash probe writes it down).
        Failures accumulate in :attr:`errors`.
        """
        stats = ReplayStats()
        for op in self.ops:
            if op.error is not None:
                stats.errors[op.index] = op.error
        integer_stand_ins: dict[int, int] = {}  # slot → the failed op whose output it stands in for
        with torch.no_grad():
            for k in range(len(self.sequence)) if steps is None else steps:
                offset = sum(len(s) for s in self.sequence[:k])
                for j, position in enumerate(self.sequence[k]):
                    op = self.ops[position]
                    if op.error is None:
                        # Index-like inputs invented for a failed op could send an unchecked kernel out
                        # of bounds: ops reading them are skipped too, with the reason.
                        culprit = next((integer_stand_ins[s] for s, *_ in self._inputs_of(position)
                                        if s in integer_stand_ins), None)
                        if culprit is not None:
                            op.error = f"skipped: reads an integer output of failed op #{culprit}"
                            stats.errors[op.index] = op.error
                    if op.error is None:
                        if before_op is not None:
                            before_op(op.index)
                        try:
                            self._call_or_unalias(position)
                            self._check_shapes(op)
                        except Exception as err:  # noqa: BLE001 - recorded per op; replay goes on
                            op.error = describe(err)
                            stats.errors[op.index] = op.error
                    if op.error is not None:
                        self._stand_in(op)
                        integer_stand_ins.update(
                            (slot, op.index) for slot, info in zip(op.out_slots, op.out_infos, strict=False)
                            if slot is not None and info is not None and not info.dtype.is_floating_point)
                    self._give_birth(offset + j)
        if steps is None:
            self._next = 0
        self._steps = [None] * len(self.sequence)  # regenerate: ops that failed are stood in for now
        self.errors.update(stats.errors)
        return stats

    def _check_shapes(self, op: CompiledOp) -> None:
        """Record in :attr:`divergent` an op whose result's shape differs from the captured one (its inputs'
        values decided it differently): it ran, but not as the program's did. The first output only: a
        fused kernel's bookkeeping outputs (``_embedding_bag``'s offset2bag, a batch norm's saved
        statistics) take shapes its code path chooses, which its backward reads either way. A 1-D integer
        output of another length (an NMS keep list: how many boxes survive depends on the scores) is cut
        or cycled to the captured length from then on (:attr:`CompiledOp.lengths`), like a mask's count."""
        slot, info = (op.out_slots[0], op.out_infos[0]) if op.out_slots else (None, None)
        value = self.vals[slot] if slot is not None else None
        if (info is not None and isinstance(value, torch.Tensor) and value.dim() == 1 and len(info.shape) == 1
                and not value.is_floating_point() and value.dtype != torch.bool and value.shape[0] != info.shape[0]
                and not op.lengths):
            # a keep list (NMS) whose length the values decided: the captured length, from its own elements
            op.lengths.append((slot, info.shape[0]))
            self.vals[slot] = fit_length(value, info.shape[0])
            return
        if info is not None and isinstance(value, torch.Tensor) and tuple(value.shape) != info.shape:
            self.divergent.setdefault(op.index, f"made shape {list(value.shape)} where the program made "
                                                f"{list(info.shape)}")

    def _call_or_unalias(self, position: int) -> None:
        """Run an op; if it refuses inputs that overlap in memory, give its synthesised inputs storage of
        their own and try once more. The observer's storage ids come from data addresses, which are
        reused after frees, so two tensors the program never aliased can arrive with one storage id."""
        op = self.ops[position]
        try:
            op.store(op.call(self.vals), self.vals, self.generator)
        except RuntimeError as err:
            shared = [slot for slot, *_ in self._inputs_of(position) if slot in self._externals]
            if "single memory location" not in str(err) and "overlap" not in str(err) or not shared:
                raise
            for slot in shared:
                self.vals[slot] = self.vals[slot].clone()
            op.store(op.call(self.vals), self.vals, self.generator)

    def run_step(self) -> int:
        """Replay the next captured step (cycling); returns how many ops ran."""
        k = self._next
        self._next = (k + 1) % len(self.sequence)
        if self._steps[k] is None:
            self._steps[k] = self._codegen(k)
        step, ran = self._steps[k]
        try:
            with torch.no_grad():
                step(self.vals)
        except Exception:  # noqa: BLE001 - an op failed only now (its inputs differ from the dry run's)
            self.dry_run(steps=[k])  # find it op by op: recorded, stood in for, the code regenerated
        return ran

    def _codegen(self, k: int, *, no_gap_time: bool = False) -> tuple[Callable[[list[Any]], None], int]:
        """Step ``k`` as one generated function (:func:`codegen.generate_step`); ``no_gap_time``: the
        same code with every host gap zero (what :meth:`calibrate_host_cost` measures)."""
        positions = self.sequence[k]
        offset = sum(len(s) for s in self.sequence[:k])
        gaps = None
        if self.host_gaps:
            gaps = [0.0 if no_gap_time else seconds(self.ops_spec[p].gap_us) for p in positions]
        tail = seconds(self._tail_gaps_us[k]) if self.host_gaps and not no_gap_time else 0.0
        births = [offset + j if offset + j in self._births else None for j in range(len(positions))]
        return generate_step(self.ops, positions, self._clears[offset:offset + len(positions)], gaps, tail,
                             call_s=0.0 if no_gap_time else self.call_s, births=births,
                             stand_in=lambda i: self._stand_in(self.ops[i]),
                             fill=lambda i: self.ops[i].store_fills(self.vals, self.generator),
                             born=self._give_birth, name=f"step {k}")

    def calibrate_host_cost(self, synchronize: Callable[[], None], rounds: int = 12) -> float:
        """Measure the replay's own host time per op call (seconds; kept in :attr:`call_s`).

        The program's host gaps were measured from its Kineto trace as the time outside its ops, the
        profiler's cost taken out (:func:`.host_time.kineto_host_gaps`); the replay's own time outside its
        ops (the generated code: argument lists, the op binding, slot stores and releases) is measured
        here the same way on its own steps with every gap zero, so the gaps it spends are exactly the
        program's host time it does not already pay. (A fixed per-call figure from a one-argument op
        came out at a third of a real op line's cost and left the replay ~10 % slow.)

        As the capture does: ``rounds`` rounds of profiled steps then plain ones, each block after a
        pass that settles it (the profiler's buffers; the caches after it stops), each profiled step
        set against the plain steps of its own round; the median over every step of every round. (All
        profiled steps after all plain ones, the figure moved 3.7 … 8.3 µs per op between calibrations of
        one replay, a quarter of a BERT step's host time.)
        """
        if not self.host_gaps:
            return 0.0
        steps = len(self.sequence)
        generated = [self._codegen(k, no_gap_time=True) for k in range(steps)]

        def run(k: int) -> None:
            with torch.no_grad():
                generated[k][0](self.vals)

        per_op: list[float] = []
        with tempfile.TemporaryDirectory(prefix="cobench-calibrate-") as tmp:
            path = Path(tmp) / "trace.json"
            for _ in range(rounds):
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    for k in range(steps):  # settles the profiler
                        run(k)
                    synchronize()
                    for k in range(steps):
                        with torch.profiler.record_function(f"{STEP_ANNOTATION}{k}"):
                            run(k)
                        synchronize()
                for k in range(steps):  # settles plain running again
                    run(k)
                plain_us: dict[int | None, float] = {}
                for k in range(steps):
                    synchronize()
                    started = time.perf_counter()
                    run(k)
                    synchronize()
                    plain_us[k] = 1e6 * (time.perf_counter() - started)
                prof.export_chrome_trace(str(path))
                host_us = kineto_host_gaps(read_kineto(path), plain_us)
                per_op += [host_us[k] / max(1, len(self.sequence[k])) for k in host_us]
        self.call_samples_s = [1e-6 * v for v in per_op]  # what the figure rests on: a judgement resamples it
        self.call_s = statistics.median(self.call_samples_s) if per_op else 0.0
        self._steps = [None] * len(self.sequence)  # regenerate with the measured cost
        return self.call_s

    def time_ops(self, synchronize: Callable[[], None]) -> dict[int, list[float]]:
        """One pass over every step with each op timed alone (synchronised): op index → seconds."""
        times: dict[int, list[float]] = {}
        vals = self.vals
        with torch.no_grad():
            for k, step in enumerate(self.sequence):
                offset = sum(len(s) for s in self.sequence[:k])
                for j, position in enumerate(step):
                    op = self.ops[position]
                    if op.error is None:
                        synchronize()
                        started = time.perf_counter()
                        try:
                            op.store(op.call(vals), vals, self.generator)
                            synchronize()
                            times.setdefault(op.index, []).append(time.perf_counter() - started)
                        except Exception as err:  # noqa: BLE001 - recorded like a dry-run failure
                            op.error = self.errors[op.index] = describe(err)
                            self._stand_in(op)
                    else:
                        self._stand_in(op)
                    self._give_birth(offset + j)
                    for slot in self._clears[offset + j]:
                        vals[slot] = None
        self._next = 0
        return times
