"""What the program's own floating tensors hold, for a replay to synthesise values like them.

A replay makes up the contents of every tensor a step reads but does not make (parameters, optimiser
state, inputs). Kernels are not blind to values: on a CPU a square root of subnormal floats ran 35x
slower here and of negative ones 19x, and a network whose made-up weights saturate its softmax trains
its gradients into subnormals within a few hundred replayed steps. So the capture records, for one
step it does not time, each such tensor's mean, spread, range and zeros (how many, and which slices
of it are wholly zero), in the order the step first reads them; the replay matches them to its own by
shape, dtype and that order (:mod:`workloads.trace_replay.replay`). A few numbers per tensor; a small tensor (at most
:data:`~workloads.trace_bundle.EXACT_VALUE_ELEMENTS` elements, within a budget per rank) also keeps its
own values: figures cannot say which corner of a box is which, and a detector's anchor boxes drawn
from their mean and spread came out with negative widths, so its replayed RoI ops read other memory
for other lengths (``torchvision::_roi_align_backward`` ran 30 % short) and its regression targets,
logarithms of widths, went NaN.

A 0-dim floating tensor no op made is recorded at each read, with the op that read it: most are
Python numbers the program passed where an op takes a tensor (an optimiser's ``param.mul_(1 - lr *
weight_decay)``, ``denom.add_(eps)``), each made afresh, often at an address the last one freed, so
keyed by storage the step's first one would stand for all of them. Made up in ``[0.1, 1)`` instead,
an AdamW replay multiplied its weights by ~0.5 each step where the program multiplied by 0.999999,
and within some tens of steps its kernels ran on subnormal floats.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from workloads.trace_bundle import (
    EXACT_VALUE_BUDGET,
    EXACT_VALUE_ELEMENTS,
    MAX_VALUE_ENTRIES,
    ZERO_SLICE_BUDGET,
    ZERO_SLICE_ELEMENTS,
    ZERO_SLICE_INDICES,
)

SAMPLE_ELEMENTS = 2**20  # a larger tensor is summarised from an evenly strided view of about as many
# a square matrix (or a batch of them) of at most as many elements is checked for symmetry (its first rows against
# its first columns, then whole where they agree) and, where symmetric, factorised to tell whether it is positive
# definite: ~0.25 s for a symmetric 2048 x 2048 one on a 2-core VM, well under a millisecond for any weight
MATRIX_ELEMENTS = 2**22


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    """A view of about :data:`SAMPLE_ELEMENTS` elements spread over the tensor (itself when smaller):
    an embedding table of gigabytes is not copied to be summarised."""
    if tensor.numel() <= SAMPLE_ELEMENTS or tensor.dim() == 0:
        return tensor
    every = math.ceil((tensor.numel() / SAMPLE_ELEMENTS) ** (1.0 / tensor.dim()))
    return tensor[tuple(slice(None, None, every) for _ in range(tensor.dim()))]


def _summary(values: torch.Tensor) -> dict[str, float]:
    low, high = float(values.min()), float(values.max())
    return {"mean": min(max(float(values.mean()), low), high),  # rounding kept inside the range
            "std": float(values.std()) if values.numel() > 1 else 0.0, "min": low, "max": high}


def raw_values(tensor: torch.Tensor) -> str:
    """A tensor's values in logical order as raw bytes, base64 (as the execution trace keeps integer inputs:
    :func:`workloads.trace_replay.tensors.recorded_view` reads them back). From a copy: a storage numpy has seen
    can no longer be resized, and FSDP frees a parameter's unsharded storage by resizing it to 0."""
    flat = tensor.detach().reshape(-1).to("cpu", copy=True)
    return base64.b64encode(flat.view(torch.uint8).numpy().tobytes()).decode("ascii")


