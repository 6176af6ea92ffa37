"""The spec as typed records: what a replay reads, once :func:`.safety.check_spec` has vetted the JSON.

``spec.py`` writes a spec as JSON (the portable file); ``safety.py`` checks every field of an
untrusted one; these records are the checked spec as the replay, the fidelity figures and the
crash probe read it: fields with names and types instead of nested dictionaries, with the
defaults an older spec may lack written down once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Values:
    """An op's inputs or outputs as the execution trace records them, position by position: the value
    (a tensor ``[id, storage, offset, numel, itemsize, device]``, a list, a scalar), shape, stride, type."""

    values: list[Any] = field(default_factory=list)
    shapes: list[Any] = field(default_factory=list)
    strides: list[Any] = field(default_factory=list)
    types: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Values:
        return cls(list(raw.get("values", [])), list(raw.get("shapes", [])), list(raw.get("strides", [])),
                   list(raw.get("types", [])))


@dataclass(frozen=True)
class OpRecord:
    """One captured op: what it is, what it read and wrote, when it ran and what the program spent around it."""

    id: int
    name: str
    schema: str
    step: int
    category: str
    inputs: Values
    outputs: Values
    tensor_range: dict[str, list[int]] = field(default_factory=dict)  # input position → [low, high] read
    tensor_data: dict[str, Any] = field(default_factory=dict)  # input position → recorded integer data
    dur_us: float | None = None  # captured duration (None: no Kineto event matched it)
    gap_us: float = 0.0  # the program's host time before it
    scopes: list[str] = field(default_factory=list)
    deps: list[int] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)  # new output storages seen allocated in it
    released: list[int] = field(default_factory=list)  # storages the program freed right after it
    born: list[int] = field(default_factory=list)  # storages it made right after it, outside any op
    grad: bool = False  # the program recorded autograd history through it (a forward op under grad mode)
    held_bytes: int = 0  # a composite kept whole: what it made inside and still held at its return (allocations)
    # a collective the program stood waiting for: the op it ran on with, this many ops later in its step
    # (host_time.mark_waits; None: not seen waiting, waited for where the step first uses its buffers)
    waited_after_ops: int | None = None
    transient_bytes: int = 0  # a composite kept whole: its peak inside it above what it held at its return

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> OpRecord:
        return cls(int(raw.get("id", -1)), raw["name"], raw["schema"], int(raw["step"]), raw["category"],
                   Values.from_json(raw.get("inputs") or {}), Values.from_json(raw.get("outputs") or {}),
                   dict(raw.get("tensor_range") or {}), dict(raw.get("tensor_data") or {}), raw.get("dur_us"),
                   float(raw.get("gap_us") or 0.0), list(raw.get("scopes", [])), list(raw.get("deps", [])),
                   list(raw.get("allocated", [])), list(raw.get("released", [])),
                   list(raw.get("born", [])), raw.get("grad") is True, int(raw.get("held_bytes", 0)),
                   None if raw.get("waited_after_ops") is None else int(raw["waited_after_ops"]),
                   int(raw.get("transient_bytes", 0)))


@dataclass(frozen=True)
class StepRecord:
    """One captured step: its index and the program's host time in it."""

    index: int
    tail_gap_us: float = 0.0  # host time after its last op
    host_gap_us: float = 0.0  # host time per step, all gaps together
    ops_dur_us: float = 0.0  # every captured op's time in it (the denominator of a partial spec)
    host_gap_samples_us: tuple[float, ...] = ()  # the per-step measurements host_gap_us is the median of
    kineto_ops: int = 0  # the ops the profiler saw in it (host_time.step_op_counts; 0: not counted)
    program_kineto_ops: float = 0.0  # the same count, the mean over the program's steps timed at capture
    program_op_us: float = 0.0  # the time inside those ops per step, the median over those steps (0: not measured)
    # the host's speed while that host time was measured: ns per turn of the replay's spin loop, the median over
    # the capture's measured steps (over its rounds in bundles without a spin around each step; codegen.spin_ns;
    # 0: not measured, the gaps are spent as they are)
    host_spin_ns: float = 0.0
    # how the program's host time moved with that speed at capture (host_time.host_speed_elasticity; 1 where the
    # capture's host kept its speed: the host time taken to move as the spin does)
    host_speed_elasticity: float = 1.0

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> StepRecord:
        return cls(int(raw["index"]), float(raw.get("tail_gap_us", 0.0)), float(raw.get("host_gap_us", 0.0)),
                   float(raw.get("ops_dur_us", 0.0)), tuple(float(g) for g in raw.get("host_gap_samples_us", ())),
                   int(raw.get("kineto_ops", 0)), float(raw.get("program_kineto_ops", 0.0)),
                   float(raw.get("program_op_us", 0.0)), float(raw.get("host_spin_ns", 0.0)),
                   float(raw.get("host_speed_elasticity", 1.0)))


