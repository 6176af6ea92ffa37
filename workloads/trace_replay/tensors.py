"""Defined contents for the replay's synthesised tensors: recorded values, values in range, stand-ins.

A replay never reads uninitialised memory: every storage it synthesises gets values — the
program's own recorded integers where the trace has them, values inside the range the reading op
recorded otherwise, the program's own floats where its capture recorded a small tensor whole, finite
floats like the program's own where it profiled them — and an op that could not run is stood in for
by outputs of its captured layout.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import torch

from workloads.trace_replay.records import ValueStats


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


def own_copy(view: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``view``'s values in a tensor of its own on ``device`` (not a view: ops like ``detach_`` refuse views),
    laid out with ``view``'s strides over as much memory as they reach.

    ``clone`` keeps the strides of a dense layout but makes an expanded one (stride 0) dense: a scatter's index
    ``idx[:, None].expand(-1, 64)`` over 10,000 edges held 5.1 MB where the program's held 80 KB, and on this CPU
    ``scatter_add_`` took 6 times as long over it, ``scatter_reduce("amax")`` 27 times (an expanded index takes
    PyTorch's own faster path)."""
    copied = view.clone()
    if copied.stride() == view.stride() or view.numel() == 0:
        return copied.to(device)
    extent = 1 + sum((size - 1) * step for size, step in zip(view.shape, view.stride(), strict=True))
    own = torch.empty_strided(tuple(view.shape), view.stride(), dtype=view.dtype, device=device)
    memory = view.as_strided((extent,), (1,), view.storage_offset())
    with torch.no_grad():
        own.as_strided((extent,), (1,), 0).copy_(memory)
    return own


def broadcast_index(view: torch.Tensor) -> tuple[slice, ...]:
    """Index keeping one element of every broadcast (stride-0) dimension of ``view``."""
    return tuple(slice(0, 1) if st == 0 and s > 1 else slice(None) for s, st in zip(view.shape, view.stride(),
                                                                                      strict=True))


def distinct(view: torch.Tensor) -> torch.Tensor:
    """``view`` without its broadcast dimensions: each memory location it shows, once."""
    return view[broadcast_index(view)]


def copy_recorded(view: torch.Tensor, data: str) -> bool:
    """Write recorded raw integer data into ``view``; False when it does not fit the view."""
    values = recorded_view(data, view.dtype, tuple(view.shape), tuple(view.stride()))
    if values is None:
        return False
    target, values = distinct(view), values[broadcast_index(view)]
    if torch._debug_has_internal_overlap(target) != 0:
        return False
    with torch.no_grad():
        target.copy_(values)
    return True


def match_values(externals: list[tuple[Any, tuple[int, ...], torch.dtype, str | None]],
                 captured: list[ValueStats]) -> dict[Any, ValueStats]:
    """The program's value profile of each external floating storage: ``externals`` are (storage key,
    shape, dtype, the op that first read it) of the view each storage is first read through, in the order the
    steps first read them; ``captured`` the program's own, in its order (a storage with none keeps the default).

    Matched by shape, dtype and first reader where the profile names its reader, in order: the n-th storage an
    optimiser's ``aten::mul_`` first reads gets the n-th such profile (its second moments, never negative),
    and one more than the profile holds another of them. The rest by shape and dtype, in order, from the
    profiles left: an op the trace shows whole (``aten::linear``) reads its weight as another op below it
    (``aten::t``). Shape and order alone gave a storage another's profile wherever the profiled step read
    other tensors than the traced ones: Wav2Vec2's LayerDrop left one layer of two out of the profiled step,
    an optimiser's second moments were drawn like a weight, signed, and their square roots went NaN."""
    def kind(shape: tuple[int, ...], dtype: Any) -> tuple[tuple[int, ...], str]:
        return tuple(shape), str(dtype).removeprefix("torch.")

    profiles = [entry for entry in captured if entry.op is None]  # 0-dim ones read by read: match_scalars
    by_reader: dict[tuple, list[int]] = {}
    for i, entry in enumerate(profiles):
        if entry.reader is not None:
            by_reader.setdefault((*kind(entry.shape, entry.dtype), entry.reader), []).append(i)
    matched: dict[Any, ValueStats] = {}
    used: set[int] = set()
    taken: dict[tuple, int] = {}
    for key, shape, dtype, reader in externals:
        same = by_reader.get((*kind(shape, dtype), reader), [])
        if key not in matched and same:
            n = taken[(*kind(shape, dtype), reader)] = taken.get((*kind(shape, dtype), reader), -1) + 1
            matched[key] = profiles[same[n % len(same)]]
            used.update(same[:n + 1])
    by_kind: dict[tuple[tuple[int, ...], str], list[ValueStats]] = {}
    for i, entry in enumerate(profiles):
        if i not in used:
            by_kind.setdefault(kind(entry.shape, entry.dtype), []).append(entry)
    left: dict[tuple[tuple[int, ...], str], int] = {}
    for key, shape, dtype, _ in externals:
        n = left.get(kind(shape, dtype), 0)
        if key not in matched and n < len(by_kind.get(kind(shape, dtype), [])):
            matched[key] = by_kind[kind(shape, dtype)][n]
            left[kind(shape, dtype)] = n + 1
    return matched


