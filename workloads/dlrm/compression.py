"""Error-bounded lossy compression of the embedding all-to-all (SC'24 idea), as a TorchRec codec.

:class:`ErrorBoundedCodec` implements TorchRec's ``QuantizedCommCodec`` interface, so it compresses
the forward pooled-embedding all-to-all and the backward gradient all-to-all. Unlike FP16/INT8
codecs it bounds the error: every decoded element ``x̂`` of a finite block obeys
``|x - x̂| <= bound`` for the block's bound in force, where the bound is

* ``mode="abs"``: ``eb · table_scale · schedule_factor`` (absolute), or
* ``mode="rel"``: ``eb · table_scale · schedule_factor · (max - min of the block)``,
  every product evaluated in float64 (that number is what the guarantee is checked against).

Wire format. The flat tensor is cut into blocks of ``block_size`` elements, encoded independently
into ``bytes_per_block(bits, block_size)`` bytes, so a chunk's size follows from its element count
(TorchRec computes split sizes before the collective). With ``bits <= 16`` a block is an 8-byte
header, two native-endian 32-bit words: ``origin`` as float32 and the signed ``step`` as the high
word of a float64 (low word zero: 21 significant bits with float64's range, so no step is lost to
float32 subnormals or overflow), then ``bits`` bit-planes of ``ceil(block_size / 8)`` bytes (plane
``j`` holds bit ``j`` of each code, code ``i`` in bit ``i % 8`` of byte ``i // 8``). Decoding is
``float32(clamp(origin + code · step, ±FLT_MAX))`` in float64, where ``code · step`` is exact, so
every device decodes the same bits. When the bound needs more than 16 bits the message is raw
float32 (bit-exact, ``bits = 32``). A block holding NaN or Inf is sent with a NaN origin, so it
decodes to all-NaN (in a raw message they travel as they are): never silently finite; they are
counted (:attr:`ErrorBoundedCodec.nonfinite_count`).

Why the bound holds (each claim is what the encoder checks per block, in float64 with margins that
cover float64 rounding; only a grid that passes is sent):

1. Uniform grid: origin at the block end of largest magnitude, step ``s`` towards the other end,
   nearest code. Error <= ``s/2`` (quantisation) + half the float32 spacing at the largest
   magnitude a used grid point can have (the float32 rounding of the decoded value).
2. When float32 rounding dominates (nearly constant blocks, subnormals) the encoder falls back to a
   grid aligned on the float32 lattice: every value is a multiple of ``σ`` = the spacing at the
   block's smallest magnitude; step ``σ`` decodes exactly, step ``2σ`` with error <= ``σ``.
3. ``packing="agreed"`` takes, per message, the widest width any block on any rank needs (one
   ``all_reduce(MAX)`` of an int); ``packing="fixed"`` fixes the width from the config. For
   ``mode="rel"``, ``bits >= ceil(log2(1/rel + 2))`` (one guard bit over ``log2(1/(2·rel) + 1)``)
   always leaves one of the three grids valid: if float32 spacing ``u`` spoils the uniform grid then
   ``range < u/rel``, so the ``2σ`` or the ``σ`` grid fits. For ``mode="abs"`` a fixed width needs
   a declared ``value_range``. ``tests/test_compression.py`` checks all of it on adversarial blocks.

One width per message: table scales tighten the bound of chosen tables, but the tightest table sets
the width (the others get the spare precision), so bytes fall only when all bounds loosen.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum, StrEnum
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # torchrec is imported where used: every cobench command imports all workloads
    from torchrec.distributed.types import QuantizedCommCodecs

from workloads.dlrm.comm import CUSTOM_CODECS, CustomCodec

logger = logging.getLogger(__name__)

MAX_PACKED_BITS = 16
RAW_BITS = 32  # the width recorded when a message travels as raw float32
HEADER_BYTES = 8
FLT_MAX = float(torch.finfo(torch.float32).max)
_CHECK_MARGIN = 1 - 2.0**-50  # a computed error must stay below bound·margin: covers float64 rounding


class BoundMode(StrEnum):
    ABS = "abs"
    REL = "rel"


class Packing(StrEnum):
    AGREED = "agreed"
    FIXED = "fixed"


class ScheduleKind(StrEnum):
    CONSTANT = "constant"
    LINEAR_DECAY = "linear_decay"
    FEEDBACK = "feedback"


def _parse(enum: type[Enum], value: Any, what: str) -> Any:
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"unknown {what} {value!r}; choose one of {[m.value for m in enum]}") from None


@dataclass(frozen=True)
class BoundSchedule:
    """Per-iteration factor on the bound: constant, linear decay to ``min_factor``, or feedback
    (multiply by ``tighten`` after ``patience`` losses without a ``min_delta`` relative gain)."""

    kind: ScheduleKind = ScheduleKind.CONSTANT
    decay_steps: int = 10_000
    min_factor: float = 0.1
    patience: int = 50
    tighten: float = 0.5
    min_delta: float = 1e-3

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _parse(ScheduleKind, self.kind, "schedule"))
        if not 0 < self.min_factor <= 1:
            raise ValueError(f"schedule min_factor must be in (0, 1], got {self.min_factor}")
        if not 0 < self.tighten < 1:
            raise ValueError(f"schedule tighten must be in (0, 1), got {self.tighten}")
        if self.decay_steps < 1 or self.patience < 1 or self.min_delta < 0:
            raise ValueError("schedule decay_steps and patience must be >= 1 and min_delta >= 0")

    @property
    def floor(self) -> float:
        """The smallest factor this schedule can reach."""
        return 1.0 if self.kind is ScheduleKind.CONSTANT else self.min_factor


@dataclass(frozen=True)
class ErrorBoundConfig:
    """One codec's settings. ``table_scales`` are multipliers per column block of the rows the codec
    sees (see :func:`column_block_scales`); ``value_range`` declares ``(lo, hi)`` for abs + fixed."""

    mode: BoundMode = BoundMode.REL
    eb: float = 1e-2
    packing: Packing = Packing.FIXED
    bits: int | None = None  # fixed packing only; None: the fewest that guarantee the bound
    block_size: int = 64
    schedule: BoundSchedule = field(default_factory=BoundSchedule)
    table_scales: tuple[float, ...] | None = None
    value_range: tuple[float, float] | None = None
    measure_error: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _parse(BoundMode, self.mode, "mode"))
        object.__setattr__(self, "packing", _parse(Packing, self.packing, "packing"))
        if not (math.isfinite(self.eb) and self.eb > 0):
            raise ValueError(f"eb must be a finite number > 0, got {self.eb}")
        if self.mode is BoundMode.REL and self.eb > 0.5:
            raise ValueError(f"a rel bound is a fraction of the block range; eb={self.eb} > 0.5 is meaningless")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.table_scales is not None:
            object.__setattr__(self, "table_scales", tuple(float(s) for s in self.table_scales))
            if not self.table_scales or not all(math.isfinite(s) and s > 0 for s in self.table_scales):
                raise ValueError("table_scales must be a non-empty list of finite numbers > 0")
        if self.packing is Packing.AGREED and self.bits is not None:
            raise ValueError("bits is set by the exchange under packing='agreed'; use packing='fixed'")
        if self.bits is not None and not 1 <= self.bits <= MAX_PACKED_BITS:
            raise ValueError(f"bits must be in [1, {MAX_PACKED_BITS}] (raw float32 is automatic), got {self.bits}")


@dataclass
class ErrorBoundedContext:
    """Per-collective state shared by encode, calc_quantized_size and decode."""

    bits: int | None = None  # the width of this message (agreed packing: after the exchange)
    row_len: int | None = None  # row length of the encoded (B, D) tensor, recorded by padded_size
    padded_dim_sum_per_rank: list[int] | None = None  # read by TorchRec; this codec never pads
    row_dim: int = -1  # read by TorchRec's variable-batch path; -1: no row-wise padding


@dataclass
class CompressionStats:
    """Totals since the last reset. Errors come from the sender decoding its own message
    (``measure_error=True``); non-finite blocks are excluded from them and counted instead."""

    encode_calls: int = 0
    decode_calls: int = 0
    bytes_in: int = 0  # float32 bytes given to encode
    bytes_out: int = 0  # bytes encode produced
    decoded_bytes: int = 0  # float32 bytes decode produced
    measured_elements: int = 0
    max_abs_error: float = 0.0
    sum_abs_error: float = 0.0
    max_error_over_bound: float = 0.0  # <= 1 is the guarantee
    bound_violations: int = 0  # elements over their bound; stays 0
    nonfinite_elements: int = 0
    nonfinite_blocks: int = 0
    lattice_blocks: int = 0  # blocks sent on the float32-lattice grid (rounding-dominated)
    raw_messages: int = 0  # messages sent as raw float32 (bound below what 16 bits guarantee)
    last_bits: int | None = None
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0
    measure_seconds: float = 0.0  # sender-side decode and error computation

    @property
    def compression_ratio(self) -> float:
        return self.bytes_in / self.bytes_out if self.bytes_out else float("nan")

    @property
    def mean_abs_error(self) -> float:
        return self.sum_abs_error / self.measured_elements if self.measured_elements else float("nan")

    @property
    def encode_gbps(self) -> float:
        """float32 input bytes encoded per second, in GB/s."""
        return self.bytes_in / self.encode_seconds / 1e9 if self.encode_seconds else float("nan")

    @property
    def decode_gbps(self) -> float:
        """float32 output bytes decoded per second, in GB/s."""
        return self.decoded_bytes / self.decode_seconds / 1e9 if self.decode_seconds else float("nan")

    def as_dict(self) -> dict[str, float]:
        """Flat numbers for a metrics logger."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "last_bits"}
        values["last_bits"] = self.last_bits if self.last_bits is not None else float("nan")
        for name in ("compression_ratio", "mean_abs_error", "encode_gbps", "decode_gbps"):
            values[name] = getattr(self, name)
        return {k: float(v) for k, v in values.items()}


