"""Replay a spec's operators on any device, with synthetic tensors of the captured layout.

How each op runs: its schema (from the trace) names the dispatcher op — ``torch.ops.<ns>.<op>.
<overload>`` — and the parsed schema says which arguments are keyword-only and which integers are
really dtypes, layouts or memory formats. Collectives (``c10d::``) run through
``torch.distributed`` on the replay's process group (rank i replays captured rank i).

Tensors: an op's outputs feed later ops (dataflow is real, so views share storage and in-place ops
mutate what later ops read). Tensors the captured steps read but never produced (parameters,
optimiser state, inputs made outside the step) are synthesised once, before timing: one buffer per
captured storage, sized from the true extent of every view of it (offset + Σ (size−1)·stride + 1
elements, in bytes), each view laid over it with its captured offset and strides. Integer inputs
the capture recorded are fed the program's own values (constants: data-dependent indices and shapes
replay as captured); others get values inside the range the trace recorded, ``offsets`` arguments
sorted. Tensors are released after their last use, as the original program would. Each step runs as
generated straight-line code (one direct C++ op call per op), with the program's host time spent
in the gaps between ops when asked to.

An op that cannot run here is recorded with its error and replaced by stand-in outputs of the
captured shapes, so everything after it still runs; coverage says what was lost.
"""

from __future__ import annotations

import base64
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from workloads.generated.safety import op_refusal
from workloads.generated.spec import _is_tensor_ref

# c10::ScalarType codes, as the execution trace writes dtype arguments.
SCALAR_TYPES = {
    0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64, 5: torch.float16,
    6: torch.float32, 7: torch.float64, 8: torch.complex32, 9: torch.complex64, 10: torch.complex128,
    11: torch.bool, 15: torch.bfloat16, 23: torch.float8_e5m2, 24: torch.float8_e4m3fn,
    25: torch.float8_e5m2fnuz, 26: torch.float8_e4m3fnuz, 27: torch.uint16, 28: torch.uint32, 29: torch.uint64,
}
LAYOUTS = {0: torch.strided, 1: torch.sparse_coo, 2: torch.sparse_csr, 3: torch.sparse_csc}
MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.preserve_format, 2: torch.channels_last,
                  3: torch.channels_last_3d}
# The C++ type names the execution trace writes inside "Tensor(...)".
ET_DTYPES = {
    "float": torch.float32, "double": torch.float64, "c10::Half": torch.float16, "c10::BFloat16": torch.bfloat16,
    "long int": torch.int64, "long": torch.int64, "int": torch.int32, "short int": torch.int16,
    "short": torch.int16, "signed char": torch.int8, "unsigned char": torch.uint8, "bool": torch.bool,
    "c10::complex<float>": torch.complex64, "c10::complex<double>": torch.complex128,
    "c10::Float8_e4m3fn": torch.float8_e4m3fn, "c10::Float8_e5m2": torch.float8_e5m2,
    "unsigned short": torch.uint16, "unsigned int": torch.uint32, "unsigned long": torch.uint64,
}
_LIBRARIES = {"fbgemm": ("fbgemm_gpu",), "torchrec": ("torchrec",)}


class OpUnavailable(RuntimeError):
    """This torch build has no such operator (or it cannot be called here)."""


class OpRefused(RuntimeError):
    """The replay policy (:mod:`workloads.generated.safety`) refuses this op and the spec is not trusted."""


def tensor_dtype(et_type: str) -> torch.dtype:
    match = re.fullmatch(r"Tensor\((.*)\)", et_type)
    if not match or match.group(1) not in ET_DTYPES:
        raise OpUnavailable(f"unknown tensor type {et_type!r} in the trace")
    return ET_DTYPES[match.group(1)]


def resolve_op(schema: str) -> Callable[..., Any]:
    """``aten::add.Tensor(...)`` → ``torch.ops.aten.add.Tensor``; loads fbgemm/torchrec on demand."""
    qualified = schema.split("(", 1)[0]
    if "::" not in qualified:
        raise OpUnavailable(f"schema {schema[:80]!r} has no namespace")
    namespace, rest = qualified.split("::", 1)
    name, _, overload = rest.partition(".")
    for module in _LIBRARIES.get(namespace, ()):
        try:
            __import__(module)
        except Exception as err:  # noqa: BLE001 - any import failure means the op is unavailable
            raise OpUnavailable(f"{namespace}:: ops need {module}, which failed to import: {err}") from None
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        return getattr(packet, overload or "default")
    except (AttributeError, RuntimeError) as err:
        raise OpUnavailable(f"torch {torch.__version__} has no operator {qualified}: {err}") from None


