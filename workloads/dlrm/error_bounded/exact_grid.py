"""The error-bounded codec's exact path: float64 grids for the blocks float32 arithmetic cannot carry.

Most blocks travel on the fast float32 grid (:mod:`workloads.dlrm.error_bounded.fast_kernels`). A block fails
there when float32 rounding eats its bound (nearly constant far from zero, subnormals) or its
range overflows; this path re-encodes it. Its header: ``origin`` as float32 (the block end of
largest magnitude) and the step as the high word of a float64 with the sign bit set (21
significant bits with float64's range, so no step is lost to float32 subnormals or overflow); the
step points from the origin towards zero. Decoding is ``float32(clamp(origin + code · step,
±FLT_MAX))`` in float64, where ``code · step`` is exact, so every device decodes the same bits.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_PACKED_BITS = 16
RAW_BITS = 32  # the width recorded when a message travels as raw float32
FLT_MAX = float(torch.finfo(torch.float32).max)
_CHECK_MARGIN = 1 - 2.0**-50  # a computed error must stay below bound·margin: covers float64 rounding


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
class Blocks:
    """Per-block geometry (float64 unless noted) of finite blocks."""

    origin: torch.Tensor  # float32 value: the end of largest magnitude, where grids start
    direction: torch.Tensor  # ±1: from origin towards the other end
    far_abs: torch.Tensor  # magnitude of the other end
    span: torch.Tensor  # max - min
    top: torch.Tensor  # largest magnitude
    same_sign: torch.Tensor
    sigma: torch.Tensor  # float32 spacing at the smallest magnitude: every value is a multiple

    @classmethod
    def of(cls, x: torch.Tensor) -> Blocks:
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
class Grids:
    """The three candidate grids of every block, with the largest code each would need."""

    blocks: Blocks
    limit: torch.Tensor  # the bound, less the margin that covers float64 rounding of the checks
    step_bound: torch.Tensor  # uniform grid step aimed at the bound
    coarse_origin: torch.Tensor  # lattice grid of step 2σ (error σ) starts here
    coarse_codes: torch.Tensor  # inf where that grid cannot meet the bound
    fine_codes: torch.Tensor  # lattice grid of step σ: exact

    @classmethod
    def of(cls, blocks: Blocks, bound: torch.Tensor) -> Grids:
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


def fixed_width(rel: bool, tightest: float, value_range: tuple[float, float] | None, bits: int | None) -> int:
    """Bits a fixed-width codec needs to guarantee the ``tightest`` bound it can be asked for
    (``RAW_BITS`` when that is more than 16); ``bits`` if given and enough."""
    if rel:
        needed = math.ceil(math.log2(1 / tightest + 2))
        while 2**needed - 1 < 1 / tightest + 1:  # guard against log2 rounding down
            needed += 1
    elif value_range is None:
        raise ValueError("mode='abs' with packing='fixed' cannot guarantee the bound without knowing the "
                         "data range: declare value_range=(lo, hi), or use packing='agreed'")
    else:
        lo, hi = value_range
        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            raise ValueError(f"value_range must be finite (lo, hi) with lo <= hi, got {value_range}")
        top = torch.tensor([max(abs(lo), abs(hi))], dtype=torch.float64)
        worst = Blocks(origin=top, direction=torch.ones_like(top), far_abs=top, span=top.new_tensor([hi - lo]),
                        top=top, same_sign=torch.tensor([False]), sigma=torch.ones_like(top))
        bound = top.new_tensor([tightest])
        step = worst.step_for_bound(bound)
        if not bool(step > 0) or not bool(worst.uniform_error(step) <= bound * _CHECK_MARGIN):
            raise ValueError(f"eb={tightest:g} is below float32 resolution over value_range {value_range}")
        needed = int(_bitlen(worst.uniform_codes(step)))
    if needed > MAX_PACKED_BITS:
        return RAW_BITS
    if bits is not None and bits < needed:
        raise ValueError(f"bits={bits} cannot guarantee the bound {tightest:g} with packing='fixed': "
                         f"it needs {needed} (one guard bit covers float32 rounding); raise bits or use 'agreed'")
    return bits or needed


def grid_codes(x: torch.Tensor, origin: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """Nearest grid code of every element (float64 arithmetic, as :class:`Grids` assumes)."""
    inverse = torch.where(step != 0, 1 / step, 0.0).unsqueeze(1)  # exact for the power-of-2 lattice steps
    scaled = (x.double() - origin.unsqueeze(1)).mul_(inverse).round_()
    return scaled.clamp_(0, 2**bits - 1).to(torch.int32)



def encode_exact(x: torch.Tensor, bound: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(header words (n, 2) int32, codes (n, block) int32, is_lattice (n,)) of finite blocks ``x`` for
    their float64 ``bound``; raises when no ``bits``-bit grid meets it (the guard bit says it cannot)."""
    blocks = Blocks.of(x)
    origin, step, is_lattice, ok = Grids.of(blocks, bound).choose(bits)
    if not bool(ok.all()):
        raise RuntimeError(f"no {bits}-bit grid meets the bound; please report this input")
    codes = grid_codes(x, origin, step, bits)
    word = ((-step.abs()).view(torch.int64) >> 32).to(torch.int32)  # sign bit set: the exact path's block
    return torch.stack([origin.float().view(torch.int32), word], 1), codes, is_lattice


def needed_bits(x: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Bits each finite block of ``x`` needs for its float64 ``bound`` (33: more than 32)."""
    return Grids.of(Blocks.of(x), bound).needed_bits()
