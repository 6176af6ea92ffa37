"""The spec file: a bundle → one portable JSON benchmark spec, written and read back.

A spec holds, per rank, the ops a replay runs (:mod:`.extract`: the captured steps' top-level
operators, each with its inputs and outputs, recorded values, category, scopes, duration, the
program's allocations and host time around it), the selection the user asked for
(:class:`GenerateOptions`), its data-dependency edges, and the capture's reference step times. A
spec is untrusted input when replayed: :mod:`.safety` checks it before anything of it runs.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workloads.trace_bundle import VALUES_FILE, BundleMeta, TraceError, collector_paused, rank_dirs, read_json
from workloads.trace_replay.extract import add_dependencies, extract_rank
from workloads.trace_replay.host_time import mark_waits
from workloads.trace_replay.parse import read_bundle

SPEC_SCHEMA = "cobench-generated-spec/1"


@dataclass
class GenerateOptions:
    """How to cut a spec out of a bundle (each option is documented in docs/traces.md)."""

    scope: str | None = None  # regex: keep ops with a matching scope (module, annotation) on their path
    op: str | None = None  # regex: keep ops whose name matches (e.g. "aten::(mm|addmm)")
    exclude_op: str | None = None  # regex: drop ops whose name matches
    steps: list[int] | None = None  # captured step indices to keep (default: all)
    window_ms: tuple[float, float] | None = None  # keep ops starting in [a, b) ms after their step began
    repeat: int = 1  # replay the selected ops this many times per step (scales the work)
    obfuscate: bool = False  # hash scope names, drop host/config details; op names stay (they must run)

    def __post_init__(self) -> None:
        for key in ("scope", "op", "exclude_op"):
            pattern = getattr(self, key)
            if pattern is not None:
                try:
                    re.compile(pattern)
                except re.error as err:
                    message = f"{pattern!r} is not a regular expression ({err})"
                    raise ValueError(f"invalid option '{key}': {message}") from None
        if self.repeat < 1:
            raise ValueError(f"invalid option 'repeat': got {self.repeat}, must be >= 1")
        if self.window_ms is not None and not self.window_ms[0] < self.window_ms[1]:
            raise ValueError(f"invalid option 'window_ms': {self.window_ms} must be (start, end) with start < end")


def _select(ops: list[dict], steps: list[dict], options: GenerateOptions) -> list[dict]:
    step_start = {s["index"]: s["ts_us"] for s in steps}
    kept = []
    for op in ops:
        if options.steps is not None and op["step"] not in options.steps:
            continue
        if options.op and not re.search(options.op, op["name"]):
            continue
        if options.exclude_op and re.search(options.exclude_op, op["name"]):
            continue
        if options.scope and not any(re.search(options.scope, s) for s in op["scopes"]):
            continue
        if options.window_ms is not None:
            if op["ts_us"] is None or op["step"] not in step_start:
                continue
            offset_ms = (op["ts_us"] - step_start[op["step"]]) / 1e3
            if not options.window_ms[0] <= offset_ms < options.window_ms[1]:
                continue
        kept.append(op)
    return kept


def _obfuscated(name: str) -> str:
    if name.startswith(("autograd::engine::", "Optimizer.", "## ")):
        return name  # framework scopes, not the user's names
    return "scope_" + hashlib.sha256(name.encode()).hexdigest()[:10]


def _rank_entry(rank_dir: Path, options: GenerateOptions, full_step: bool) -> tuple[BundleMeta, dict[str, Any]]:
    """One rank's bundle → its metadata and its entry in the spec: the selected ops and their steps."""
    trace = read_bundle(rank_dir)
    ops, steps = extract_rank(trace)
    original_count = len(ops)
    for step in steps:  # every captured op's time: the denominator when only a part is replayed
        step["ops_dur_us"] = sum(op["dur_us"] or 0.0 for op in ops if op["step"] == step["index"])
    ops = _select(ops, steps, options)
    if not ops:
        raise TraceError(f"{rank_dir}: the selection {options} keeps no operators (of {original_count})")
    add_dependencies(ops)
    mark_waits(ops, steps, trace.kineto)  # over the ops kept: the replay's own steps
    if options.obfuscate:  # the program's names and its data go; shapes, ranges and timings stay
        for op in ops:
            op["scopes"] = [_obfuscated(s) for s in op["scopes"]]
            op["tensor_data"] = {}
    kept_steps = sorted({op["step"] for op in ops})
    return trace.meta, {
        "rank": trace.meta.rank,
        "ops": ops,
        "steps": [s for s in steps if s["index"] in kept_steps],
        "selected_ops": len(ops),
        "captured_ops": original_count,
        # what the step's own floating inputs held; a part of a step reads other tensors than those
        "external_values": read_json(rank_dir / VALUES_FILE, "value profile")
        if full_step and (rank_dir / VALUES_FILE).is_file() else [],
    }


