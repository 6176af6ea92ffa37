"""Captured ops made callable: each op's dispatcher call, its call template, the value slots of its tensors.

Every tensor value a captured op reads or writes gets a slot (a position in the replay's value list),
keyed by its captured identity and layout, so an op's outputs feed the later ops that read them and
views share storage as they did. An op's schema names the dispatcher op it calls (:mod:`.ops`);
collectives (``c10d::``) run through ``torch.distributed`` on the replay's process group (rank i
replays captured rank i); integer inputs the trace recorded are passed as constants. An op this
build cannot express is compiled with its error, not fatal; one the replay policy refuses
(:mod:`.policy`) raises :class:`~.ops.OpRefused` unless the spec is trusted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from workloads.device import all_gather_single, reduce_scatter_single
from workloads.trace_replay.ops import (
    LAYOUTS,
    MEMORY_FORMATS,
    SCALAR_TYPES,
    CompiledOp,
    OpRefused,
    OpUnavailable,
    TensorInfo,
    at,
    list_types,
    resolve_op,
    tensor_info,
    waited,
)
from workloads.trace_replay.parse import is_tensor_ref, tensor_refs
from workloads.trace_replay.policy import op_refusal
from workloads.trace_replay.portable import PORTED, PortableAttention, lacks_kernel
from workloads.trace_replay.records import OpRecord
from workloads.trace_replay.tensors import own_copy, recorded_view

# Kernels whose outputs depend on autograd being on (the workspace their backward reads).
GRAD_MODE_OPS = frozenset({"aten::mkldnn_rnn_layer", "aten::_cudnn_rnn", "aten::miopen_rnn"})


def _with_autograd(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.enable_grad():
            return fn(*args, **kwargs)

    return call


# Ops that take boxes as addresses (an image index, then corners) and do not check them: a NaN there becomes
# an index out of bounds in the kernel (SIGSEGV). Their boxes come from the replay's own values (made-up
# weights and inputs), which can go non-finite where the program's stayed finite.
ROI_OPS = frozenset(f"torchvision::{name}" for name in ("roi_align", "_roi_align_backward", "roi_pool",
                                                         "_roi_pool_backward", "ps_roi_align", "_ps_roi_align_backward",
                                                         "ps_roi_pool", "_ps_roi_pool_backward"))


def _with_finite_boxes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its ``rois`` (the second argument of every op in :data:`ROI_OPS`) made finite: non-finite
    values become 0 (image 0; a corner at the origin), which the kernel reads safely."""

    def call(first: Any, rois: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return fn(first, torch.nan_to_num(rois, nan=0.0, posinf=0.0, neginf=0.0), *args, **kwargs)

    return call


class OpCompiler:
    """Compiles a rank's ops one by one; :attr:`slots` numbers every tensor value they read or write."""

    def __init__(self, device: torch.device, *, process_group: Any = None, trust: bool = False,
                 training: bool = False):
        self.device, self.group = device, process_group
        self.trust = trust  # compile ops the safety policy refuses (the user vouched for this spec)
        # A training step (its backward ran): kernels that keep what their backward needs only with autograd
        # on (an RNN layer's workspace) run with it on, as in the program's forward
        self.training = training
        self.slots: dict[tuple, int] = {}
        self.portable = PortableAttention(device, training)  # fused kernels of another device, through this one's
        self._made: dict[tuple, int] = {}  # each op output's placement (storage, offset, layout) → its slot
        self._step: int | None = None
        self._backward = False  # the op being compiled runs in the autograd engine

    def _slot(self, info: TensorInfo) -> int:
        return self.slots.setdefault(info.key, len(self.slots))

    def _input_slot(self, info: TensorInfo) -> int:
        """An input's slot. A tensor a backward op reads that the ops never made nor read before, laid exactly
        over a tensor an earlier op of this step made (same storage, offset, shape, stride and dtype), is that
        output: autograd hands a backward op the output its forward saved as a new tensor of the same storage,
        which the trace gives a new id (``_softmax_backward_data``'s softmax, ``tanh_backward``'s tanh,
        ``threshold_backward``'s ReLU). Left an id of its own, it was made up like a parameter, and the backward
        computed with made-up values: GPT-2's log-softmax gradients came out 10³ times the program's."""
        if self._backward and info.key not in self.slots:
            made = self._made.get(self._placement(info))
            if made is not None:
                self.slots[info.key] = made
        return self._slot(info)

    @staticmethod
    def _placement(info: TensorInfo) -> tuple:
        return (info.storage_id, info.offset, info.shape, info.stride, info.dtype)

    def compile(self, index: int, op: OpRecord) -> CompiledOp:
        """One captured op as a :class:`~.ops.CompiledOp` (with its error where it cannot run here)."""
        compiled = CompiledOp(index, op.name, op.category, op.step, None, [], {}, [], [], [], [], op.dur_us)
        if op.step != self._step:  # a step's outputs stand in for its own inputs only
            self._step, self._made = op.step, {}
        self._backward = any(scope.startswith("autograd::engine::") for scope in op.scopes)
        refusal = None if self.trust else op_refusal(op.name, op.schema)
        if refusal is not None:  # check_spec refuses such a spec first: this is the last line of defence
            raise OpRefused(f"op #{index} {op.schema.split('(', 1)[0]}: {refusal}")
        try:
            self._compile_outputs(op, compiled)
            if op.name.startswith("c10d::"):
                compiled.fn = self._collective(op.name)
                compiled.launches, compiled.waited_after = True, op.waited_after_ops
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
                if lacks_kernel(op.name, self.device):
                    compiled.fn = self.portable.stand_in(op.name, op.schema, compiled.out_infos)
                    compiled.ported = PORTED
                if op.name in ROI_OPS:
                    compiled.fn = _with_finite_boxes(compiled.fn)
                if self.training and op.name in GRAD_MODE_OPS:
                    compiled.fn = _with_autograd(compiled.fn)
                self._compile_args(op, compiled, torch._C.parse_schema(op.schema).arguments)
        except Exception as err:  # noqa: BLE001 - an op this build cannot express is recorded, not fatal
            compiled.error = f"{type(err).__name__}: {err}"
            compiled.fn = None
        for slot, info in zip(compiled.out_slots, compiled.out_infos, strict=False):
            if slot is not None and info is not None:
                self._made[self._placement(info)] = slot
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
        returned = {ref[1] for ref in tensor_refs(op.outputs.values or []) if ref[1] != 0}  # storages it hands on
        for i, (value, et_type) in enumerate(zip(values, types, strict=False)):
            arg = schema_args[i] if schema_args is not None else None
            arg_type = str(arg.type) if arg is not None else ""
            converted, slots = self._convert(value, et_type, at(shapes, i), at(strides, i), arg_type,
                                             tensor_index, data, returned, compiled)
            if arg is not None and arg.kwarg_only:
                compiled.kwargs[arg.name] = converted
                compiled.kwarg_slots.extend((arg.name, sub, slot) for sub, slot in slots)
            else:
                compiled.arg_slots.extend((len(compiled.args), sub, slot) for sub, slot in slots)
                compiled.args.append(converted)

    def _convert(self, value: Any, et_type: str, shape: Any, stride: Any, arg_type: str,
                 tensor_index: list[int], data: dict[str, str], returned: set[int],
                 compiled: CompiledOp) -> tuple[Any, list]:
        """A trace value → (call-template value, [(list index or −1, slot)]).

        An integer tensor the trace recorded is the constant :meth:`_pinned` makes, except where the op hands
        its storage on (``returned``: a ``.to()`` that copies nothing, a view, an in-place op's self): there
        the constant would be what the op returns, and the tensor the step made would be freed at this op
        where the program held it on (a ``stack`` of edge indices read through ``.to()`` and held by the
        sparse adjacency made from it: the replayed step 15 % of its memory below the program's). Such an
        input keeps its slot, and the recorded values are written into the slot's tensor before the call
        (``refills``, :meth:`.ops.CompiledOp.refill`): what the op reads and hands on is the program's values.
        """
        if et_type.startswith("Tensor("):
            tensor_index[0] += 1
            if not is_tensor_ref(value) or "nullptr" in et_type:
                return None, []
            info = tensor_info(value, shape, stride, et_type)
            constant, slot = self._constant_or_slot(info, data.get(str(tensor_index[0])), returned, compiled)
            return constant, [] if slot is None else [(-1, slot)]
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
                        template[j], slot = self._constant_or_slot(info, data.get(str(tensor_index[0])), returned,
                                                                   compiled)
                        if slot is not None:
                            slots.append((j, slot))
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
        if et_type.startswith("Complex"):
            # the execution trace records a complex scalar's type, not its value ("<ComplexDouble>": the backward
            # of torch.polar, of angle); one of unit magnitude costs the op what the program's did and keeps the
            # values it makes as large as their inputs
            return (complex(value) if isinstance(value, (int, float, complex)) else complex(1.0, 0.0)), []
        if et_type in ("Object", "Generator"):
            return None, []
        return value, []

    def _constant_or_slot(self, info: TensorInfo, data: str | None, returned: set[int],
                          compiled: CompiledOp) -> tuple[torch.Tensor | None, int | None]:
        """A tensor input → (the constant the call holds, None), or (None, the slot it is read from); a recorded
        one whose storage the op hands on is read from its slot, its values refilled there (:meth:`_convert`).
        A constant whose tensor has a slot already is kept in :attr:`.ops.CompiledOp.pinned`."""
        pinned = self._pinned(info, data)
        if pinned is None:
            return None, self._input_slot(info)
        if info.storage_id in returned:
            slot = self._input_slot(info)
            compiled.refills.append((slot, pinned))
            return None, slot
        known = self.slots.get(info.key)
        if known is None and self._backward:
            known = self._made.get(self._placement(info))
        if known is not None:
            compiled.pinned.append((known, pinned))
        return pinned, None

    def _pinned(self, info: TensorInfo, data: str | None) -> torch.Tensor | None:
        """The program's own values for an integer input the trace recorded, as a constant.

        Index tensors are often computed from data (``nonzero``, cumulative sums of lengths …); from
        synthetic inputs they would come out with other values or even other shapes. Feeding the
        recorded values keeps every lookup in range and every data-dependent shape as captured.
        """
        if data is None or info.dtype.is_floating_point:
            return None
        values = recorded_view(data, info.dtype, info.shape, info.stride)
        return None if values is None else own_copy(values, self.device)

    def _collective(self, name: str) -> Callable[..., Any]:
        """The ``torch.distributed`` call for a captured ``c10d::`` op (its process-group arguments dropped),
        launched without waiting: it returns the list of its works, which the step waits for where it first
        uses what they make (:func:`.codegen.generate_step`; :meth:`.ops.CompiledOp.call` waits at once)."""
        if not dist.is_initialized():
            raise OpUnavailable(f"{name} needs a process group: replay under torchrun with the captured world size")
        group = self.group
        table: dict[str, Callable[..., Any]] = {
            "c10d::allreduce_": lambda tensors, *_: [dist.all_reduce(t, group=group, async_op=True) for t in tensors],
            "c10d::_allgather_base_": lambda out, inp, *_: [
                all_gather_single(out, inp, group=group, async_op=True)],
            "c10d::allgather_into_tensor_coalesced_": lambda outs, ins, *_: [
                all_gather_single(o, i, group=group, async_op=True) for o, i in zip(outs, ins, strict=False)],
            "c10d::_reduce_scatter_base_": lambda out, inp, *_: [
                reduce_scatter_single(out, inp, group=group, async_op=True)],
            "c10d::reduce_scatter_tensor_coalesced_": lambda outs, ins, *_: [
                reduce_scatter_single(o, i, group=group, async_op=True) for o, i in zip(outs, ins, strict=False)],
            "c10d::alltoall_base_": lambda out, inp, _pg, out_splits, in_splits, *_: [dist.all_to_all_single(
                out, inp, list(out_splits) or None, list(in_splits) or None, group=group, async_op=True)],
            "c10d::alltoall_": lambda outs, ins, *_: [dist.all_to_all(list(outs), list(ins), group=group,
                                                                      async_op=True)],
            "c10d::broadcast_": lambda tensors, _pg, root, *_: [
                dist.broadcast(t, src=int(root), group=group, async_op=True) for t in tensors],
            "c10d::barrier": lambda *_: [dist.barrier(group=group, async_op=True)],
        }
        if name not in table:
            raise OpUnavailable(f"collective {name} is not replayed yet (known: {', '.join(sorted(table))})")
        return table[name]
