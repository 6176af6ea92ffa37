"""The error-bounded codec's fast path: a float32 grid per block, fused encode and decode.

Block wire format (``8 + bits · ceil(block / 8)`` bytes): a header of two 32-bit words, then the
codes packed. Fast blocks (step word's sign bit clear): ``origin`` = the block minimum as float32,
``step`` as float32; element ``i`` decodes to ``float32(origin + code_i · step)``. Exact-path
blocks (sign bit set; see :mod:`workloads.dlrm.error_bounded.exact_grid`): ``|step|`` is the high word of a
float64 pointing from the origin towards zero, decoded in float64 and clamped to ±FLT_MAX. A
non-finite block has a NaN origin and decodes to NaN. Codes: element ``p · G + g`` (``G =
ceil(block / 8)`` groups, padding codes zero) sits in group ``g`` at bit offset ``bits · p`` of a
little-endian word of ``bits`` bytes; for ``bits > 8`` the low byte of every code comes first
(``8 · G`` bytes), then the high ``bits - 8`` bits packed that way.

Why a fast block meets its bound (float32 only, no float64 on this path):

1. ``step = (max - min) / (2**bits - 1)`` rounded *up* to ``24 - bits`` significant bits (integer
   add-and-mask on its bit pattern), so the ``2**bits`` grid points cover the block, and every
   ``code · step`` (``bits`` × ``24 - bits`` significant bits) is exact in float32: the decoded value
   is one rounding of ``origin + code · step`` whether or not the device fuses it into an FMA —
   every device decodes the same bits.
2. The encoder computes each element's code, decodes it with that very arithmetic, and sends the
   block only when every ``fl(|x - x̂|)`` is 0 or ``< limit``. Rounding is monotone, so
   ``fl(d) < limit`` implies ``d < limit`` for the exact error ``d``.
3. ``limit`` is at most the bound: the per-block factor arrives rounded down to float32 (see
   :func:`float32_below`), and ``fl(fl(max - min) · factor) · (1 - 2**-21)`` is below
   ``(max - min) · factor`` since three roundings of 2**-24 each are less than 2**-21; a limit below
   2**-100 (where subnormal rounding would void that argument) is taken as 0, so only exact blocks
   pass.

A block that fails the check (float32 rounding dominates: a nearly constant block far from zero, a
range that overflows) is re-encoded by the exact float64 path; a non-finite one travels as NaN.

On CPU the path runs as a C++ kernel (``fast_kernels.cpp``, built once with the toolchain PyTorch
uses, cached under ``TORCH_EXTENSIONS_DIR``: :func:`build_directory`); elsewhere, or when that
build fails (stated in a warning: no compiler, no ninja), as the tensor program below, which
computes the same bytes (``tests/test_compression.py`` compares them) and runs under
``torch.compile`` on CUDA.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

HEADER_BYTES = 8
_SOURCE = Path(__file__).with_name("fast_kernels.cpp")
_NAME = "cobench_eb_kernels"
STATUS_SENT, STATUS_EXACT_PATH, STATUS_NONFINITE = 0, 1, 2


def payload_bytes(bits: int, block: int) -> int:
    return bits * math.ceil(block / 8)


def float32_below(values: torch.Tensor) -> torch.Tensor:
    """float64 → the largest float32 not above each value (non-negative, finite inputs)."""
    rounded = values.float()
    above = rounded.double() > values
    return torch.where(above, torch.nextafter(rounded, torch.zeros_like(rounded)), rounded)


def build_directory() -> Path:
    """Where the C++ kernels are built and cached: under ``TORCH_EXTENSIONS_DIR`` (or PyTorch's default root for
    extensions), one folder per torch version and Python, so that two torch builds sharing a cache never load
    each other's library."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    return root / f"{_NAME}-torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}"