def match_scalars(reads: list[list[tuple[int, str, torch.dtype]]], captured: list[ValueStats]) -> dict[int, float]:
    """The program's value of each 0-dim floating tensor a step reads but no op makes (mostly Python numbers
    the program passed: an optimiser's decay factors, epsilons, bias corrections): slot → value.

    ``reads`` are each step's such reads in its order, as (slot, reading op's name, dtype); ``captured`` the
    program's own, recorded at each read of its profiled step with the reader's name (:attr:`ValueStats.op`).
    The n-th read by an op of a name in a step gets the n-th recorded read by an op of that name, where their
    dtypes agree; a slot read more than once keeps the first value it gets."""
    by_op: dict[str, list[ValueStats]] = {}
    for entry in captured:
        if entry.op is not None:
            by_op.setdefault(entry.op, []).append(entry)
    values: dict[int, float] = {}
    for step in reads:
        taken: dict[str, int] = {}
        for slot, name, dtype in step:
            n = taken[name] = taken.get(name, -1) + 1
            entries = by_op.get(name, [])
            if n < len(entries) and slot not in values and entries[n].dtype == str(dtype).removeprefix("torch."):
                values[slot] = entries[n].low  # min = max = the value
    return values


def fill_view(view: torch.Tensor, rng: tuple[int, int] | None, is_offsets: bool, generator: torch.Generator,
              stats: ValueStats | None = None) -> None:
    """Defined values for a synthesised view: in the reader's range for integers; floats like the
    program's own (``stats``: its own values where the capture recorded them whole and the view shows them as
    it read them, else normal with its mean and spread, inside its range), else in [0.1, 1).

    Values change kernels' speed: a CPU's square root of subnormal floats runs ~35x slower, of negative
    ones ~19x. Positive floats keep square roots, logarithms and divisions defined where nothing is
    known of the program's values, but a network whose weights are all positive saturates (softmax,
    tanh) and its gradients sink into subnormals; drawn signed and scaled like a default
    initialisation, an optimiser's squared-gradient state goes negative. The program's own profile
    avoids both. A view whose elements share memory (an ``expand``: stride 0; overlapping windows) is
    written through the memory it spans, each location once, so every element it shows is defined.
    """
    if view.numel() == 0:
        return
    target, own = distinct(view), None
    if torch._debug_has_internal_overlap(target) != 0:
        extent = 1 + sum((s - 1) * st for s, st in zip(target.shape, target.stride(), strict=True))
        target = torch.empty(0, dtype=view.dtype, device=view.device).set_(
            view.untyped_storage(), view.storage_offset(), (extent,), (1,))
    elif stats is not None and stats.data is not None:
        own = _recorded(stats, view)
    if own is not None:
        values = own
    elif target.dtype == torch.bool:
        values = torch.rand(target.shape, generator=generator) < 0.5
    elif stats is not None and target.dtype.is_floating_point:
        values = _of_kind(stats, _like(stats, target.shape, generator))
    elif target.dtype.is_floating_point or target.dtype.is_complex:
        values = torch.empty(target.shape, dtype=torch.float32).uniform_(0.1, 1.0, generator=generator)
    else:
        low, high = rng if rng is not None else (0, 0)
        values = torch.randint(int(low), min(int(high) + 1, 2**63 - 1), target.shape, generator=generator)
        if is_offsets and target.dim() == 1:
            values = values.sort().values
            values[0] = int(low)
    with torch.no_grad():
        target.copy_(values.to(target.dtype))


