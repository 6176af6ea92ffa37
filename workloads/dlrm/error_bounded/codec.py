"""Error-bounded lossy compression of the embedding all-to-all (SC'24 idea), as a TorchRec codec.

:class:`ErrorBoundedCodec` implements TorchRec's ``QuantizedCommCodec`` interface, so it compresses
the forward pooled-embedding all-to-all and the backward gradient all-to-all. Unlike FP16/INT8
codecs it bounds the error: every decoded element ``x̂`` of a finite block obeys
``|x - x̂| <= bound`` for the block's bound in force, where the bound is

* ``mode="abs"``: ``eb · table_scale · schedule_factor`` (absolute), or
* ``mode="rel"``: ``eb · table_scale · schedule_factor · (max - min of the block)``,
  every product evaluated in float64 (that number is what the guarantee is checked against).

Wire format and proof: every block is encoded on its own into ``8 + bits · ceil(block_size / 8)``
bytes, so a chunk's size follows from its element count (TorchRec computes split sizes before the
collective). Most blocks travel on a float32 grid encoded and decoded by fused kernels
(:mod:`workloads.dlrm.error_bounded.fast_kernels`: the format, and why the check it makes proves the bound); the
few that float32 rounding cannot carry take the exact float64 path (:mod:`workloads.dlrm.error_bounded.exact_grid`).
When the bound needs more than 16 bits the message is raw float32 (bit-exact, ``bits = 32``). A
block holding NaN or Inf is sent with a NaN origin, so it decodes to all-NaN (in a raw message they
travel as they are): never silently finite; they are counted (:attr:`ErrorBoundedCodec.nonfinite_count`).

One width per message: table scales tighten the bound of chosen tables, but the tightest table sets
the width (the others get the spare precision), so bytes fall only when all bounds loosen.

Table-wise bounds from the data: :class:`~workloads.dlrm.error_bounded.config.TableBounds`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # torchrec is imported where used: every cobench command imports all workloads
    from torchrec.distributed.types import QuantizedCommCodecs

from workloads.dlrm.codec_registry import CUSTOM_CODECS, CustomCodec
from workloads.dlrm.error_bounded import exact_grid, fast_kernels
from workloads.dlrm.error_bounded.config import (
    BoundMode,
    CodecOptions,
    ErrorBoundConfig,
    Packing,
    ScheduleKind,
    TableBounds,
)
from workloads.dlrm.error_bounded.exact_grid import MAX_PACKED_BITS, RAW_BITS
from workloads.dlrm.error_bounded.fast_kernels import HEADER_BYTES
from workloads.dlrm.error_bounded.stats import CompressionStats

logger = logging.getLogger(__name__)



@dataclass
class ErrorBoundedContext:
    """Per-collective state shared by encode, calc_quantized_size and decode."""

    bits: int | None = None  # the width of this message (agreed packing: after the exchange)
    row_len: int | None = None  # row length of the encoded (B, D) tensor, recorded by padded_size
    padded_dim_sum_per_rank: list[int] | None = None  # read by TorchRec; this codec never pads
    row_dim: int = -1  # read by TorchRec's variable-batch path; -1: no row-wise padding


def bytes_per_block(bits: int, block_size: int) -> int:
    """Encoded bytes of one block at this width (``RAW_BITS``: raw float32)."""
    if bits == RAW_BITS:
        return 4 * block_size
    return HEADER_BYTES + fast_kernels.payload_bytes(bits, block_size)


def _fixed_width(config: ErrorBoundConfig) -> int:
    """Bits a fixed-width codec needs for the tightest bound its schedule and table scales reach."""
    tightest = config.eb * config.schedule.floor * min(config.table_scales or (1.0,))
    return exact_grid.fixed_width(config.mode is BoundMode.REL, tightest, config.value_range, config.bits)


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
        self._scales_version = 0  # bumped whenever the scales change: the factor cache follows
        self._iteration = 0
        self._measured_at: int | None = None  # table_bounds='range': iteration of the last measurement
        self._factor_cache: tuple[Any, torch.Tensor, torch.Tensor] | None = None
        self.stats = CompressionStats()
        self.nonfinite_count = 0  # lifetime count of NaN/Inf elements given to encode; never reset
        self._warned: set[str] = set()
        self._fixed_bits = _fixed_width(config) if config.packing is Packing.FIXED else None
        if self._fixed_bits == RAW_BITS:
            self._warn_once("raw", f"{name}: the bound needs more than {MAX_PACKED_BITS} bits: "
                            "messages go as raw float32 (lossless)")

    def stats_dict(self) -> dict[str, float]:
        values = self.stats.as_dict()
        if self.config.table_bounds is TableBounds.RANGE and self._measured_at is not None:
            values["table_scale_min"], values["table_scale_max"] = (float(v) for v in torch.aminmax(self._scales))
        return values

    # -- the bound in force --

    def set_iteration(self, step: int, loss: float | None = None) -> None:
        """Advance the per-iteration schedule, once per training step. Ranks may disagree (e.g. local
        losses): the width is agreed or fixed, and the receiver reads each block's grid from its header."""
        self._iteration = step
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
        return self.config.eb * self._factor * float(self._scales[column_block % len(self._scales)])

    def set_table_scales(self, table_scales: Sequence[float]) -> None:
        """Replace the per-column-block multipliers (e.g. from fresh table statistics)."""
        config = dataclasses.replace(self.config, table_scales=tuple(table_scales))
        if config.packing is Packing.FIXED and _fixed_width(config) > self._fixed_bits:
            raise ValueError(f"these scales need more than the {self._fixed_bits} bits the codec was built with; "
                             "every rank sizes messages with that width, so it cannot change mid-run")
        self.config, self._scales = config, torch.tensor(config.table_scales, dtype=torch.float64)
        self._scales_version += 1

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
        if input_tensor.device.type == "cpu":
            fast_kernels.cpu_kernels()  # built or loaded once per process, before the clock starts
        start, exchanged = time.perf_counter(), self.stats.exchange_seconds
        x = input_tensor.reshape(self._num_blocks(input_tensor.numel()), self.config.block_size)
        self._check_value_range(x)
        minmax = fast_kernels.block_minmax(x) if self._fixed_bits is None else None  # agreed packing reads it
        if self.config.table_bounds is TableBounds.RANGE:
            self._measure_ranges(minmax, input_tensor, ctx)
        factor, factor32 = self._block_factors(x.shape[0], input_tensor, ctx)
        bits = self._message_bits(x, factor, ctx, minmax)
        counts = exact_lattice = None
        if bits == RAW_BITS:
            message = x.reshape(-1).view(torch.uint8)
        else:
            rows, status, errors, summary = fast_kernels.encode_fast(x, factor32, self._rel, bits)
            summary = summary.tolist()  # the one read: blocks sent, exact path, non-finite; error figures
            counts = [int(c) for c in summary[:3]]
            if counts[fast_kernels.STATUS_EXACT_PATH]:  # float32 rounding could not carry these: float64 grids can
                exact = (status == fast_kernels.STATUS_EXACT_PATH).nonzero().flatten()
                bound = self._bounds(x[exact], factor[exact])
                header, codes, exact_lattice = exact_grid.encode_exact(x[exact], bound, bits)
                rows[exact] = torch.cat([header.view(torch.uint8), fast_kernels.pack(codes, bits)], 1)
                errors = self._exact_path_errors(errors, exact, x, rows, bound, bits)
                summary = fast_kernels.summarise(status, errors).tolist()
            message = rows.view(-1)
        self._sync(message)
        seconds = time.perf_counter() - start - (self.stats.exchange_seconds - exchanged)
        self._record_encode(x, counts, exact_lattice, bits, message, seconds)
        if counts is not None:
            self._record_errors(summary, counts)
        if self.config.measure_error:
            self._measure(x, factor, message, bits)
        return message

    def _exact_path_errors(self, errors: torch.Tensor, exact: torch.Tensor, x: torch.Tensor, rows: torch.Tensor,
                           bound: torch.Tensor, bits: int) -> torch.Tensor:
        """``errors`` with the exact-path blocks' figures filled in (decoded as the receiver will)."""
        decoded = fast_kernels.decode_fast(rows[exact], bits, self.config.block_size).double()
        error = (decoded - x[exact].double()).abs()
        largest = error.amax(1)
        ratio = torch.where(bound > 0, largest / bound, torch.where(largest > 0, math.inf, 0.0))
        errors = errors.clone()
        errors[exact] = torch.stack([largest, ratio, error.sum(1)], 1).to(errors.dtype)
        return errors

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
        factor, _ = self._block_factors(x.shape[0], input_tensor, ErrorBoundedContext(row_len=row_len))
        return self._local_bits(x, factor)

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

    @property
    def _rel(self) -> bool:
        return self.config.mode is BoundMode.REL

    def _measure_ranges(self, minmax: tuple[torch.Tensor, torch.Tensor], input_tensor: torch.Tensor,
                        ctx: ErrorBoundedContext | None) -> None:
        """table_bounds='range': every column block's scale from the widest range (max - min) of its blocks
        in this message over the geometric mean of all (blocks with no range: 1), at the first message and
        every ``table_bounds_refresh`` iterations. A message without rows (no row length) keeps the scales."""
        due = self._measured_at is None or self._iteration - self._measured_at >= self.config.table_bounds_refresh
        row_len = input_tensor.shape[1] if input_tensor.ndim == 2 else (ctx.row_len if ctx is not None else None)
        if not due or not row_len or input_tensor.numel() < 2 * row_len:
            return
        lo, hi = (v.reshape(-1, row_len // self.config.block_size) for v in minmax)  # (rows, column blocks)
        widest = (hi.double() - lo.double()).nan_to_num(nan=0.0, posinf=0.0).amax(dim=0)
        positive = widest > 0
        if not bool(positive.any()):
            return
        mean = widest[positive].log().mean().exp()
        self._scales = torch.where(positive, widest / mean, 1.0).cpu()
        self._scales_version += 1
        self._measured_at = self._iteration

    def _block_factors(self, blocks: int, x: torch.Tensor, ctx: ErrorBoundedContext | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block's bound factor, float64 and float32 rounded down: eb · schedule factor · its
        table scale; the bound is that times the block's range (rel) or that (abs). Cached until the
        schedule or the scales change: small messages must not pay for rebuilding it."""
        if self.config.table_scales is not None:
            row_len = x.shape[1] if x.ndim == 2 else (ctx.row_len if ctx is not None else None)
            row_len = row_len or len(self._scales) * self.config.block_size
            if row_len != len(self._scales) * self.config.block_size:
                raise ValueError(f"{len(self._scales)} table scales (column blocks) do not match rows of "
                                 f"{row_len} values")
        key = (blocks, self._factor, self._scales_version, x.device)
        if self._factor_cache is None or self._factor_cache[0] != key:
            scales = self._scales.to(x.device)
            factor = self.config.eb * self._factor * scales[torch.arange(blocks, device=x.device) % len(scales)]
            self._factor_cache = (key, factor, fast_kernels.float32_below(factor))
        return self._factor_cache[1], self._factor_cache[2]

    def _bounds(self, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        """Absolute float64 bound of every (finite) block of ``x``: what the guarantee is checked against."""
        if not self._rel:
            return factor
        lo, hi = torch.aminmax(x, dim=1)
        return factor * (hi.double() - lo.double())

    def _check_value_range(self, x: torch.Tensor) -> None:
        if self.config.mode is BoundMode.ABS and self.config.packing is Packing.FIXED:
            lo, hi = self.config.value_range
            inside = ((x >= lo) & (x <= hi)) | ~torch.isfinite(x)
            if not bool(inside.all()):
                raise ValueError(f"{self.name}: values outside the declared value_range {self.config.value_range}; "
                                 "the fixed width cannot guarantee the bound for them")

    def _local_bits(self, x: torch.Tensor, factor: torch.Tensor,
                    minmax: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
        """The widest width a finite block of ``x`` needs (agreed packing), cheaply: where float32
        rounding is far below the bound (under 2**-10 of it: all but a few blocks), ``b =
        ceil(log2(range / (2 · bound · (1 - 2**-7)) + 1))`` bits give the float32 grid a step of at most
        ``2 · bound · (1 - 2**-7) · (1 + 2**(b - 23))``, whose error (half a step, a code rounding of
        ``2**(b - 22)`` steps, a float32 rounding of ``2**-11 · bound``) stays under the bound for
        ``b <= 14``; beyond, or should the kernel's check refuse a block, the exact path's uniform grid
        (step near ``2 · bound``) fits the same width. The other blocks get the exact float64 answer
        (:func:`exact_grid.needed_bits`). The encoder checks every block either way. ``minmax``: the
        blocks' min and max, when the caller has them."""
        lo, hi = minmax if minmax is not None else fast_kernels.block_minmax(x)
        if x.device.type == "cpu" and (kernels := fast_kernels.cpu_kernels()) is not None:  # the same, in one loop
            easy_bits, hard_mask = kernels.easy_width(lo, hi, factor.double().contiguous(), self._rel)
            needed, hard = int(easy_bits), hard_mask.nonzero().flatten()
            if hard.numel():
                bound = factor[hard] * (hi[hard].double() - lo[hard].double()) if self._rel else factor[hard]
                needed = max(needed, int(exact_grid.needed_bits(x[hard], bound).max()))
            return RAW_BITS if needed > MAX_PACKED_BITS else needed
        finite = torch.isfinite(lo) & torch.isfinite(hi)  # a NaN anywhere makes the block's min/max NaN
        if not bool(finite.all()):
            if not bool(finite.any()):
                return 0
            x, factor, lo, hi = x[finite], factor[finite], lo[finite], hi[finite]
        span = hi.double() - lo.double()
        bound = factor * span if self._rel else factor
        top = torch.maximum(lo.abs(), hi.abs()).double()
        rounding = (top + 2 * bound) * 2.0**-23  # at least the float32 spacing there
        easy = (rounding <= bound * 2.0**-10) & (bound > 0)
        codes = torch.where(easy, span / (2 * bound * (1 - 2.0**-7)), 0.0)
        needed = int(torch.ceil(torch.log2(codes + 1)).max()) if bool(easy.any()) else 0
        hard = (~easy).nonzero().flatten()
        if hard.numel():
            needed = max(needed, int(exact_grid.needed_bits(x[hard], bound[hard]).max()))
        return RAW_BITS if needed > MAX_PACKED_BITS else needed

    def _message_bits(self, x: torch.Tensor, factor: torch.Tensor, ctx: ErrorBoundedContext | None,
                      minmax: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
        if self._fixed_bits is not None:
            return self._fixed_bits
        if ctx is None:
            raise ValueError("packing='agreed' stores the agreed width in the context: pass create_context()")
        bits = self._local_bits(x, factor, minmax)
        group = self._group if self._group is not None else (dist.group.WORLD if dist.is_initialized() else None)
        if group is not None:
            # The one size exchange: every rank must size every chunk with the same width.
            width = torch.tensor([bits], dtype=torch.int32, device=x.device)
            started = time.perf_counter()
            dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)
            bits = int(width.item())
            self.stats.exchange_seconds += time.perf_counter() - started  # mostly waiting for the other ranks
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
        return fast_kernels.decode_fast(message.view(-1, width), bits, block).view(-1)

    def _record_encode(self, x: torch.Tensor, counts: list[int] | None, exact_lattice: torch.Tensor | None,
                       bits: int, message: torch.Tensor, seconds: float) -> None:
        stats = self.stats
        if counts is None:  # raw float32: NaN and Inf travel as they are
            nonfinite_blocks = int((~torch.isfinite(x).all(1)).sum())
        else:
            nonfinite_blocks = counts[fast_kernels.STATUS_NONFINITE]
        nonfinite = int((~torch.isfinite(x)).sum()) if nonfinite_blocks else 0
        stats.encode_calls += 1
        stats.bytes_in += 4 * x.numel()
        stats.bytes_out += message.numel()
        stats.nonfinite_elements += nonfinite
        stats.nonfinite_blocks += nonfinite_blocks
        if exact_lattice is not None:
            stats.exact_path_blocks += exact_lattice.numel()
            stats.lattice_blocks += int(exact_lattice.sum())
        stats.raw_messages += bits == RAW_BITS
        stats.last_bits = bits
        stats.encode_seconds += seconds
        self.nonfinite_count += nonfinite
        if nonfinite:
            self._warn_once("nonfinite", f"{self.name}: NaN/Inf in the input; their blocks are sent as NaN")

    def _record_errors(self, summary: list[float], counts: list[int]) -> None:
        """Error figures of the finite blocks, from the encoder's own per-block figures (no second pass)."""
        stats = self.stats
        largest, ratio, total = summary[3:]
        stats.max_abs_error = max(stats.max_abs_error, largest)
        stats.max_error_over_bound = max(stats.max_error_over_bound, ratio)
        stats.sum_abs_error += total
        finite_blocks = counts[fast_kernels.STATUS_SENT] + counts[fast_kernels.STATUS_EXACT_PATH]
        stats.measured_elements += finite_blocks * self.config.block_size
        stats.bound_violations += int(ratio > 1)  # a block over its bound (never, by construction)

    def _measure(self, x: torch.Tensor, factor: torch.Tensor, message: torch.Tensor, bits: int) -> None:
        """``measure_error``: decode the whole message again and check every element against its float64
        bound, independently of the encoder's own figures (slow; for tests and audits)."""
        start = time.perf_counter()
        decoded = self._decode(message, bits).view_as(x)
        finite = torch.isfinite(x).all(1)
        clean = torch.where(finite.unsqueeze(1), x, 0.0)
        bound = self._bounds(clean, factor)
        error = torch.where(finite.unsqueeze(1), decoded.double() - clean.double(), 0.0).abs_()
        worst = error.amax(1)
        ratio = torch.where(bound > 0, worst / bound, torch.where(worst > 0, math.inf, 0.0))
        stats = self.stats
        if error.numel():
            stats.max_error_over_bound = max(stats.max_error_over_bound, float(ratio.max()))
        stats.verified_elements += int(finite.sum()) * x.shape[1]
        stats.bound_violations += int((error > bound.unsqueeze(1)).sum())
        stats.measure_seconds += time.perf_counter() - start

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    @staticmethod
    def _sync(tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":
            torch.accelerator.synchronize(tensor.device)  # time kernels, not launches (any accelerator)


def make_error_bounded_codecs(options: Mapping[str, Any], process_group: dist.ProcessGroup | None
                              ) -> QuantizedCommCodecs:
    """Forward (pooled embeddings) and backward (their gradients) codecs for TorchRec, from
    :class:`CodecOptions` keys."""
    forward, backward = CodecOptions.of(options).configs()
    from torchrec.distributed.types import QuantizedCommCodecs

    codecs = QuantizedCommCodecs()
    codecs.forward = ErrorBoundedCodec(forward, process_group, name="forward")
    codecs.backward = ErrorBoundedCodec(backward, process_group, name="backward")
    return codecs


CUSTOM_CODECS["eb"] = make_error_bounded_codecs  # workload.comm_codec=eb, workload.codec_options={...}
