"""The trace bundle: the contract between a capture (``harness.traces.capture``) and a replay workload.

It lives beside the workload protocol (``workloads/base.py``) so the harness writes bundles
without importing any named workload; the replay workload reads them.

A bundle is a folder per rank::

    <bundle>/et.json       PyTorch execution trace (ExecutionTraceObserver), schema 1.1.1-chakra.*
    <bundle>/kineto.json   the Kineto (chrome) trace of the same steps: per-op durations
    <bundle>/kineto_timing.json  as many steps again under Kineto alone (far cheaper than the ET):
                           how much of a step is the program's own host time between ops
    <bundle>/et_resources/ raw bytes of the integer inputs of index-reading ops (optional)
    <bundle>/values.json   mean, spread and range of each floating tensor a step reads but does not
                           make, in first-read order, and a small one's own values
                           (``harness.traces.capture_values``; optional)
    <bundle>/meta.json     cobench's own record: platform, config, step times with and without
                           instrumentation, capture overhead, rank/world size

A distributed capture writes ``<out>/rank<i>/`` for each rank; :func:`rank_dirs` finds them.
Everything here is JSON read with ``json`` (never pickle); every problem is raised as a
:class:`TraceError` naming the file and what is wrong.
"""

from __future__ import annotations

import gc
import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ET_FILE, KINETO_FILE, META_FILE = "et.json", "kineto.json", "meta.json"
KINETO_TIMING_FILE = "kineto_timing.json"  # the same steps again under Kineto alone: host gaps
VALUES_FILE = "values.json"  # what the step's own floating inputs held (harness.traces.capture_values)
MAX_VALUE_ENTRIES = 100_000  # value profiles per rank; a step reading more keeps its first ones
# A floating input of at most this many elements is recorded whole (its raw bytes, base64) beside its figures,
# at most EXACT_VALUE_BUDGET elements per rank in first-read order: constants such as a detector's anchor
# boxes, whose corners' order and sizes decide which memory its RoI ops read and how much.
EXACT_VALUE_ELEMENTS = 1024
EXACT_VALUE_BUDGET = 2**17
# Where a floating input holds exact zeros, the slices along each dimension that are wholly zero are recorded by
# index where at most ZERO_SLICE_INDICES of a dimension are (at most ZERO_SLICE_BUDGET indices per rank), else by
# their share; a tensor of at most ZERO_SLICE_ELEMENTS is searched whole, a larger one in its summarised sample.
ZERO_SLICE_INDICES = 256
ZERO_SLICE_BUDGET = 2**16
ZERO_SLICE_ELEMENTS = 2**24
ET_RESOURCES = "et_resources"  # integer input data the ET observer saved: nid_<node>_tid_<input>.dat
META_SCHEMA = "cobench-trace-bundle/1"
# Execution-trace schemas this code understands: the Chakra-flavoured 1.x family of torch 2.x.
SUPPORTED_ET_SCHEMAS = (r"1\.0\.[1-9].*", r"1\.1\.\d+-chakra\.0\.0\.\d+")
STEP_ANNOTATION = "cobench_step#"  # record_function name marking one captured step


class TraceError(ValueError):
    """A bundle, trace or spec file that cannot be used; the message names the file and the problem."""