def _source(bundle: Path, metas: list[BundleMeta], options: GenerateOptions) -> dict[str, Any]:
    """Where the spec comes from: the capture's workload, config, platform and reference step times."""
    meta = metas[0]
    platform = dict(meta.platform)
    if options.obfuscate:
        platform.pop("host", None)
    return {
        "bundle": "" if options.obfuscate else str(bundle.resolve()),
        "workload": meta.source,
        "run_id": meta.source_run_id,
        "config": {} if options.obfuscate else meta.config,
        "platform": platform,
        "world_size": meta.world_size,
        "step_times_ms": [[1e3 * t for t in m.step_times_s] for m in metas],
        "traced_step_times_ms": [[1e3 * t for t in m.traced_step_times_s] for m in metas],
        "capture_overhead_pct": [m.capture_overhead_pct for m in metas],
        "peak_memory_bytes": [m.peak_memory_bytes for m in metas],
    }


def generate_spec(bundle: str | Path, options: GenerateOptions | None = None) -> dict[str, Any]:
    """Read a (possibly multi-rank) bundle and return the spec as a JSON-ready dict (the objects read and built
    without a cyclic collection: :func:`~workloads.trace_bundle.collector_paused`)."""
    options = options or GenerateOptions()
    full_step = (options.scope is None and options.op is None and options.exclude_op is None
                 and options.window_ms is None and options.repeat == 1)
    with collector_paused():
        metas, ranks = zip(*(_rank_entry(rank_dir, options, full_step) for rank_dir in rank_dirs(Path(bundle))),
                           strict=True)
    return {
        "schema": SPEC_SCHEMA,
        "source": _source(Path(bundle), list(metas), options),
        "options": {
            "scope": options.scope, "op": options.op, "exclude_op": options.exclude_op, "steps": options.steps,
            "window_ms": list(options.window_ms) if options.window_ms else None, "repeat": options.repeat,
            "obfuscate": options.obfuscate,
        },
        "full_step": full_step,
        "ranks": list(ranks),
    }


def write_spec(spec: dict[str, Any], path: str | Path) -> Path:
    """Write a spec as compact JSON (its folder made if need be); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, separators=(",", ":")))
    return path


def load_spec(path: str | Path) -> dict[str, Any]:
    """Read and check a spec file; errors name the file and the problem."""
    path = Path(path)
    spec = read_json(path, "generated benchmark spec")
    if not isinstance(spec, dict) or spec.get("schema") != SPEC_SCHEMA:
        found = spec.get("schema") if isinstance(spec, dict) else type(spec).__name__
        raise TraceError(f"{path}: spec schema {found!r} is not supported; supported: {SPEC_SCHEMA!r} "
                         f"(make one with `cobench trace generate BUNDLE`)")
    ranks = spec.get("ranks")
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) and r.get("ops") for r in ranks):
        raise TraceError(f"{path}: the spec holds no operators")
    return spec