@contextlib.contextmanager
def _building(directory: Path) -> Iterator[None]:
    """Hold the build of ``directory`` for this process, clearing a lock a killed build left behind.

    PyTorch marks a build in progress with a ``lock`` file that only the building process removes: when that
    process is killed mid-build (Ctrl-C, a CI timeout, a machine restart), every later ``load`` of the folder
    waits for it forever, in silence. Here every build of the kernels first takes an flock(2) on a file beside
    the folder, which the kernel releases when its holder dies: whoever holds it is the only builder alive, so a
    ``lock`` file found then is stale, and goes (with a warning saying so)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.with_name(directory.name + ".flock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a build running in another process: wait for it to end
        stale = directory / "lock"
        if stale.exists():
            logger.warning("error-bounded codec: removing %s, left by a build of the C++ kernels whose process "
                           "ended before the build did", stale)
            stale.unlink(missing_ok=True)
        yield


@functools.cache
def cpu_kernels() -> Any | None:
    """The compiled C++ kernels, or None (with a warning saying why) when they cannot be built."""
    try:
        from torch.utils.cpp_extension import load

        directory = build_directory()
        with _building(directory):
            return load(name=_NAME, sources=[str(_SOURCE)], extra_cflags=["-O3", "-fopenmp"],
                        extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
    except Exception as err:  # noqa: BLE001 - any build failure means: use the tensor program
        logger.warning("error-bounded codec: the C++ kernels could not be built (%s: %s); encoding with the "
                       "tensor program instead (same bytes, slower on CPU)", type(err).__name__,
                       str(err).splitlines()[0] if str(err) else "")
        return None


def kernel_name(device: torch.device) -> str:
    """Which implementation runs on ``device``: ``cpp`` (CPU kernels), ``compiled`` or ``tensor``."""
    if device.type == "cpu":
        return "cpp" if cpu_kernels() is not None else "tensor"
    return f"tensor (eager: {_eager_because[0]})" if _eager_because else "compiled"


def encode_fast(x: torch.Tensor, factor: torch.Tensor, rel: bool, bits: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(message rows, status, errors, summary) of ``x`` (n, block) float32 on the float32 grid.

    ``factor``: per block, float32 rounded down — the bound as a fraction of the block's range
    (``rel``) or absolute. Status 0: sent; 1: the exact path must take the block; 2: non-finite.
    ``errors`` (n, 3): per sent block its largest error — computed with the decoder's arithmetic,
    so it is the receiver's —, that ÷ the bound, and the sum of its errors (0 for the others);
    ``summary``: :func:`summarise` of those, read once by the caller.
    """
    x = x.contiguous()
    if x.device.type == "cpu" and (kernels := cpu_kernels()) is not None:
        message, status, errors, summary = kernels.encode(x, factor.contiguous(), rel, bits)
        return message, status, errors, summary
    if x.device.type == "cpu":
        return _encode_tensor(x, factor, rel, bits)
    return _run_compiled(0, (x, factor), rel, bits, x.shape[1])


def block_minmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of every row of ``x`` (n, block) float32, NaN where the row holds one (torch.aminmax's
    semantics; on CPU a C++ loop, several times faster than aminmax over a short inner dimension)."""
    x = x.contiguous()
    if x.device.type == "cpu" and x.numel() and (kernels := cpu_kernels()) is not None:
        lo, hi = kernels.block_minmax(x)
        return lo, hi
    return torch.aminmax(x, dim=1)


def decode_fast(message: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """(n, block) float32 from (n, 8 + payload) uint8 message rows (both kinds of block)."""
    message = message.contiguous()
    if message.device.type == "cpu" and (kernels := cpu_kernels()) is not None:
        return kernels.decode(message, bits, block)
    if message.device.type == "cpu":
        return _decode_tensor(message, bits, block)
    return _run_compiled(1, (message,), False, bits, block)


# ---- the tensor program (every device; the reference the C++ kernels must match) -----------------


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(n, block) int32 codes → (n, bits · G) uint8 in the module's layout."""
    n, block = codes.shape
    groups = math.ceil(block / 8)
    codes = torch.nn.functional.pad(codes, (0, 8 * groups - block)).view(n, 8, groups)
    parts = []
    packed_bits = bits
    if bits > 8:
        parts.append((codes & 0xFF).to(torch.uint8).reshape(n, 8 * groups))
        codes, packed_bits = codes >> 8, bits - 8
    word = torch.zeros(n, groups, dtype=torch.int64, device=codes.device)
    for p in range(8):  # one constant shift per position: vectorisable
        word |= codes[:, p].to(torch.int64) << (packed_bits * p)
    parts.append(word.view(torch.uint8).view(n, groups, 8)[..., :packed_bits].reshape(n, groups * packed_bits))
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