def bytes_per_block(bits: int, block_size: int) -> int:
    """Encoded bytes of one block at this width (``RAW_BITS``: raw float32)."""
    if bits == RAW_BITS:
        return 4 * block_size
    return HEADER_BYTES + bits * math.ceil(block_size / 8)


def column_block_scales(
    table_dims: Sequence[int], table_scales: Sequence[float] | Mapping[int, float], block_size: int
) -> list[float]:
    """Expand per-table multipliers (a list, or ``{table index: scale}`` with 1.0 for the rest) to the
    per-column-block list the codec takes, for rows laid out as the tables' columns in order."""
    if isinstance(table_scales, Mapping):
        table_scales = [table_scales.get(t, 1.0) for t in range(len(table_dims))]
    if len(table_scales) != len(table_dims):
        raise ValueError(f"{len(table_scales)} table scales for {len(table_dims)} tables")
    if any(d % block_size for d in table_dims):
        raise ValueError(f"every table dim must be a multiple of block_size={block_size}: {list(table_dims)}")
    return [float(s) for d, s in zip(table_dims, table_scales, strict=True) for _ in range(d // block_size)]


# ---- float32 lattice arithmetic (float64 tensors in and out) -------------------------------------


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """Exactly 2.0**k as float64, built from the exponent bits (pow/exp2 kernels may round)."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def _ulp32(y: torch.Tensor) -> torch.Tensor:
    """Spacing of float32 numbers at magnitude ``y >= 0``: 2**-149 below the normals, and 2**104 at
    and above 2**127 (the decoder clamps to ±FLT_MAX, so nothing lands in a wider binade)."""
    exponent = ((y.view(torch.int64) >> 52) & 0x7FF) - 1023
    return _pow2(exponent.clamp(-126, 127) - 23)


def _round_step(x: torch.Tensor, up: bool) -> torch.Tensor:
    """``x >= 0`` rounded up or down to a step the header can hold: a float64 whose low 32 bits are
    zero (21 significant bits, float64's exponent range, so no subnormal or overflow losses)."""
    bits = x.view(torch.int64)
    high = bits >> 32
    if up:
        high = high + ((bits & 0xFFFFFFFF) != 0).to(torch.int64)  # carries into the exponent correctly
    return (high << 32).view(torch.float64)


def _bitlen(n: torch.Tensor) -> torch.Tensor:
    """Bits needed for the integer code ``n`` (float64, may be inf); 33 stands for 'more than 32'."""
    powers = _pow2(torch.arange(33, device=n.device))
    return (n.unsqueeze(-1) >= powers).sum(-1)


@dataclass
class _Blocks:
    """Per-block geometry (float64 unless noted) of finite blocks."""

    origin: torch.Tensor  # float32 value: the end of largest magnitude, where grids start
    direction: torch.Tensor  # ±1: from origin towards the other end
    far_abs: torch.Tensor  # magnitude of the other end
    span: torch.Tensor  # max - min
    top: torch.Tensor  # largest magnitude
    same_sign: torch.Tensor
    sigma: torch.Tensor  # float32 spacing at the smallest magnitude: every value is a multiple

    @classmethod
    def of(cls, x: torch.Tensor) -> _Blocks:
        lo, hi = x.amin(1).double(), x.amax(1).double()
        hi_is_origin = hi.abs() >= lo.abs()
        return cls(
            origin=torch.where(hi_is_origin, hi, lo),
            direction=torch.where(hi_is_origin, -1.0, 1.0).to(lo),
            far_abs=torch.where(hi_is_origin, lo, hi).abs(),
            span=hi - lo,
            top=torch.maximum(hi.abs(), lo.abs()),
            same_sign=(lo >= 0) | (hi <= 0),
            sigma=_ulp32(x.abs().amin(1).double()),
        )

    def uniform_error(self, step: torch.Tensor) -> torch.Tensor:
        """Bound on the decoded error of the uniform grid: quantisation (with float64 slack on the
        code) plus float32 rounding at the largest magnitude a used grid point can reach."""
        reach = torch.where(self.same_sign, torch.maximum(self.top, step), torch.maximum(self.top, self.far_abs + step))
        return step * (0.5 + 2.0**-33) + _ulp32(reach * (1 + 2.0**-40)) * (0.5 + 2.0**-28)

    def step_for_bound(self, bound: torch.Tensor) -> torch.Tensor:
        """The largest header step whose uniform grid provably meets ``bound`` (0 when float32 rounding
        alone eats the bound): with it, ``uniform_error <= bound·(1 - 2**-45)``."""
        rounding = _ulp32((self.top + 2 * bound) * (1 + 2.0**-40)) * (1 + 2.0**-27)  # covers every reach <= 2·bound
        target = torch.where(rounding <= 2 * bound * (1 - 2.0**-25), (2 * bound - rounding) * (1 - 2.0**-20), 0.0)
        return _round_step(target.clamp(max=2.0**256), up=False)

    def uniform_codes(self, step: torch.Tensor) -> torch.Tensor:
        """Upper bound on the largest code of the uniform grid (inf when the step is 0 but the span isn't)."""
        ratio = torch.where(self.span > 0, self.span / step, 0.0)
        return torch.floor(ratio * (1 + 2.0**-40) + 0.5)

    def coarse_origin(self) -> torch.Tensor:
        """The origin rounded away from zero to a multiple of 2σ (exact in float64)."""
        return torch.sign(self.origin) * torch.ceil(self.origin.abs() / (2 * self.sigma)) * (2 * self.sigma)


@dataclass
class _Grids:
    """The three candidate grids of every block, with the largest code each would need."""

    blocks: _Blocks
    limit: torch.Tensor  # the bound, less the margin that covers float64 rounding of the checks
    step_bound: torch.Tensor  # uniform grid step aimed at the bound
    coarse_origin: torch.Tensor  # lattice grid of step 2σ (error σ) starts here
    coarse_codes: torch.Tensor  # inf where that grid cannot meet the bound
    fine_codes: torch.Tensor  # lattice grid of step σ: exact

    @classmethod
    def of(cls, blocks: _Blocks, bound: torch.Tensor) -> _Grids:
        limit = bound * _CHECK_MARGIN
        sigma2 = 2 * blocks.sigma
        coarse_origin = blocks.coarse_origin()
        reach = torch.maximum(coarse_origin.abs(), blocks.far_abs + sigma2)
        coarse_ok = (blocks.sigma <= limit) & (_ulp32(reach) <= sigma2) & (reach <= FLT_MAX)
        coarse_codes = torch.ceil((coarse_origin - blocks.origin).abs() / sigma2 + blocks.span / sigma2)
        return cls(blocks, limit, blocks.step_for_bound(bound), coarse_origin,
                   torch.where(coarse_ok, coarse_codes, math.inf), blocks.span / blocks.sigma)

    def uniform_ok(self, step: torch.Tensor) -> torch.Tensor:
        return (self.blocks.span == 0) | ((step > 0) & (self.blocks.uniform_error(step) <= self.limit))

    def needed_bits(self) -> torch.Tensor:
        """Bits of each block's cheapest grid that meets the bound (33: none within 32 bits)."""
        uniform = torch.where(self.uniform_ok(self.step_bound), self.blocks.uniform_codes(self.step_bound), math.inf)
        return _bitlen(torch.minimum(torch.minimum(uniform, self.coarse_codes), self.fine_codes))

    def choose(self, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(origin, signed step, is_lattice, ok) per block for ``bits``-bit codes: the uniform grid when
        it fits (made finer than the bound asks when the width allows), else a lattice grid."""
        blocks, top_code = self.blocks, float(2**bits - 1)
        fit = _round_step(blocks.span / top_code, up=True) if bits else torch.full_like(blocks.span, math.inf)
        step = torch.minimum(self.step_bound, torch.where(blocks.span > 0, fit, 0.0))
        uniform = self.uniform_ok(step) & (blocks.uniform_codes(step) <= top_code)
        coarse, fine = self.coarse_codes <= top_code, self.fine_codes <= top_code
        origin = torch.where(uniform | ~coarse, blocks.origin, self.coarse_origin)
        magnitude = torch.where(uniform, step, torch.where(coarse, 2 * blocks.sigma, blocks.sigma))
        return origin, magnitude * blocks.direction, ~uniform & (coarse | fine), uniform | coarse | fine


def fixed_width(config: ErrorBoundConfig) -> int:
    """Bits a fixed-width codec needs to guarantee the tightest bound its schedule and table scales
    can reach (``RAW_BITS`` when that is more than 16); ``config.bits`` if given and enough."""
    tightest = config.eb * config.schedule.floor * min(config.table_scales or (1.0,))
    if config.mode is BoundMode.REL:
        needed = math.ceil(math.log2(1 / tightest + 2))
        while 2**needed - 1 < 1 / tightest + 1:  # guard against log2 rounding down
            needed += 1
    elif config.value_range is None:
        raise ValueError("mode='abs' with packing='fixed' cannot guarantee the bound without knowing the "
                         "data range: declare value_range=(lo, hi), or use packing='agreed'")
    else:
        lo, hi = config.value_range
        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            raise ValueError(f"value_range must be finite (lo, hi) with lo <= hi, got {config.value_range}")
        top = torch.tensor([max(abs(lo), abs(hi))], dtype=torch.float64)
        worst = _Blocks(origin=top, direction=torch.ones_like(top), far_abs=top, span=top.new_tensor([hi - lo]),
                        top=top, same_sign=torch.tensor([False]), sigma=torch.ones_like(top))
        bound = top.new_tensor([tightest])
        step = worst.step_for_bound(bound)
        if not bool(step > 0) or not bool(worst.uniform_error(step) <= bound * _CHECK_MARGIN):
            raise ValueError(f"eb={tightest:g} is below float32 resolution over value_range {config.value_range}")
        needed = int(_bitlen(worst.uniform_codes(step)))
    if needed > MAX_PACKED_BITS:
        return RAW_BITS
    if config.bits is not None and config.bits < needed:
        raise ValueError(f"bits={config.bits} cannot guarantee the bound {tightest:g} with packing='fixed': "
                         f"it needs {needed} (one guard bit covers float32 rounding); raise bits or use 'agreed'")
    return config.bits or needed


# ---- bit-planes ----------------------------------------------------------------------------------


def _transpose_bytes(rows: torch.Tensor) -> torch.Tensor:
    """Transpose each 8x8 bit matrix (8 bytes, bit ``j`` of byte ``i`` -> bit ``i`` of byte ``j``):
    (..., 8) uint8 -> (..., 8) uint8, as three shift-and-mask rounds on int64 words (an involution)."""
    x = rows.contiguous().view(-1).view(torch.int64)
    for shift, mask in ((7, 0x00AA00AA00AA00AA), (14, 0x0000CCCC0000CCCC), (28, 0x00000000F0F0F0F0)):
        t = (x ^ (x >> shift)) & mask  # the masks drop the sign bits an arithmetic shift brings in
        x = x ^ t ^ (t << shift)
    return x.view(torch.uint8).view(rows.shape)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(n, block) int32 codes -> (n, bits * ceil(block / 8)) uint8: bit-plane ``j`` holds bit ``j``
    of every code, code ``i`` at bit ``i % 8`` of byte ``i // 8``."""
    n, block = codes.shape
    codes = torch.nn.functional.pad(codes, (0, -block % 8)).view(n, -1, 8)
    planes = [_transpose_bytes((codes >> 8 * half).to(torch.uint8)) for half in range(math.ceil(bits / 8))]
    planes_by_bit = torch.cat(planes, 2).transpose(1, 2) if planes else codes.new_empty(n, 0, codes.shape[1])
    return planes_by_bit[:, :bits].reshape(n, bits * codes.shape[1]).to(torch.uint8)


def _unpack(payload: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Inverse of :func:`_pack`: (n, bits * ceil(block / 8)) uint8 -> (n, block) int32."""
    n, words = payload.shape[0], math.ceil(block / 8)
    planes = payload.reshape(n, bits, words).transpose(1, 2)
    codes = torch.zeros(n, words, 8, dtype=torch.int32, device=payload.device)
    for half in range(math.ceil(bits / 8)):
        byte_planes = torch.nn.functional.pad(planes[:, :, 8 * half: 8 * half + 8], (0, 8 - min(8, bits - 8 * half)))
        codes |= _transpose_bytes(byte_planes).to(torch.int32) << 8 * half
    return codes.view(n, -1)[:, :block]


def _codes(x: torch.Tensor, origin: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """Nearest grid code of every element (float64 arithmetic, as :class:`_Grids` assumes)."""
    inverse = torch.where(step != 0, 1 / step, 0.0).unsqueeze(1)  # exact for the power-of-2 lattice steps
    scaled = (x.double() - origin.unsqueeze(1)).mul_(inverse).round_()
    return scaled.clamp_(0, 2**bits - 1).to(torch.int32)


# ---- the codec -----------------------------------------------------------------------------------


class ErrorBoundedCodec(CustomCodec):
    """TorchRec ``QuantizedCommCodec`` with a guaranteed per-element error bound (module docstring)."""

    def __init__(self, config: ErrorBoundConfig, process_group: dist.ProcessGroup | None = None,
                 name: str = "") -> None:
        self.config = config
        self.name = name
        self._group = process_group
        self._factor = 1.0
        self._best_loss: float | None = None
        self._stalled = 0
        self._scales = torch.tensor(config.table_scales or (1.0,), dtype=torch.float64)
        self.stats = CompressionStats()
        self.nonfinite_count = 0  # lifetime count of NaN/Inf elements given to encode; never reset
        self._warned: set[str] = set()
        self._fixed_bits = fixed_width(config) if config.packing is Packing.FIXED else None
        if self._fixed_bits == RAW_BITS:
            self._warn_once("raw", f"{name}: the bound needs more than {MAX_PACKED_BITS} bits: "
                            "messages go as raw float32 (lossless)")

    def stats_dict(self) -> dict[str, float]:
        return self.stats.as_dict()

    def set_block_size(self, block_size: int) -> None:
        """Re-block before the first message, e.g. to divide every rank's embedding dim sum."""
        self.config = dataclasses.replace(self.config, block_size=block_size)
        self._fixed_bits = fixed_width(self.config) if self.config.packing is Packing.FIXED else None

    # -- the bound in force --

    def set_iteration(self, step: int, loss: float | None = None) -> None:
        """Advance the per-iteration schedule, once per training step. Ranks may disagree (e.g. local
        losses): the width is agreed or fixed, and the receiver reads each block's grid from its header."""
        schedule = self.config.schedule
        if schedule.kind is ScheduleKind.LINEAR_DECAY:
            decayed = 1 - (1 - schedule.min_factor) * min(step / schedule.decay_steps, 1.0)
            self._factor = max(schedule.min_factor, decayed)  # never below the floor fixed widths assume
        elif schedule.kind is ScheduleKind.FEEDBACK and loss is not None and math.isfinite(loss):
            if self._best_loss is None or loss < self._best_loss - schedule.min_delta * abs(self._best_loss):
                self._best_loss, self._stalled = loss, 0
            else:
                self._stalled += 1
                if self._stalled >= schedule.patience:
                    self._factor, self._stalled = max(schedule.min_factor, self._factor * schedule.tighten), 0

    def bound_in_force(self, column_block: int = 0) -> float:
        """The bound now for a column block: absolute (abs) or the fraction of the block range (rel)."""
        scales = self.config.table_scales or (1.0,)
        return self.config.eb * self._factor * scales[column_block % len(scales)]

    def set_table_scales(self, table_scales: Sequence[float]) -> None:
        """Replace the per-column-block multipliers (e.g. from fresh table statistics)."""
        config = dataclasses.replace(self.config, table_scales=tuple(table_scales))
        if config.packing is Packing.FIXED and fixed_width(config) > self._fixed_bits:
            raise ValueError(f"these scales need more than the {self._fixed_bits} bits the codec was built with; "
                             "every rank sizes messages with that width, so it cannot change mid-run")
        self.config, self._scales = config, torch.tensor(config.table_scales, dtype=torch.float64)

    def reset_stats(self) -> None:
        self.stats = CompressionStats()

    # -- QuantizedCommCodec interface --

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.uint8

    def create_context(self) -> ErrorBoundedContext:
        return ErrorBoundedContext(bits=self._fixed_bits)

    def padded_size(self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int,
                    qcomm_ctx: ErrorBoundedContext) -> tuple[int, int]:
        """No padding; records the row length so table scales find their column blocks."""
        if input_tensor.ndim == 1:
            return input_tensor.shape[0], 0
        if any(d % self.config.block_size for d in dim_per_rank):
            raise ValueError(f"block_size={self.config.block_size} must divide every rank's embedding dim sum "
                             f"{dim_per_rank}; use the gcd of the table dims")
        qcomm_ctx.row_len = input_tensor.shape[1]
        return input_tensor.shape[1], 0

    def calc_quantized_size(self, input_len: int, ctx: ErrorBoundedContext | None = None) -> int:
        return self._num_blocks(input_len) * bytes_per_block(self._bits_of(ctx), self.config.block_size)

    def encode(self, input_tensor: torch.Tensor, ctx: ErrorBoundedContext | None = None) -> torch.Tensor:
        if input_tensor.dtype != torch.float32:
            raise ValueError(f"the codec encodes float32 embeddings, got {input_tensor.dtype}")
        start = time.perf_counter()
        x = input_tensor.reshape(self._num_blocks(input_tensor.numel()), self.config.block_size)
        finite = torch.isfinite(x).all(1)
        all_finite = bool(finite.all())
        clean = x if all_finite else torch.where(finite.unsqueeze(1), x, 0.0)  # NaN/Inf blocks travel as NaN
        blocks = _Blocks.of(clean)
        bound = self._block_bounds(blocks, input_tensor, ctx)
        self._check_value_range(x, finite)
        bits = self._message_bits(blocks, bound, finite, ctx)
        if bits == RAW_BITS:
            message = x.reshape(-1).view(torch.uint8)
            lattice = torch.zeros((), dtype=torch.int64)
        else:
            origin, step, is_lattice, ok = _Grids.of(blocks, bound).choose(bits)
            if not bool(ok[finite].all()):  # the guard-bit argument says this cannot happen
                raise RuntimeError(f"{self.name}: no {bits}-bit grid meets the bound; please report this input")
            codes = _codes(clean, origin, step, bits)
            if not all_finite:
                origin, step = torch.where(finite, origin, math.nan), torch.where(finite, step, 0.0)
            header = torch.stack([origin.float().view(torch.int32), (step.view(torch.int64) >> 32).to(torch.int32)], 1)
            message = torch.cat([header.view(torch.uint8), _pack(codes, bits)], 1).view(-1)
            lattice = (is_lattice & finite).sum()
        self._sync(x)
        self._record_encode(x, finite, all_finite, bits, message, lattice, time.perf_counter() - start)
        if self.config.measure_error:
            self._measure(x, finite, bound, message, bits)
        return message

    def decode(self, input_grad: torch.Tensor, ctx: ErrorBoundedContext | None = None) -> torch.Tensor:
        start = time.perf_counter()
        output = self._decode(input_grad, self._bits_of(ctx))
        self._sync(output)
        self.stats.decode_calls += 1
        self.stats.decoded_bytes += 4 * output.numel()
        self.stats.decode_seconds += time.perf_counter() - start
        return output

    def required_bits(self, input_tensor: torch.Tensor, row_len: int | None = None) -> int:
        """The width this tensor alone needs under agreed packing (before the exchange)."""
        x = input_tensor.reshape(self._num_blocks(input_tensor.numel()), self.config.block_size)
        finite = torch.isfinite(x).all(1)
        blocks = _Blocks.of(torch.where(finite.unsqueeze(1), x, 0.0))
        bound = self._block_bounds(blocks, input_tensor, ErrorBoundedContext(row_len=row_len))
        return self._local_bits(blocks, bound, finite)

    # -- internals --

    def _num_blocks(self, length: int) -> int:
        if length % self.config.block_size:
            raise ValueError(f"length {length} is not a multiple of block_size={self.config.block_size}: every "
                             "rank's embedding dim sum must be a multiple of it (use the gcd of the table dims)")
        return length // self.config.block_size

    def _bits_of(self, ctx: ErrorBoundedContext | None) -> int:
        if self._fixed_bits is not None:
            return self._fixed_bits
        if ctx is None or ctx.bits is None:
            raise ValueError("packing='agreed' learns the width in encode: pass the context from create_context()")
        return ctx.bits

    def _block_bounds(self, blocks: _Blocks, x: torch.Tensor, ctx: ErrorBoundedContext | None) -> torch.Tensor:
        """Absolute bound of every block (float64)."""
        if self._scales.device != blocks.span.device:
            self._scales = self._scales.to(blocks.span.device)  # once, not a copy per collective
        scales = self._scales
        if self.config.table_scales is not None:
            row_len = x.shape[1] if x.ndim == 2 else (ctx.row_len if ctx is not None else None)
            row_len = row_len or len(scales) * self.config.block_size
            if row_len != len(scales) * self.config.block_size:
                raise ValueError(f"{len(scales)} table scales (column blocks) do not match rows of {row_len} values")
        scale = scales[torch.arange(blocks.span.numel(), device=scales.device) % len(scales)]
        bound = self.config.eb * self._factor * scale
        return bound * blocks.span if self.config.mode is BoundMode.REL else bound

    def _check_value_range(self, x: torch.Tensor, finite: torch.Tensor) -> None:
        if self.config.mode is BoundMode.ABS and self.config.packing is Packing.FIXED:
            lo, hi = self.config.value_range
            inside = ((x >= lo) & (x <= hi)) | ~torch.isfinite(x)
            if not bool(inside.all()):
                raise ValueError(f"{self.name}: values outside the declared value_range {self.config.value_range}; "
                                 "the fixed width cannot guarantee the bound for them")

    def _local_bits(self, blocks: _Blocks, bound: torch.Tensor, finite: torch.Tensor) -> int:
        needed = _Grids.of(blocks, bound).needed_bits()
        local = int(torch.where(finite, needed, 0).max()) if needed.numel() else 0
        return RAW_BITS if local > MAX_PACKED_BITS else local

    def _message_bits(self, blocks: _Blocks, bound: torch.Tensor, finite: torch.Tensor,
                      ctx: ErrorBoundedContext | None) -> int:
        if self._fixed_bits is not None:
            return self._fixed_bits
        if ctx is None:
            raise ValueError("packing='agreed' stores the agreed width in the context: pass create_context()")
        bits = self._local_bits(blocks, bound, finite)
        group = self._group if self._group is not None else (dist.group.WORLD if dist.is_initialized() else None)
        if group is not None:
            # The one size exchange: every rank must size every chunk with the same width.
            width = torch.tensor([bits], dtype=torch.int32, device=blocks.span.device)
            dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)
            bits = int(width.item())
        if bits == RAW_BITS:
            self._warn_once("raw", "a block needs more than 16 bits for its bound: message sent as raw float32")
        ctx.bits = bits
        return bits

    def _decode(self, message: torch.Tensor, bits: int) -> torch.Tensor:
        block = self.config.block_size
        if bits == RAW_BITS:
            message = message if message.storage_offset() % 4 == 0 else message.clone()
            return message.view(torch.float32)
        width = bytes_per_block(bits, block)
        if message.numel() % width:
            raise ValueError(f"{message.numel()} bytes are not whole {width}-byte blocks of {bits}-bit codes")
        rows = message.view(-1, width)
        header = rows[:, :HEADER_BYTES].contiguous().view(torch.int32)
        origin = header[:, :1].view(torch.float32).double()
        step = (header[:, 1:].to(torch.int64) << 32).view(torch.float64)
        codes = _unpack(rows[:, HEADER_BYTES:], bits, block).double()
        values = torch.addcmul(origin, codes, step)
        return values.clamp_(-FLT_MAX, FLT_MAX).float().view(-1)

    def _record_encode(self, x: torch.Tensor, finite: torch.Tensor, all_finite: bool, bits: int,
                       message: torch.Tensor, lattice: torch.Tensor, seconds: float) -> None:
        stats = self.stats
        nonfinite = 0 if all_finite else int((~torch.isfinite(x)).sum())
        stats.encode_calls += 1
        stats.bytes_in += 4 * x.numel()
        stats.bytes_out += message.numel()
        stats.nonfinite_elements += nonfinite
        stats.nonfinite_blocks += int((~finite).sum())
        stats.lattice_blocks += int(lattice)
        stats.raw_messages += bits == RAW_BITS
        stats.last_bits = bits
        stats.encode_seconds += seconds
        self.nonfinite_count += nonfinite
        if nonfinite:
            self._warn_once("nonfinite", f"{self.name}: NaN/Inf in the input; their blocks are sent as NaN")

    def _measure(self, x: torch.Tensor, finite: torch.Tensor, bound: torch.Tensor, message: torch.Tensor,
                 bits: int) -> None:
        start = time.perf_counter()
        decoded = self._decode(message, bits).view_as(x)
        error = torch.where(finite.unsqueeze(1), decoded.double() - x.double(), 0.0).abs_()
        worst = error.amax(1)
        ratio = torch.where(bound > 0, worst / bound, torch.where(worst > 0, math.inf, 0.0))
        stats = self.stats
        if error.numel():
            stats.max_abs_error = max(stats.max_abs_error, float(worst.max()))
            stats.max_error_over_bound = max(stats.max_error_over_bound, float(ratio.max()))
        stats.sum_abs_error += float(error.sum())
        stats.measured_elements += int(finite.sum()) * x.shape[1]
        stats.bound_violations += int((error > bound.unsqueeze(1)).sum())
        stats.measure_seconds += time.perf_counter() - start

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    @staticmethod
    def _sync(tensor: torch.Tensor) -> None:
        if tensor.device.type == "cuda":
            torch.cuda.synchronize(tensor.device)  # time kernels, not launches


_OPTION_DEFAULTS: dict[str, Any] = {
    "mode": "rel", "eb": 1e-2, "packing": "fixed", "bits": None, "block_size": None, "schedule": "constant",
    "schedule_decay_steps": 10_000, "schedule_min_factor": 0.1, "schedule_patience": 50, "schedule_tighten": 0.5,
    "table_scales": None, "value_range": None, "measure_error": True,
    "backward_mode": "rel", "backward_eb": 1e-2, "backward_bits": None, "backward_value_range": None,
}


def make_error_bounded_codecs(options: Mapping[str, Any], process_group: dist.ProcessGroup | None
                              ) -> QuantizedCommCodecs:
    """Forward (pooled embeddings) and backward (their gradients) codecs for TorchRec.

    Keys (defaults in ``_OPTION_DEFAULTS``): mode, eb, packing, bits, block_size, schedule and its
    ``schedule_*`` parameters, table_scales (forward only: column blocks of this rank's rows),
    value_range, measure_error, and backward_mode / backward_eb / backward_bits /
    backward_value_range (gradients have their own scale; a rel bound by default).
    """
    unknown = set(options) - set(_OPTION_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown compression options {sorted(unknown)}; known: {sorted(_OPTION_DEFAULTS)}")
    o = {**_OPTION_DEFAULTS, **options}
    schedule = BoundSchedule(kind=o["schedule"], decay_steps=o["schedule_decay_steps"],
                             min_factor=o["schedule_min_factor"], patience=o["schedule_patience"],
                             tighten=o["schedule_tighten"])
    # block_size None: "auto", fitted by the workload (fit_block_size) once the sharding plan is known
    common = {"packing": o["packing"], "block_size": o["block_size"] or 64, "schedule": schedule,
              "measure_error": o["measure_error"]}
    value_range = tuple(o["value_range"]) if o["value_range"] is not None else None
    backward_range = tuple(o["backward_value_range"]) if o["backward_value_range"] is not None else None
    forward = ErrorBoundConfig(mode=o["mode"], eb=o["eb"], bits=o["bits"], table_scales=o["table_scales"],
                               value_range=value_range, **common)
    backward = ErrorBoundConfig(mode=o["backward_mode"], eb=o["backward_eb"], bits=o["backward_bits"],
                                value_range=backward_range, **common)
    from torchrec.distributed.types import QuantizedCommCodecs

    codecs = QuantizedCommCodecs()
    codecs.forward = ErrorBoundedCodec(forward, process_group, name="forward")
    codecs.backward = ErrorBoundedCodec(backward, process_group, name="backward")
    codecs.forward.auto_block = codecs.backward.auto_block = o["block_size"] is None
    return codecs


CUSTOM_CODECS["eb"] = make_error_bounded_codecs  # workload.comm_codec=eb, workload.codec_options={...}