@dataclass
class BundleMeta:
    """``meta.json``: how the bundle was captured, and the step times to judge fidelity against."""

    step_times_s: list[float]  # measured without any instrumentation: the reference times
    traced_step_times_s: list[float]  # the same program under ET + Kineto
    platform: dict[str, Any]  # device type/name, threads, world size, host, torch version
    config: dict[str, Any] = field(default_factory=dict)  # the workload config, or the user's
    rank: int = 0
    world_size: int = 1
    source: str = ""  # workload name or a label the user gave
    source_run_id: str = ""
    capture_wall_s: float = 0.0
    # Peak memory over the plain timed steps: the allocator's peak on accelerators, else process RSS.
    peak_memory_bytes: int = 0
    timing_step_times_s: list[float] = field(default_factory=list)  # under Kineto alone
    # plain steps interleaved with the Kineto-alone ones (the same minutes): what the profiler added
    timing_plain_step_times_s: list[float] = field(default_factory=list)
    timing_rounds: int = 0  # rounds of those (Kineto-alone steps, then plain ones); 0: not recorded
    # the host's speed after each round's Kineto-alone steps: ns per turn of a replay's spin loop
    # (workloads.trace_replay.codegen.spin_ns); empty: not recorded
    timing_spin_ns: list[float] = field(default_factory=list)
    # the same, one spin right before and one right after each measured Kineto-alone step ([before, after], ns)
    timing_step_spin_ns: list[list[float]] = field(default_factory=list)
    # how many times the steps were traced again after the host-time rounds: the traced ones ran ops a step
    # unlike the program's steps (harness.traces.capture.MAX_TRACED_AGAIN)
    traced_again: int = 0
    # each traced step's memory peak (bytes beyond what it started with), run again after the traced steps with
    # the same random draws under the memory profiler alone (the observer's own copies left out); empty: not
    # recorded (harness.traces.allocator_peaks.captured_step_peak_bytes)
    step_peak_bytes: list[int] = field(default_factory=list)
    # the profiler's cost of an op event of each kind relative to a top-level op's, measured on the capturing host
    # (workloads.trace_replay.host_time.EventWeights: top, nested, engine); empty: spread alike
    profiler_event_weights: list[float] = field(default_factory=list)
    schema: str = META_SCHEMA

    @property
    def capture_overhead_pct(self) -> float:
        """How much ET + Kineto slowed a step: median traced ÷ median plain − 1, in percent."""
        return 100.0 * (_median(self.traced_step_times_s) / _median(self.step_times_s) - 1.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "source": self.source,
            "source_run_id": self.source_run_id,
            "rank": self.rank,
            "world_size": self.world_size,
            "platform": self.platform,
            "config": self.config,
            "step_times_s": self.step_times_s,
            "traced_step_times_s": self.traced_step_times_s,
            "step_time_ms_median": 1e3 * _median(self.step_times_s),
            "traced_step_time_ms_median": 1e3 * _median(self.traced_step_times_s),
            "capture_overhead_pct": self.capture_overhead_pct,
            "capture_wall_s": self.capture_wall_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "timing_step_times_s": self.timing_step_times_s,
            "timing_plain_step_times_s": self.timing_plain_step_times_s,
            "timing_rounds": self.timing_rounds,
            "timing_spin_ns": self.timing_spin_ns,
            "timing_step_spin_ns": self.timing_step_spin_ns,
            "traced_again": self.traced_again,
            "step_peak_bytes": self.step_peak_bytes,
            "profiler_event_weights": self.profiler_event_weights,
        }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


