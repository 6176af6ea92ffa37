"""One captured op made callable: the dispatcher op its schema names, its call template, its tensor slots.

How each op runs: its schema (from the trace) names the dispatcher op — ``torch.ops.<ns>.<op>.
<overload>`` — and the parsed schema says which arguments are keyword-only and which integers are
really dtypes, layouts or memory formats. The execution trace's value encodings are read here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from workloads.trace_replay.sparse import fit_count
from workloads.trace_replay.tensors import broadcast_index, fill_view, own_copy

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
# namespaces whose operators are registered when a Python module is imported (FSDP2 registers its own fsdp:: ops)
_LIBRARIES = {"fbgemm": ("fbgemm_gpu",), "torchrec": ("torchrec",), "torchvision": ("torchvision",),
              "fsdp": ("torch.distributed.fsdp",)}


class OpUnavailable(RuntimeError):
    """This torch build has no such operator (or it cannot be called here)."""


class OpRefused(RuntimeError):
    """The replay policy (:mod:`workloads.trace_replay.policy`) refuses this op and the spec is not trusted."""


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
    def storageless(self) -> bool:
        """A tensor with no storage of its own (its element size 0): a sparse tensor (:mod:`.sparse`)."""
        return self.itemsize == 0

    @property
    def extent(self) -> int:
        """Elements of storage this view spans from its offset (0 when it is empty)."""
        if self.storageless or any(s == 0 for s in self.shape):
            return 0
        return 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride, strict=False))


def tensor_info(ref: list, shape: Any, stride: Any, et_type: str) -> TensorInfo:
    shape = tuple(int(s) for s in shape) if isinstance(shape, list) else ()
    stride = tuple(int(s) for s in stride) if isinstance(stride, list) and len(stride) == len(shape) else ()
    if not stride:  # contiguous strides when the trace has none
        acc, rev = 1, []
        for s in reversed(shape):
            rev.append(acc)
            acc *= max(s, 1)
        stride = tuple(reversed(rev))
    return TensorInfo(int(ref[0]), int(ref[1]), int(ref[2]), shape, stride, tensor_dtype(et_type), int(ref[4]))


def list_types(et_type: str) -> list[str]:
    """Element types of ``GenericList[...]``: a tensor type may hold commas and parentheses of its own
    (``Tensor(nullptr (uninitialized))``, an undefined tensor)."""
    inner = et_type[len("GenericList["):-1]
    return re.findall(r"Tensor\((?:[^()]|\([^()]*\))*\)|[^,]+", inner) if inner else []


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
    # Outputs an uninitialised-memory op (aten::empty…) makes, filled later by a copy the trace does not
    # show (e.g. torch.tensor(list)): slot → the value range its consumer recorded (integers), or None
    # (floats: positive values, as synthesised ones; see dataflow.find_uninitialised_fills).
    fills: list[tuple[int, tuple[int, int] | None]] = field(default_factory=list)
    # Boolean masks this op makes (or last writes) whose count of True decides a later op's shape
    # (``x[mask]``, ``nonzero``, ``masked_select``): slot → a mask with the captured count.
    pins: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # A 1-D integer output whose length its input's values decide (an NMS keep list): slot → the
    # captured length, which the replay's own output is cut or cycled to (:func:`fit_length`).
    lengths: list[tuple[int, int]] = field(default_factory=list)
    # A sparse output whose count of stored elements its inputs' values decide (``coalesce``): slot → the
    # captured count, which the replay's own output is fitted to (:func:`.sparse.fit_count`).
    counts: list[tuple[int, int]] = field(default_factory=list)
    # Integer inputs the trace recorded whose storage the op hands on (a ``.to()`` that copies nothing, a view,
    # an in-place op's self): slot → the program's values, written into the slot's own tensor before the call
    # (:meth:`refill`), so that the op returns the tensor the step made, holding what the program's held.
    refills: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # Integer inputs passed as the recorded constant whose tensor the step also holds in a slot (one an earlier
    # op made or read): slot → the program's values. Where a later op reads that slot, they are refilled there
    # (:func:`.dataflow.refill_pinned_reads`).
    pinned: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # What runs in its place where this device has no kernel for it (:mod:`.portable`), or None
    ported: str | None = None
    # torch's generated binding that calls it as it is called here, quicker than the boxed call
    # (:func:`.bindings.python_binding`); None: the boxed call. ``bound``: looked for already.
    binding: Callable[..., Any] | None = None
    bound: bool = False
    # a collective launched without waiting: ``fn`` returns its works (the generated steps wait for them where
    # the step first uses its buffers; :meth:`call`, run op by op, at once)
    launches: bool = False
    # ... and waited for before the op this many later in its step, where the program stood waiting for it
    # (:attr:`.records.OpRecord.waited_after_ops`; None: at the first use alone)
    waited_after: int | None = None

    def call(self, vals: list[Any]) -> Any:
        if self.refills:
            self.refill(vals)
        args, kwargs = self.arguments(vals)
        if self.launches:
            return wait_all(self.fn(*args, **kwargs))
        return self.fn(*args, **kwargs)

    def refill(self, vals: list[Any]) -> None:
        """Write the program's values into the tensors :attr:`refills` names; an expanded tensor (one element
        in several places) gets them in the memory it shows, once each, as the program's view held them in
        its own smaller base. Where a slot's tensor cannot hold them (another shape, elements sharing memory
        otherwise), a copy of the values takes its place."""
        for slot, values in self.refills:
            held = vals[slot]
            if isinstance(held, torch.Tensor) and held.layout == torch.strided and held.shape == values.shape:
                try:
                    held.copy_(values)
                    continue
                except RuntimeError:  # elements sharing memory
                    pass
                try:
                    keep = broadcast_index(held)
                    held[keep].copy_(values[keep])
                    continue
                except RuntimeError:  # sharing it otherwise than by broadcasting
                    pass
            vals[slot] = own_copy(values, values.device)

    def arguments(self, vals: list[Any]) -> tuple[list[Any], dict[str, Any]]:
        """Its positional and keyword arguments, their tensors taken from ``vals``."""
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
        return args, kwargs

    def store(self, result: Any, vals: list[Any], generator: torch.Generator) -> None:
        if not self.out_slots:
            return
        flat = flatten_tensors(result)
        for slot, value in zip(self.out_slots, flat, strict=False):
            if slot is not None:
                vals[slot] = value
        self.store_fills(vals, generator)

    def store_fills(self, vals: list[Any], generator: torch.Generator) -> None:
        for slot, rng in self.fills:
            fill_view(vals[slot], rng, False, generator)
        for slot, mask in self.pins:
            vals[slot].copy_(mask)
        for slot, length in self.lengths:
            vals[slot] = fit_length(vals[slot], length)
        for slot, count in self.counts:
            vals[slot] = fit_count(vals[slot], count, generator)


def fit_length(index: torch.Tensor, length: int) -> torch.Tensor:
    """A 1-D integer tensor of ``length`` elements taken from ``index``'s own: its first ones, or all of
    them cycled; an empty one becomes zeros (the first row: valid wherever rows were to be chosen)."""
    if index.numel() >= length:
        return index[:length]
    if index.numel() == 0:
        return torch.zeros(length, dtype=index.dtype, device=index.device)
    return index.repeat(-(-length // index.numel()))[:length]


def flatten_tensors(result: Any) -> list[Any]:
    if isinstance(result, (tuple, list)):
        out = []
        for item in result:
            out.extend(flatten_tensors(item) if isinstance(item, (tuple, list)) else [item])
        return out
    return [result]


def wait_all(works: list[Any] | None) -> None:
    """Wait for each of a launched collective's works (None: nothing to wait for)."""
    for work in works or ():
        if work is not None:
            work.wait()