@dataclass(frozen=True)
class ValueStats:
    """What one floating tensor a step read but did not make held (``harness.traces.capture_values``)."""

    shape: tuple[int, ...]
    dtype: str
    mean: float
    std: float
    low: float
    high: float
    zeros: float = 0.0  # the share of elements that are exact zeros
    nonzero: tuple[float, float, float, float] | None = None  # the other elements' mean, std, min, max
    data: str | None = None  # a small tensor's own values: raw bytes in logical order, base64
    op: str | None = None  # a 0-dim one, recorded at each read: the op that read it (``aten::mul_``)
    reader: str | None = None  # any other: the op that read it first (the name the dispatcher knows it by)
    # per dimension, the slices along it that are wholly zero: by index, or (too many to list) their share
    zero_slices: dict[int, tuple[int, ...]] = field(default_factory=dict)
    zero_slice_shares: dict[int, float] = field(default_factory=dict)
    matrix: str | None = None  # a square matrix (or a batch) that was "symmetric" or "positive_definite"

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ValueStats:
        nonzero = raw.get("nonzero")
        shares = {int(d): float(share) for d, share in raw.get("zero_slice_shares", {}).items()}
        if "zero_rows" in raw and raw["zero_rows"]:  # a bundle recorded before slices along every dimension
            shares.setdefault(0, float(raw["zero_rows"]))
        return cls(tuple(int(d) for d in raw["shape"]), str(raw["dtype"]), float(raw["mean"]), float(raw["std"]),
                   float(raw["min"]), float(raw["max"]), float(raw.get("zeros", 0.0)),
                   tuple(float(nonzero[k]) for k in ("mean", "std", "min", "max")) if nonzero else None,
                   raw.get("data"), raw.get("op"), raw.get("reader"),
                   {int(d): tuple(int(i) for i in index) for d, index in raw.get("zero_slices", {}).items()}, shares,
                   raw.get("matrix"))


@dataclass(frozen=True)
class RankRecord:
    """One rank's captured steps and ops, and what its external floating tensors held (first-read order)."""

    ops: list[OpRecord]
    steps: list[StepRecord] = field(default_factory=list)
    external_values: list[ValueStats] = field(default_factory=list)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RankRecord:
        return cls([OpRecord.from_json(op) for op in raw["ops"]],
                   [StepRecord.from_json(s) for s in raw.get("steps", [])],
                   [ValueStats.from_json(v) for v in raw.get("external_values", [])])


@dataclass(frozen=True)
class SourceRecord:
    """Where the capture came from, and what its steps measured there (per rank)."""

    workload: str = ""
    run_id: str = ""
    platform: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    step_times_ms: list[list[float]] = field(default_factory=list)
    peak_memory_bytes: list[int] = field(default_factory=list)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> SourceRecord:
        return cls(str(raw.get("workload", "")), str(raw.get("run_id", "")), dict(raw.get("platform") or {}),
                   int(raw.get("world_size", 1)), [list(t) for t in raw.get("step_times_ms", [])],
                   [int(b) for b in raw.get("peak_memory_bytes", [])])


@dataclass(frozen=True)
class SpecRecord:
    """A whole checked spec."""

    source: SourceRecord
    ranks: list[RankRecord]
    options: dict[str, Any] = field(default_factory=dict)  # the selection it was generated with
    full_step: bool = False  # every op of the captured steps, once: host time replays too

    @property
    def repeat(self) -> int:
        return int(self.options.get("repeat", 1) or 1)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> SpecRecord:
        return cls(SourceRecord.from_json(raw.get("source") or {}), [RankRecord.from_json(r) for r in raw["ranks"]],
                   dict(raw.get("options") or {}), bool(raw.get("full_step", False)))