@dataclass
class TensorInfo:
    """A captured tensor value: identity, storage placement and layout."""

    tensor_id: int
    storage_id: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    itemsize: int

    @property
    def key(self) -> tuple:
        """Slot identity: a captured tensor id with its layout (ids are reused after frees)."""
        return (self.tensor_id, self.shape, self.stride, self.dtype)

    @property
    def extent(self) -> int:
        """Elements of storage this view spans from its offset (0 when it is empty)."""
        if any(s == 0 for s in self.shape):
            return 0
        return 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride, strict=False))


def _tensor_info(ref: list, shape: Any, stride: Any, et_type: str) -> TensorInfo:
    shape = tuple(int(s) for s in shape) if isinstance(shape, list) else ()
    stride = tuple(int(s) for s in stride) if isinstance(stride, list) and len(stride) == len(shape) else ()
    if not stride:  # contiguous strides when the trace has none
        acc, rev = 1, []
        for s in reversed(shape):
            rev.append(acc)
            acc *= max(s, 1)
        stride = tuple(reversed(rev))
    return TensorInfo(int(ref[0]), int(ref[1]), int(ref[2]), shape, stride, tensor_dtype(et_type), int(ref[4]))


def _list_types(et_type: str) -> list[str]:
    inner = et_type[len("GenericList["):-1]
    return re.findall(r"Tensor\([^)]*\)|[^,]+", inner) if inner else []


@dataclass
class CompiledOp:
    """One op ready to run: a call template plus the slots its tensors come from and go to."""

    index: int
    name: str
    category: str
    step: int
    fn: Callable[..., Any] | None
    args: list[Any]
    kwargs: dict[str, Any]
    arg_slots: list[tuple[int, int, int]]  # (position, list index or −1, slot)
    kwarg_slots: list[tuple[str, int, int]]
    out_slots: list[int | None]  # flattened outputs → slots
    out_infos: list[TensorInfo | None]
    dur_us: float | None
    error: str | None = None
    single_output: bool = False  # returns exactly one Tensor (not a tuple or list)
    # Integer outputs an uninitialised-memory op (aten::empty…) makes, filled later by a copy the
    # trace does not show (e.g. torch.tensor(list)): slot → the value range its consumer recorded.
    fills: list[tuple[int, tuple[int, int]]] = field(default_factory=list)

    def call(self, vals: list[Any]) -> Any:
        args = [list(a) if isinstance(a, list) else a for a in self.args]
        for pos, sub, slot in self.arg_slots:
            if sub < 0:
                args[pos] = vals[slot]
            else:
                args[pos][sub] = vals[slot]
        kwargs = self.kwargs
        if self.kwarg_slots:
            kwargs = {k: list(v) if isinstance(v, list) else v for k, v in kwargs.items()}
            for key, sub, slot in self.kwarg_slots:
                if sub < 0:
                    kwargs[key] = vals[slot]
                else:
                    kwargs[key][sub] = vals[slot]
        return self.fn(*args, **kwargs)

    def store(self, result: Any, vals: list[Any], generator: torch.Generator) -> None:
        if not self.out_slots:
            return
        flat = _flatten_tensors(result)
        for slot, value in zip(self.out_slots, flat, strict=False):
            if slot is not None:
                vals[slot] = value
        self.store_fills(vals, generator)

    def store_fills(self, vals: list[Any], generator: torch.Generator) -> None:
        for slot, (low, high) in self.fills:
            target = vals[slot]
            target.copy_(torch.randint(low, high + 1, target.shape, generator=generator))


def _flatten_tensors(result: Any) -> list[Any]:
    if isinstance(result, (tuple, list)):
        out = []
        for item in result:
            out.extend(_flatten_tensors(item) if isinstance(item, (tuple, list)) else [item])
        return out
    return [result]


@dataclass
class ReplayStats:
    """What the dry run found: ops that could not run, by index, with their errors."""

    errors: dict[int, str] = field(default_factory=dict)