def _stats(tensor: torch.Tensor) -> dict[str, Any] | None:
    """Mean, standard deviation and range of the finite elements (None: none is finite); where some are exact
    zeros, how many (``zeros``: counted over the whole tensor where it has at most
    :data:`~workloads.trace_bundle.ZERO_SLICE_ELEMENTS`, as its zero slices are; an evenly strided sample of
    a 3 × 3 kernel sees its first row and column in 3 of its 4 elements, where they are 5 of 9) and the same
    four figures of the others (``nonzero``)."""
    detached = tensor.detach()
    sample = _sample(detached)
    values = sample.reshape(-1).double()
    finite = values[torch.isfinite(values)]
    if finite.numel() == 0:
        return None
    entry = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."), **_summary(finite)}
    zero = finite == 0
    share = float(zero.double().mean())
    if sample is not detached and detached.numel() <= ZERO_SLICE_ELEMENTS:
        share = int((detached == 0).sum()) / max(int(torch.isfinite(detached).sum()), 1)
    if share > 0:
        entry["zeros"] = share
        if not bool(zero.all()):
            entry["nonzero"] = _summary(finite[~zero])
    figures = [entry[k] for k in ("mean", "std", "min", "max")] + list(entry.get("nonzero", {}).values())
    return entry if all(math.isfinite(v) for v in figures) else None


def matrix_kind(tensor: torch.Tensor) -> str | None:
    """``"positive_definite"`` or ``"symmetric"`` for a square matrix, or a batch of them, that is so (up to
    rounding: a product ``a.T @ a`` is not bit-for-bit symmetric), else None; larger ones than
    :data:`MATRIX_ELEMENTS` are not checked.

    Some kernels refuse values of the wrong kind, not only run slower on them: a Cholesky factorisation of a
    covariance the program keeps fails on a matrix drawn element by element from its mean and spread (a
    48 x 48 one failed at its third leading minor), where the replay needs one of the same kind."""
    if tensor.dim() < 2 or tensor.shape[-1] != tensor.shape[-2] or tensor.shape[-1] < 2 \
            or tensor.numel() > MATRIX_ELEMENTS:
        return None
    edge = tensor.detach()[..., :2, :].to(torch.float64)  # its first two rows against its first two columns
    if not torch.allclose(edge, tensor.detach()[..., :, :2].mT.to(torch.float64), rtol=1e-5,
                          atol=1e-8 * float(edge.abs().max())):
        return None
    matrix = tensor.detach().to(torch.float64)
    if not bool(torch.isfinite(matrix).all()):
        return None
    if not torch.allclose(matrix, matrix.mT, rtol=1e-5, atol=1e-8 * float(matrix.abs().max())):
        return None
    return "positive_definite" if bool((torch.linalg.cholesky_ex(matrix).info == 0).all()) else "symmetric"


def zero_slices(tensor: torch.Tensor) -> tuple[dict[int, torch.Tensor], bool]:
    """Per dimension, the indices of the slices along it that are wholly zero, and whether they index the tensor
    itself (else its summarised sample: one larger than :data:`~workloads.trace_bundle.ZERO_SLICE_ELEMENTS`).

    Where zeros lie decides how fast some kernels run on them, not only how many there are: a CPU's square root
    of an optimiser's second moments ran twice as long with its zeros strewn as with the same share of them in
    the program's places (ResNet-18's last convolutions, whose 3 × 3 kernels' first row and column only ever
    meet padding on a 2 × 2 input: their gradients, and the moments, are zero on those whole slices). An
    embedding table no batch has touched yet is zero on whole rows, a dead channel on a whole slice along
    another dimension."""
    detached = tensor.detach()
    whole = detached.numel() <= ZERO_SLICE_ELEMENTS
    source = detached if whole else _sample(detached)
    zero = source == 0
    return {d: zero.movedim(d, 0).reshape(source.shape[d], -1).all(dim=1).nonzero().flatten()
            for d in range(source.dim())}, whole