def wait_for(works: list[Any] | None, clock: Callable[[], float]) -> float:
    """Wait for each of a launched collective's works, as :func:`wait_all`; the seconds on ``clock`` from the call
    until the last of them completed, as its future's callback saw it (on the backend's worker thread), not until
    the wait returned: this thread's wake-up after an exchange is left out. The capture counts the program's own
    wake-up as host time after its wait (the waited part of an exchange ends with it:
    :func:`.host_time.waited_part`), which the replay spends after its wait; counted in the wait too, each wake-up
    would be spent twice. Where that moment is not known, the wait counts until it returned: a work already done
    when called, one without a future (gloo's reduce-scatter has none), one whose future had not
    completed when its wait returned (a device's collective, which a wait only orders on its stream)."""
    began = clock()
    done: list[float] = []
    pending, unknown = 0, False
    for work in works or ():
        if work is not None and not work.is_completed():
            try:
                future = work.get_future()
            except RuntimeError:  # "Work::getFuture not implemented"
                unknown = True
                continue
            future.add_done_callback(lambda _future: done.append(clock()))
            pending += 1
    wait_all(works)
    ended = clock()
    if unknown or pending == 0 or len(done) < pending:
        return ended - began
    return min(max(max(done), began), ended) - began


def describe(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def waited(result: Any, wait: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(result, torch.Tensor):
        return wait(result)
    if isinstance(result, (list, tuple)):
        return type(result)(waited(r, wait) for r in result)
    return result


def at(items: Any, index: int) -> Any:
    return items[index] if isinstance(items, list) and index < len(items) else None
