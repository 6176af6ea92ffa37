"""The error-bounded codec's settings: the bound's mode and size, packing, the per-iteration schedule and
the table-wise bounds (:class:`ErrorBoundConfig`), and ``workload.codec_options`` read into a forward and a
backward config (:class:`CodecOptions`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum, StrEnum
from typing import Any

from workloads.dlrm.error_bounded.exact_grid import MAX_PACKED_BITS


class BoundMode(StrEnum):
    ABS = "abs"
    REL = "rel"


class Packing(StrEnum):
    AGREED = "agreed"
    FIXED = "fixed"


class TableBounds(StrEnum):
    """How each table's bound is set.

    Table-wise bounds from the data (``table_bounds="range"``, abs mode, agreed packing): the codec
    measures each column block's value range (the widest range of its blocks in the message: of a
    table's pooled embeddings, when the block is the table's dim) and scales that block's absolute
    bound by it, normalised to a geometric mean of 1, so ``eb`` stays the bound of a table of typical
    range. A uniform absolute bound is needlessly tight on wide tables and the width follows the
    widest; bounds in proportion to each table's range ask every table for the same relative precision,
    and the one width follows the typical table (log2(widest / geometric mean) bits fewer). Measured
    at every message by default (from the blocks' min and max, which the width needs anyway), or every
    ``table_bounds_refresh`` iterations (the iteration-wise schedule multiplies on top). Each rank
    measures the tables it sends; the receiver reads every block's grid from its header, so nothing else
    needs to agree.
    """

    UNIFORM = "uniform"  # eb (times any declared table_scales) for every table
    RANGE = "range"  # eb times each table's measured value range over the geometric mean of all (abs mode)


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
    measure_error: bool = False  # also decode every message again and check each element (slow)
    table_bounds: TableBounds = TableBounds.UNIFORM
    table_bounds_refresh: int = 1  # iterations between measurements of the tables' ranges (1: every one)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _parse(BoundMode, self.mode, "mode"))
        object.__setattr__(self, "packing", _parse(Packing, self.packing, "packing"))
        object.__setattr__(self, "table_bounds", _parse(TableBounds, self.table_bounds, "table_bounds"))
        if self.table_bounds is TableBounds.RANGE:
            if self.mode is not BoundMode.ABS or self.packing is not Packing.AGREED:
                raise ValueError("table_bounds='range' scales absolute bounds by each table's measured range: it "
                                 "needs mode='abs' and packing='agreed' (a rel bound already follows each block's "
                                 "range; a fixed width cannot follow measured data)")
            if self.table_scales is not None:
                raise ValueError("table_bounds='range' measures the table scales: do not also set table_scales")
            if self.table_bounds_refresh < 1:
                raise ValueError(f"table_bounds_refresh must be >= 1, got {self.table_bounds_refresh}")
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


@dataclass(frozen=True)
class CodecOptions:
    """``workload.codec_options`` of ``comm_codec=eb``: the forward codec's settings (pooled
    embeddings), the schedule's, and the backward codec's own bound (gradients have their own scale).
    Defaults are the fields'; unknown keys are refused by name."""

    mode: str = BoundMode.REL.value
    eb: float = 1e-2
    packing: str = Packing.FIXED.value
    bits: int | None = None
    block_size: int | None = None  # None: 64, or what DLRM passes (codec_registry.auto_block_size)
    schedule: str = ScheduleKind.CONSTANT.value
    schedule_decay_steps: int = BoundSchedule.decay_steps
    schedule_min_factor: float = BoundSchedule.min_factor
    schedule_patience: int = BoundSchedule.patience
    schedule_tighten: float = BoundSchedule.tighten
    table_scales: tuple[float, ...] | None = None  # forward only: column blocks of this rank's rows
    value_range: tuple[float, float] | None = None
    measure_error: bool = False  # also decode every message again and check each element (slow)
    table_bounds: str = TableBounds.UNIFORM.value  # forward only: 'range' = bounds from each table's range
    table_bounds_refresh: int = ErrorBoundConfig.table_bounds_refresh
    backward_mode: str = BoundMode.REL.value
    backward_eb: float = 1e-2
    backward_bits: int | None = None
    backward_value_range: tuple[float, float] | None = None

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> CodecOptions:
        known = {f.name for f in fields(cls)}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown compression options {sorted(unknown)}; known: {sorted(known)}")
        return cls(**options)

    def configs(self) -> tuple[ErrorBoundConfig, ErrorBoundConfig]:
        """(forward, backward) codec configs."""
        schedule = BoundSchedule(kind=self.schedule, decay_steps=self.schedule_decay_steps,
                                 min_factor=self.schedule_min_factor, patience=self.schedule_patience,
                                 tighten=self.schedule_tighten)
        common = {"packing": self.packing, "block_size": self.block_size or ErrorBoundConfig.block_size,
                  "schedule": schedule, "measure_error": self.measure_error}
        forward = ErrorBoundConfig(mode=self.mode, eb=self.eb, bits=self.bits, table_scales=self.table_scales,
                                   value_range=_pair(self.value_range), table_bounds=self.table_bounds,
                                   table_bounds_refresh=self.table_bounds_refresh, **common)
        backward = ErrorBoundConfig(mode=self.backward_mode, eb=self.backward_eb, bits=self.backward_bits,
                                    value_range=_pair(self.backward_value_range), **common)
        return forward, backward


def _pair(value: Sequence[float] | None) -> tuple[float, float] | None:
    return tuple(value) if value is not None else None