def _inputs(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The tensors an op reads in its schema's order, and the Python floats it takes where its schema has a
    tensor: a dispatch mode sees a number the program passed as such (``x.mul_(0.999)``) as the number,
    where the execution trace sees the 0-dim double tensor it was wrapped in."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]
    inputs: list[Any] = []
    for i, argument in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        if isinstance(value, float) and isinstance(argument.type, torch.TensorType):
            inputs.append(value)
        else:
            inputs.extend(v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor))
    return inputs


class ValueProfile(TorchDispatchMode):
    """Under it, each floating tensor an op reads whose storage no op of this step made (the first
    time its storage is read, with that op's name in ``reader``; a 0-dim one at every read, with its reader's
    name in ``op``) is summarised in :attr:`entries`; the ops themselves run unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[dict[str, Any]] = []
        self.exact_left = EXACT_VALUE_BUDGET  # elements still to be recorded whole
        self.zero_slices_left = ZERO_SLICE_BUDGET  # indices of wholly zero slices still to be recorded
        self._made: set[int] = set()
        self._seen: set[int] = set()
        self._outputs = WeakIdKeyDictionary()  # 0-dim tensors ops returned, by identity

    def _storage(self, tensor: torch.Tensor) -> int | None:
        try:
            if tensor.is_sparse or tensor.is_nested or tensor.device.type == "meta":
                return None
            return tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage (wrappers, functional)
            return None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        inputs = _inputs(func, args, kwargs)
        if len(self.entries) < MAX_VALUE_ENTRIES:
            for value in inputs:
                if isinstance(value, float):  # a Python number where the op takes a tensor
                    self._scalar(torch.tensor(value, dtype=torch.float64), func)
                elif isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() == 0:
                    self._scalar(value, func)
                elif isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
                    ptr = self._storage(value)
                    if ptr is None or ptr in self._made or ptr in self._seen:
                        continue
                    self._seen.add(ptr)
                    self._record(value, reader=func.name().split(".")[0])
        out = func(*args, **kwargs)
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                ptr = self._storage(value)
                if ptr is not None:
                    self._made.add(ptr)
                if value.dim() == 0 and not any(value is given for given in inputs):  # in place: still theirs
                    self._outputs[value] = True
        return out

    def _scalar(self, value: torch.Tensor, func: Any) -> None:
        """A 0-dim floating input: recorded with its reader at every read, unless an op of this step made it."""
        if value in self._outputs or self._storage(value) is None or value.device.type == "meta":
            return
        self._record(value, op=func.name().split(".")[0])  # the trace's name for its reader: aten::mul_

    def _record(self, value: torch.Tensor, **reader: str) -> None:
        """One entry: its figures, its own values where it is small enough and the budget lasts (else, for a
        square matrix, whether it is symmetric or positive definite: ``matrix``), and where it
        holds zeros, its wholly zero slices along each dimension (``zero_slices``: by index where a dimension
        has at most :data:`~workloads.trace_bundle.ZERO_SLICE_INDICES` and the budget lasts; else their share,
        ``zero_slice_shares``)."""
        entry = _stats(value)
        if entry is None:
            return
        entry.update(reader)
        if value.numel() <= min(EXACT_VALUE_ELEMENTS, self.exact_left):
            entry["data"] = raw_values(value)
            self.exact_left -= value.numel()
        elif entry["std"] > 0 and (kind := matrix_kind(value)):  # (a constant one is drawn constant)
            entry["matrix"] = kind
        if entry.get("zeros") and "data" not in entry and value.dim() > 0:
            slices, whole = zero_slices(value)
            for d, index in slices.items():
                if not index.numel():
                    continue
                if whole and index.numel() <= min(ZERO_SLICE_INDICES, self.zero_slices_left):
                    entry.setdefault("zero_slices", {})[str(d)] = index.tolist()
                    self.zero_slices_left -= index.numel()
                else:
                    size = value.shape[d] if whole else _sample(value).shape[d]
                    entry.setdefault("zero_slice_shares", {})[str(d)] = min(index.numel() / size, entry["zeros"])
        self.entries.append(entry)