class Replayer:
    """Replays one rank's ops; :meth:`run_step` replays the next captured step."""

    def __init__(self, rank_spec: dict[str, Any], device: torch.device, *, repeat: int = 1,
                 process_group: Any = None, seed: int = 0, host_gaps: bool = False, trust: bool = False):
        self.device, self.repeat, self.group = device, repeat, process_group
        self.trust = trust  # run ops the safety policy refuses (the user vouched for this spec)
        self.host_gaps = host_gaps
        self.generator = torch.Generator().manual_seed(seed)
        self.ops_spec = rank_spec["ops"]
        self.step_indices = sorted({op["step"] for op in self.ops_spec})
        tails = {s["index"]: s.get("tail_gap_us", 0.0) for s in rank_spec.get("steps", [])}
        self._tail_gaps_us = [tails.get(step, 0.0) for step in self.step_indices]
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
        self._find_uninitialised_fills()
        self._clears = self._liveness()
        self._next = 0
        self._steps: list[tuple[Callable[[list[Any]], None], int] | None] = [None] * len(self.sequence)
        self.errors: dict[int, str] = {}  # op index → why it did not run (compile, dry run or later)
        self._call_cost_s: float | None = None
        self.static_bytes = 0  # synthesised tensors (parameters, optimiser state, inputs): set by materialize()

    # -- compilation -------------------------------------------------------------------------------------
    def _slot(self, info: TensorInfo) -> int:
        return self._slots.setdefault(info.key, len(self._slots))

    def _compile(self, index: int, op: dict[str, Any]) -> CompiledOp:
        compiled = CompiledOp(index, op["name"], op["category"], op["step"], None, [], {}, [], [], [], [],
                              op.get("dur_us"))
        refusal = None if self.trust else op_refusal(op["name"], op["schema"])
        if refusal is not None:  # check_spec refuses such a spec first: this is the last line of defence
            raise OpRefused(f"op #{index} {op['schema'].split('(', 1)[0]}: {refusal}")
        try:
            self._compile_outputs(op, compiled)
            if op["name"].startswith("c10d::"):
                compiled.fn = self._collective(op["name"])
                self._compile_args(op, compiled, schema_args=None)
                compiled.out_slots = []  # collectives write into their (input) buffers in place
            elif op["name"].startswith("_c10d_functional::") and op["name"] != "_c10d_functional::wait_tensor":
                fn = resolve_op(op["schema"])
                wait = torch.ops._c10d_functional.wait_tensor.default
                # The program waited later, inside another op the trace shows only as a whole.
                compiled.fn = lambda *args, _fn=fn, **kwargs: _waited(_fn(*args, **kwargs), wait)
                self._compile_args(op, compiled, torch._C.parse_schema(op["schema"]).arguments)
            else:
                compiled.fn = resolve_op(op["schema"])
                self._compile_args(op, compiled, torch._C.parse_schema(op["schema"]).arguments)
        except Exception as err:  # noqa: BLE001 - an op this build cannot express is recorded, not fatal
            compiled.error = f"{type(err).__name__}: {err}"
            compiled.fn = None
        return compiled

    def _compile_outputs(self, op: dict[str, Any], compiled: CompiledOp) -> None:
        outputs = op["outputs"]
        types = outputs.get("types", [])
        compiled.single_output = len(types) == 1 and types[0].startswith("Tensor(")
        for value, shape, stride, et_type in zip(outputs.get("values", []), outputs.get("shapes", []),
                                                 outputs.get("strides", []), outputs.get("types", []), strict=False):
            if _is_tensor_ref(value) and et_type.startswith("Tensor("):
                info = self._info_or_none(value, shape, stride, et_type)
                compiled.out_slots.append(self._slot(info) if info else None)
                compiled.out_infos.append(info)
            elif isinstance(value, list) and et_type.startswith("GenericList["):
                types = _list_types(et_type)
                for j, item in enumerate(value):
                    info = None
                    if _is_tensor_ref(item) and j < len(types):
                        info = self._info_or_none(item, _at(shape, j), _at(stride, j), types[j])
                    compiled.out_slots.append(self._slot(info) if info else None)
                    compiled.out_infos.append(info)
            else:
                compiled.out_slots.append(None)
                compiled.out_infos.append(None)

    @staticmethod
    def _info_or_none(ref: list, shape: Any, stride: Any, et_type: str) -> TensorInfo | None:
        try:
            return _tensor_info(ref, shape, stride, et_type)
        except OpUnavailable:
            return None

    def _compile_args(self, op: dict[str, Any], compiled: CompiledOp, schema_args: list | None) -> None:
        inputs = op["inputs"]
        values, types = inputs.get("values", []), inputs.get("types", [])
        shapes, strides = inputs.get("shapes", []), inputs.get("strides", [])
        if schema_args is not None and len(values) != len(schema_args):
            raise OpUnavailable(f"the trace passes {len(values)} inputs, the schema takes {len(schema_args)}")
        tensor_index = [-1]  # counts tensor inputs as the trace does (list elements included)
        data = op.get("tensor_data") or {}
        for i, (value, et_type) in enumerate(zip(values, types, strict=False)):
            arg = schema_args[i] if schema_args is not None else None
            arg_type = str(arg.type) if arg is not None else ""
            converted, slots = self._convert(value, et_type, _at(shapes, i), _at(strides, i), arg_type,
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
            if not _is_tensor_ref(value) or "nullptr" in et_type:
                return None, []
            info = _tensor_info(value, shape, stride, et_type)
            pinned = self._pinned(info, data.get(str(tensor_index[0])))
            return (pinned, []) if pinned is not None else (None, [(-1, self._slot(info))])
        if et_type.startswith("GenericList["):
            types = _list_types(et_type)
            if any(t.startswith("Tensor(") for t in types):
                slots, template = [], []
                for j, item in enumerate(value):
                    template.append(None)
                    if not types[j].startswith("Tensor(") if j < len(types) else True:
                        continue
                    tensor_index[0] += 1
                    if _is_tensor_ref(item):
                        info = _tensor_info(item, _at(shape, j), _at(stride, j), types[j])
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
                    rng = spec.get("tensor_range", {}).get(str(tensor_index))
                    rng = (int(rng[0]), int(rng[1])) if isinstance(rng, list) and len(rng) == 2 else None
                    data = spec.get("tensor_data", {}).get(str(tensor_index))
                    if (rng is not None or data) and not info.dtype.is_floating_point:
                        self._constraints.append((info, rng, arg_name == "offsets", data))
                    if slot not in produced and slot not in externals:
                        externals[slot] = (info, rng, arg_name == "offsets")
                produced.update(s for s in op.out_slots if s is not None)
        return externals

    def _find_uninitialised_fills(self) -> None:
        """Integer ``aten::empty*`` outputs whose first reader recorded a value range get values in it."""
        pending: dict[int, CompiledOp] = {}
        for op in self.ops:
            for slot, _info, tensor_index, _ in self._inputs_of(op.index):
                maker = pending.pop(slot, None)
                rng = self.ops_spec[op.index].get("tensor_range", {}).get(str(tensor_index))
                if maker is not None and isinstance(rng, list) and len(rng) == 2:
                    maker.fills.append((slot, (int(rng[0]), int(rng[1]))))
            if re.fullmatch(r"aten::(empty|empty_strided|empty_like|new_empty|new_empty_strided)", op.name):
                for slot, info in zip(op.out_slots, op.out_infos, strict=False):
                    if slot is not None and info is not None and not info.dtype.is_floating_point \
                            and info.dtype != torch.bool:
                        pending[slot] = op

    def _inputs_of(self, position: int) -> list[tuple[int, TensorInfo, int, str]]:
        """(slot, layout, tensor index, schema argument name) of every tensor an op reads.

        The tensor index counts tensor inputs in order, list elements included: the key the
        execution trace uses for recorded value ranges and data.
        """
        if position in self._inputs_cache:
            return self._inputs_cache[position]
        spec = self.ops_spec[position]
        inputs = spec["inputs"]
        names: list[str] = []
        if not spec["name"].startswith("c10d::"):
            try:
                names = [a.name for a in torch._C.parse_schema(spec["schema"]).arguments]
            except RuntimeError:
                names = []
        found = []
        tensor_index = -1
        for i, (value, et_type) in enumerate(zip(inputs.get("values", []), inputs.get("types", []), strict=False)):
            shape, stride = _at(inputs.get("shapes", []), i), _at(inputs.get("strides", []), i)
            items = [(value, shape, stride, et_type)]
            if et_type.startswith("GenericList[") and isinstance(value, list):
                types = _list_types(et_type)
                items = [(v, _at(shape, j), _at(stride, j), types[j] if j < len(types) else "")
                         for j, v in enumerate(value)]
            for v, sh, st, t in items:
                if not t.startswith("Tensor("):
                    continue
                tensor_index += 1
                if _is_tensor_ref(v) and "nullptr" not in t:
                    try:
                        info = _tensor_info(v, sh, st, t)
                    except OpUnavailable:
                        continue
                    if info.key in self._slots:  # else pinned to recorded values everywhere it is read
                        found.append((self._slots[info.key], info, tensor_index, names[i] if i < len(names) else ""))
        self._inputs_cache[position] = found
        return found

    def _liveness(self) -> list[list[int]]:
        """Per position of the flattened sequence: slots no later op reads (freed after it runs)."""
        flat = [p for step in self.sequence for p in step]
        carried = set(self._externals)  # read before written: live across steps and cycles
        last_use: dict[int, int] = {}
        for k, position in enumerate(flat):
            for slot, *_ in self._inputs_of(position):
                last_use[slot] = k
            for slot in self.ops[position].out_slots:
                if slot is not None:
                    last_use.setdefault(slot, k)
                    last_use[slot] = max(last_use[slot], k)
        clears: list[list[int]] = [[] for _ in flat]
        for slot, k in last_use.items():
            if slot not in carried:
                clears[k].append(slot)
        return clears

    def materialize(self) -> None:
        """Synthesise every external tensor: one buffer per captured storage, views laid over it."""
        nbytes: dict[int, int] = {}
        for info, _, _ in self._externals.values():
            end = (info.offset + info.extent) * info.itemsize
            nbytes[info.storage_id] = max(nbytes.get(info.storage_id, 0), end)
        storages = {sid: torch.empty(max(n, 1), dtype=torch.uint8, device=self.device).untyped_storage()
                    for sid, n in nbytes.items()}
        self.static_bytes = sum(max(n, 1) for n in nbytes.values())  # what lives across steps
        # Wide views first: a narrower view of the same storage (e.g. one table's slice of a
        # jagged batch's offsets) carries its own reader's range, so it is written last and wins.
        ordered = sorted(self._externals.items(), key=lambda item: -item[1][0].extent)
        for slot, (info, rng, is_offsets) in ordered:
            view = torch.empty(0, dtype=info.dtype, device=self.device)
            view.set_(storages[info.storage_id], info.offset, info.shape, info.stride)
            self._fill(view, rng, is_offsets)
            self.vals[slot] = view
        # Then what the readers recorded, on every view of a synthesised storage: ranges from the
        # widest view to the narrowest, recorded data last (it is the program's own values).
        for info, rng, is_offsets, data in sorted(self._constraints, key=lambda c: (c[3] is not None, -c[0].extent)):
            if info.storage_id in storages:
                view = torch.empty(0, dtype=info.dtype, device=self.device)
                view.set_(storages[info.storage_id], info.offset, info.shape, info.stride)
                if data is None or not self._copy_data(view, data):
                    self._fill(view, rng, is_offsets)

    @staticmethod
    def _copy_data(view: torch.Tensor, data: str) -> bool:
        """Write recorded raw integer data into ``view``; False when it does not fit the view."""
        values = recorded_view(data, view.dtype, tuple(view.shape), tuple(view.stride()))
        if values is None:
            return False
        target, values = _distinct(view), values[_broadcast_index(view)]
        if torch._debug_has_internal_overlap(target) != 0:
            return False
        with torch.no_grad():
            target.copy_(values)
        return True

    def _fill(self, view: torch.Tensor, rng: tuple[int, int] | None, is_offsets: bool) -> None:
        """Defined values for a synthesised view: in the reader's range for integers, sane floats.

        A view whose elements share memory (an ``expand``: stride 0; overlapping windows) is written
        through the memory it spans, each location once, so every element it shows is defined.
        """
        if view.numel() == 0:
            return
        target = _distinct(view)
        if torch._debug_has_internal_overlap(target) != 0:
            extent = 1 + sum((s - 1) * st for s, st in zip(target.shape, target.stride(), strict=True))
            target = torch.empty(0, dtype=view.dtype, device=view.device).set_(
                view.untyped_storage(), view.storage_offset(), (extent,), (1,))
        if target.dtype == torch.bool:
            values = torch.rand(target.shape, generator=self.generator) < 0.5
        elif target.dtype.is_floating_point or target.dtype.is_complex:
            values = torch.empty(target.shape, dtype=torch.float32).uniform_(0.1, 1.0, generator=self.generator)
        else:
            low, high = rng if rng is not None else (0, 0)
            values = torch.randint(int(low), int(high) + 1, target.shape, generator=self.generator)
            if is_offsets and target.dim() == 1:
                values = values.sort().values
                values[0] = int(low)
        with torch.no_grad():
            target.copy_(values.to(target.dtype))

    def _stand_in(self, op: CompiledOp) -> None:
        """Outputs of the captured shapes for an op that could not run, so its consumers still run."""
        for slot, info in zip(op.out_slots, op.out_infos, strict=False):
            if slot is not None and info is not None and self.vals[slot] is None:
                size = max(info.offset + info.extent, 1)
                base = torch.zeros(size, dtype=info.dtype, device=self.device)
                self.vals[slot] = base.as_strided(info.shape, info.stride, info.offset)

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
                for position in self.sequence[k]:
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
                        except Exception as err:  # noqa: BLE001 - recorded per op; replay goes on
                            op.error = _describe(err)
                            stats.errors[op.index] = op.error
                    if op.error is not None:
                        self._stand_in(op)
                        integer_stand_ins.update(
                            (slot, op.index) for slot, info in zip(op.out_slots, op.out_infos, strict=False)
                            if slot is not None and info is not None and not info.dtype.is_floating_point)
        if steps is None:
            self._next = 0
        self._steps = [None] * len(self.sequence)  # regenerate: ops that failed are stood in for now
        self.errors.update(stats.errors)
        return stats

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

    def _codegen(self, k: int) -> tuple[Callable[[list[Any]], None], int]:
        """Step ``k`` as one generated Python function: each op one direct call on the value list.

        Interpreting templates op by op costs the replayer ~3.6 µs per op, comparable to a small
        op itself; generated straight-line code costs about one Python call, close to what the
        original program's own dispatch cost.
        """
        consts: list[Any] = []
        fns: list[Callable[..., Any]] = []

        def const(value: Any) -> str:
            # Only exact JSON scalars become literals (their repr is always a literal of the same
            # value); everything else is passed by reference. No spec text reaches the code otherwise.
            if value is None or type(value) in (bool, int, str) or (type(value) is float and math.isfinite(value)):
                return repr(value)
            consts.append(value)
            return f"c[{len(consts) - 1}]"

        def expr(template: Any, slots: dict[int, int]) -> str:
            if isinstance(template, list):
                return "[" + ", ".join(f"v[{slots[j]}]" if j in slots else const(item)
                                       for j, item in enumerate(template)) + "]"
            return f"v[{slots[-1]}]" if -1 in slots else const(template)

        lines = ["def step(v):", "    t = pc()"]
        offset = sum(len(s) for s in self.sequence[:k])
        ran = 0
        owed_s = 0.0  # the program's host time not yet spent: gaps too short to spin on add up
        # The program's gap before an op includes its own cost of calling the op (Python binding,
        # argument parsing); the replay pays its own call cost instead, so that much of each gap is
        # already spent. A negative balance (the replay's calls cost more) carries to later gaps.
        call_s = self.call_cost_s() if self.host_gaps else 0.0
        for j, position in enumerate(self.sequence[k]):
            op = self.ops[position]
            if self.host_gaps:
                owed_s += _seconds(self.ops_spec[position].get("gap_us")) - call_s
            if owed_s > 2e-7:  # the program's own host time before this op, spent as the program did: busy
                lines.append(f"    while pc() < t + {owed_s!r}: pass")
                owed_s = 0.0
            if op.error is not None:
                lines.append(f"    standin({position})")
            else:
                ran += 1
                by_arg: dict[Any, dict[int, int]] = {}
                for pos, sub, slot in op.arg_slots:
                    by_arg.setdefault(pos, {})[sub] = slot
                for key, sub, slot in op.kwarg_slots:
                    by_arg.setdefault(key, {})[sub] = slot
                parts = [expr(a, by_arg.get(i, {})) for i, a in enumerate(op.args)]
                parts += [f"{key}={expr(value, by_arg.get(key, {}))}" for key, value in op.kwargs.items()]
                fns.append(getattr(op.fn, "_op", op.fn))  # the C++ op itself, not its Python wrapper
                call = f"f[{len(fns) - 1}]({', '.join(parts)})"
                targets = [(n, slot) for n, slot in enumerate(op.out_slots) if slot is not None]
                if op.single_output and targets:
                    lines.append(f"    v[{targets[0][1]}] = {call}")
                elif targets:
                    lines.append(f"    r = flat({call})")
                    lines.extend(f"    v[{slot}] = r[{n}]" for n, slot in targets)
                else:
                    lines.append(f"    {call}")
                if op.fills:
                    lines.append(f"    fill({position})")
            lines.extend(f"    v[{slot}] = None" for slot in self._clears[offset + j])
            if self.host_gaps:
                lines.append("    t = pc()")
        tail_s = owed_s + (_seconds(self._tail_gaps_us[k]) if self.host_gaps else 0.0)
        if tail_s > 2e-7:
            lines.append(f"    while pc() < t + {tail_s!r}: pass")
        namespace: dict[str, Any] = {
            "f": fns, "c": consts, "flat": _flatten_tensors, "pc": time.perf_counter,
            "standin": lambda i: self._stand_in(self.ops[i]),
            "fill": lambda i: self.ops[i].store_fills(self.vals, self.generator),
        }
        exec(compile("\n".join([*lines, "    return None"]), f"<cobench replay step {k}>", "exec"), namespace)
        return namespace["step"], ran

    def call_cost_s(self) -> float:
        """What one op call costs the generated code before any kernel work, on this machine (seconds).

        Measured once: the median over batches of calls of ``aten::alias`` (no kernel work: a view)
        made exactly as the generated code makes them.
        """
        if self._call_cost_s is None:
            alias, x = torch.ops.aten.alias.default._op, torch.empty(4)
            batches = []
            for _ in range(7):
                started = time.perf_counter()
                for _ in range(500):
                    alias(x)
                batches.append((time.perf_counter() - started) / 500)
            self._call_cost_s = sorted(batches)[len(batches) // 2]
        return self._call_cost_s

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
                        except Exception as err:  # noqa: BLE001 - recorded like a dry-run failure
                            op.error = self.errors[op.index] = _describe(err)
                            self._stand_in(op)
                            continue
                        synchronize()
                        times.setdefault(op.index, []).append(time.perf_counter() - started)
                    else:
                        self._stand_in(op)
                    for slot in self._clears[offset + j]:
                        vals[slot] = None
        self._next = 0
        return times


def recorded_view(data: str, dtype: torch.dtype, shape: tuple[int, ...],
                  stride: tuple[int, ...]) -> torch.Tensor | None:
    """A recorded input's values laid out as the view the op read, or None if the record is incomplete.

    The execution-trace observer dumps ``numel × itemsize`` raw bytes from the view's first element,
    in memory order — not the view's values in logical order. For a contiguous view the two agree;
    for an expanded (stride 0), transposed or otherwise strided view, the elements it shows lie in
    the first ``extent`` elements of that memory (the rest of the dump is whatever memory followed),
    so the view is rebuilt over them with its own strides. A view that spans more memory than was
    dumped (``extent > numel``: a slice with a step) cannot be rebuilt.
    """
    raw = bytearray(base64.b64decode(data))
    flat = torch.frombuffer(raw, dtype=dtype) if len(raw) % dtype.itemsize == 0 and raw else None
    numel = math.prod(shape)
    if flat is None or flat.numel() != numel:
        return None
    if numel == 0:
        return flat.reshape(shape)
    extent = 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
    if extent > numel:
        return None
    return flat.as_strided(shape, stride, 0)


def _broadcast_index(view: torch.Tensor) -> tuple[slice, ...]:
    """Index keeping one element of every broadcast (stride-0) dimension of ``view``."""
    return tuple(slice(0, 1) if st == 0 and s > 1 else slice(None) for s, st in zip(view.shape, view.stride(),
                                                                                      strict=True))


def _distinct(view: torch.Tensor) -> torch.Tensor:
    """``view`` without its broadcast dimensions: each memory location it shows, once."""
    return view[_broadcast_index(view)]


def _describe(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _seconds(gap_us: Any) -> float:
    """A host gap in seconds, as a float the generated code can hold: finite, not negative."""
    seconds = 1e-6 * float(gap_us or 0.0)
    return seconds if math.isfinite(seconds) and seconds > 0 else 0.0


def _waited(result: Any, wait: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(result, torch.Tensor):
        return wait(result)
    if isinstance(result, (list, tuple)):
        return type(result)(_waited(r, wait) for r in result)
    return result


def _at(items: Any, index: int) -> Any:
    return items[index] if isinstance(items, list) and index < len(items) else None