def _recorded(stats: ValueStats, view: torch.Tensor) -> torch.Tensor | None:
    """The program's own values of a small tensor, as ``distinct(view)`` shows them; None where the view is not
    the one they were recorded through (another shape or dtype)."""
    if tuple(view.shape) != tuple(stats.shape) or str(view.dtype).removeprefix("torch.") != stats.dtype:
        return None
    strides = tuple(math.prod(view.shape[d + 1:]) for d in range(view.dim()))  # recorded in logical order
    values = recorded_view(stats.data or "", view.dtype, tuple(view.shape), strides)
    return None if values is None else values[broadcast_index(view)]


def _like(stats: ValueStats, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """Floats like the program's: normal with its mean and spread, inside its range; where it held exact zeros,
    its share of them: its wholly zero slices along each dimension where they were recorded (by index, or as
    many slices drawn as their share), the rest strewn, and the other elements drawn like its non-zero ones (a
    clamp at a minimum of 0 would strew zeros instead)."""
    mean, std, low, high = stats.nonzero if stats.nonzero is not None and stats.zeros > 0 else \
        (stats.mean, stats.std, stats.low, stats.high)
    values = torch.empty(shape, dtype=torch.float32).normal_(mean, std, generator=generator).clamp_(low, high)
    if stats.zeros <= 0 or stats.nonzero is None or values.numel() == 0:
        return values
    zero = torch.zeros(values.shape, dtype=torch.bool)
    if tuple(values.shape) == tuple(stats.shape):  # slices are of the shape they were recorded in
        for d, index in stats.zero_slices.items():
            picked = torch.tensor([i for i in index if i < values.shape[d]], dtype=torch.long)
            zero.index_fill_(d, picked, True)
        for d, share in stats.zero_slice_shares.items():
            if d not in stats.zero_slices:
                picked = torch.randperm(values.shape[d], generator=generator)[:round(share * values.shape[d])]
                zero.index_fill_(d, picked, True)
    made = float(zero.double().mean())
    strewn = max(0.0, (stats.zeros - made) / max(1.0 - made, 1e-12))
    if strewn > 0:
        zero |= torch.rand(values.shape, generator=generator) < strewn
    values[zero] = 0.0
    return values


def _of_kind(stats: ValueStats, values: torch.Tensor) -> torch.Tensor:
    """Drawn values made a matrix of the kind the program's was (``stats.matrix``): symmetric, its mirror image
    averaged in; positive definite, each diagonal element raised above the sum of its row's other magnitudes
    (by the program's spread), which makes it so. A Cholesky factorisation runs on any such matrix as on the
    program's, where it fails on floats drawn element by element."""
    if stats.matrix is None or tuple(values.shape) != tuple(stats.shape) or values.dim() < 2 \
            or values.shape[-1] != values.shape[-2]:
        return values
    values = (values + values.mT) / 2
    if stats.matrix == "positive_definite":
        diagonal = values.diagonal(dim1=-2, dim2=-1)
        others = values.abs().sum(-1) - diagonal.abs()
        diagonal.copy_(torch.maximum(diagonal, others + max(stats.std, 1e-3)))
    return values


def stand_in(shape: tuple[int, ...], stride: tuple[int, ...], offset: int, extent: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """Zeros of a captured layout, for the output of an op that could not run."""
    base = torch.zeros(max(offset + extent, 1), dtype=dtype, device=device)
    return base.as_strided(shape, stride, offset)