SETTLE_CONTAINERS = 100_000  # see collector_paused


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off while a trace is read into objects, then set back as it was.
    Reading makes millions of containers and no cycles among them, and each full collection their number set
    off walked all of them again: a Faster R-CNN bundle's spec (3,552 ops a step, 200 MB of traces) took 16.8 s
    to generate, 7.1 of them collecting, and 10.9 s with the collector held off. Where the reading left more
    than :data:`SETTLE_CONTAINERS` new containers, one full collection settles them as it ends (counted in
    those 10.9 s), where nothing is timed, rather than in whatever runs next (a replay's timed steps)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
            if gc.get_count()[0] > SETTLE_CONTAINERS:
                gc.collect()


def read_json(path: Path, what: str) -> Any:
    """Parse ``path`` as JSON (:func:`collector_paused`); a missing, truncated or corrupt file is a TraceError
    naming it."""
    if not path.is_file():
        raise TraceError(f"{what} {path} does not exist")
    try:
        with path.open(encoding="utf-8") as f, collector_paused():
            return json.load(f)
    except UnicodeDecodeError as err:
        raise TraceError(f"{what} {path} is not a UTF-8 JSON file (binary or foreign format?): {err}") from None
    except json.JSONDecodeError as err:
        raise TraceError(
            f"{what} {path} is not valid JSON (truncated or corrupt?): {err.msg} at line {err.lineno} "
            f"column {err.colno}"
        ) from None


def check_et_schema(et: Any, path: Path) -> str:
    """The ET's schema string, after checking it is one this code reads."""
    if not isinstance(et, dict) or "nodes" not in et or "schema" not in et:
        raise TraceError(f"{path} is not a PyTorch execution trace: expected an object with 'schema' and 'nodes'")
    schema = str(et["schema"])
    if not any(re.fullmatch(pattern, schema) for pattern in SUPPORTED_ET_SCHEMAS):
        raise TraceError(
            f"{path}: execution-trace schema {schema!r} is not supported; supported: 1.0.x and "
            f"1.1.x-chakra.0.0.x (torch 2.x ExecutionTraceObserver)"
        )
    if not isinstance(et["nodes"], list) or not et["nodes"]:
        raise TraceError(f"{path}: the execution trace has no nodes (was the profiler stopped before any step?)")
    return schema


def read_meta(bundle: Path) -> BundleMeta:
    path = bundle / META_FILE
    raw = read_json(path, "bundle metadata")
    if not isinstance(raw, dict) or raw.get("schema") != META_SCHEMA:
        found = raw.get("schema") if isinstance(raw, dict) else type(raw).__name__
        raise TraceError(f"{path}: metadata schema {found!r} is not supported; supported: {META_SCHEMA!r}")
    try:
        meta = BundleMeta(
            step_times_s=[float(t) for t in raw["step_times_s"]],
            traced_step_times_s=[float(t) for t in raw["traced_step_times_s"]],
            platform=dict(raw["platform"]),
            config=dict(raw.get("config") or {}),
            rank=int(raw.get("rank", 0)),
            world_size=int(raw.get("world_size", 1)),
            source=str(raw.get("source", "")),
            source_run_id=str(raw.get("source_run_id", "")),
            capture_wall_s=float(raw.get("capture_wall_s", 0.0)),
            peak_memory_bytes=int(raw.get("peak_memory_bytes", 0)),
            timing_step_times_s=[float(t) for t in raw.get("timing_step_times_s", [])],
            timing_plain_step_times_s=[float(t) for t in raw.get("timing_plain_step_times_s", [])],
            timing_rounds=int(raw.get("timing_rounds", 0) or 0),
            timing_spin_ns=[float(t) for t in raw.get("timing_spin_ns", [])],
            timing_step_spin_ns=[[float(t) for t in pair] for pair in raw.get("timing_step_spin_ns", [])],
            traced_again=int(raw.get("traced_again", 0) or 0),
            step_peak_bytes=[int(b) for b in raw.get("step_peak_bytes", [])],
            profiler_event_weights=[float(w) for w in raw.get("profiler_event_weights", [])],
        )
    except (KeyError, TypeError, ValueError) as err:
        raise TraceError(f"{path}: malformed metadata ({type(err).__name__}: {err})") from None
    if not meta.step_times_s or not meta.traced_step_times_s:
        raise TraceError(f"{path}: the bundle records no steps (the captured loop ran no complete step)")
    weights = meta.profiler_event_weights
    if weights and not (len(weights) == 3 and all(math.isfinite(w) and w > 0 for w in weights)):
        raise TraceError(f"{path}: malformed metadata (profiler_event_weights {weights} are not three positive "
                         f"numbers: top, nested, engine; capture the program again)")
    return meta


def rank_dirs(bundle: Path) -> list[Path]:
    """The per-rank bundle folders of a capture: ``[bundle]`` or ``bundle/rank0 … rank<n-1>``."""
    bundle = Path(bundle)
    if not bundle.exists():
        raise TraceError(f"trace bundle {bundle} does not exist (make one with `cobench trace capture`)")
    if (bundle / META_FILE).exists():
        return [bundle]
    ranks = sorted((p for p in bundle.glob("rank*") if p.is_dir() and p.name[4:].isdigit()),
                   key=lambda p: int(p.name[4:]))
    if not ranks:
        raise TraceError(f"{bundle} is not a trace bundle: no {META_FILE} and no rank<i>/ folders")
    expected = [f"rank{i}" for i in range(len(ranks))]
    if [p.name for p in ranks] != expected:
        raise TraceError(f"{bundle}: rank folders {[p.name for p in ranks]} are not rank0..rank{len(ranks) - 1}")
    return ranks