def unpack(payload: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Inverse of :func:`pack`: (n, bits · G) uint8 → (n, block) int32."""
    n, groups = payload.shape[0], math.ceil(block / 8)
    low = None
    packed_bits = bits
    if bits > 8:
        low = payload[:, :8 * groups].to(torch.int32)
        payload, packed_bits = payload[:, 8 * groups:], bits - 8
    words = torch.nn.functional.pad(payload.reshape(n, groups, packed_bits), (0, 8 - packed_bits))
    words = words.contiguous().view(torch.int64).view(n, groups)
    mask = (1 << packed_bits) - 1
    codes = torch.stack([(words >> (packed_bits * p)) & mask for p in range(8)], 1).reshape(n, 8 * groups)
    codes = codes.to(torch.int32)
    if low is not None:
        codes = low | (codes << 8)
    return codes[:, :block]


def _encode_tensor(x: torch.Tensor, factor: torch.Tensor, rel: bool, bits: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.shape[0]
    low = (1 << bits) - 1
    finite = torch.isfinite(x).all(1)
    clean = torch.where(finite.unsqueeze(1), x, 0.0)
    lo, hi = torch.aminmax(clean, dim=1)
    span = hi - lo
    step = ((span / float(low) if low else torch.zeros_like(span)).view(torch.int32) + low) & ~low
    step = step.view(torch.float32)
    inverse = torch.where(step > 0, 1.0 / step, 0.0)
    limit = (span * factor if rel else factor) * (1.0 - 2.0**-21)
    limit = torch.where(limit >= 2.0**-100, limit, 0.0)
    codes = ((clean - lo.unsqueeze(1)) * inverse.unsqueeze(1)).round_().clamp_(0, float(low))
    error = (clean - (lo.unsqueeze(1) + codes * step.unsqueeze(1))).abs_()
    ok = ((error == 0) | (error < limit.unsqueeze(1))).all(1) & torch.isfinite(step)
    status = torch.where(finite, torch.where(ok, STATUS_SENT, STATUS_EXACT_PATH), STATUS_NONFINITE)
    sent = status == STATUS_SENT
    origin = torch.where(finite, torch.where(sent, lo, 0.0), math.nan)
    header = torch.stack([origin.view(torch.int32), torch.where(sent, step, 0.0).view(torch.int32)], 1)
    codes = torch.where(sent.unsqueeze(1), codes, 0.0).to(torch.int32)
    message = torch.cat([header.view(torch.uint8).view(n, HEADER_BYTES), pack(codes, bits)], 1)
    largest = error.amax(1) if error.shape[1] else torch.zeros_like(span)
    largest = torch.where(sent, largest, 0.0)
    ratio = torch.where(largest > 0, largest / limit, 0.0)
    errors = torch.stack([largest, ratio, torch.where(sent, error.sum(1), 0.0)], 1)
    status = status.to(torch.int8)
    return message, status, errors, summarise(status, errors)


def summarise(status: torch.Tensor, errors: torch.Tensor) -> torch.Tensor:
    """(6,) float64: blocks sent, for the exact path, non-finite; largest error, largest error ÷
    bound, sum of errors."""
    # three comparisons, not bincount: its output size depends on the data, which the compiler cannot trace
    counts = torch.stack([(status == kind).sum() for kind in (STATUS_SENT, STATUS_EXACT_PATH, STATUS_NONFINITE)])
    counts = counts.double()
    if not errors.numel():
        return torch.cat([counts, counts.new_zeros(3)])
    return torch.cat([counts, errors[:, :2].amax(0).double(), errors[:, 2:].double().sum(0)])


def _decode_tensor(message: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    header = message[:, :HEADER_BYTES].contiguous().view(torch.int32)
    origin, word = header[:, :1].view(torch.float32), header[:, 1:]
    codes = unpack(message[:, HEADER_BYTES:], bits, block)
    fast = origin + codes.float() * word.view(torch.float32)
    exact = word < 0
    if not bool(exact.any()):
        return fast
    magnitude = ((word & 0x7FFFFFFF).to(torch.int64) << 32).view(torch.float64)
    step = torch.where(origin > 0, -magnitude, magnitude)
    limit = float(torch.finfo(torch.float32).max)
    slow = torch.addcmul(origin.double(), codes.double(), step).clamp_(-limit, limit).float()
    return torch.where(exact, slow, fast)


@functools.cache
def _compiled(rel: bool, bits: int, block: int) -> tuple[Any, Any]:
    """The tensor program under ``torch.compile`` (Triton on CUDA) for one width: ``rel``, ``bits`` and
    ``block`` are the closures' constants. Compiled static (``dynamic=True`` would trace those integers
    symbolically too: ``~low`` then breaks the graph, and torch 2.11's dynamo fails on ``1 << bits``); the
    number of rows, the one size that changes from message to message, is marked dynamic per call."""

    def encode(x: torch.Tensor, factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _encode_tensor(x, factor, rel, bits)

    def decode(message: torch.Tensor) -> torch.Tensor:
        return _decode_tensor(message, bits, block)

    return torch.compile(encode, dynamic=False), torch.compile(decode, dynamic=False)


_eager_because: list[str] = []  # why the compiled program is not used in this process, once it failed


def _run_compiled(which: int, args: tuple, rel: bool, bits: int, block: int) -> Any:
    """The compiled program where it compiles and runs, else the same tensor program eagerly (the same bytes),
    said once in a warning."""
    if not _eager_because:
        try:
            rows = args[0].shape[0]
            if rows > 1:  # one program for every message size (0 and 1 are always specialised)
                for arg in args:
                    if arg.dim() and arg.shape[0] == rows:
                        torch._dynamo.mark_dynamic(arg, 0)
            return _compiled(rel, bits, block)[which](*args)
        except Exception as err:  # noqa: BLE001 - any compiler failure: the eager program computes the same
            causes, cause = [], err  # the compiler's own error is a chain: its first lines name the op
            while cause is not None and len(causes) < 3:
                causes.append(f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}")
                cause = cause.__cause__
            _eager_because.append(" <- ".join(causes))
            logger.warning("error-bounded codec: torch.compile failed (%s); running the tensor program eagerly",
                           _eager_because[0])
    return _encode_tensor(*args, rel, bits) if which == 0 else _decode_tensor(*args, bits, block)
