"""Qualification gates and golden references, both plain YAML data under ``conf/``.

A gates file (``conf/gates/<platform>.yaml``) says, per benchmark of a suite, which checks a
platform must pass — in the spirit of mlperf-logging's YAML compliance rules::

    platform: cpu
    suite: qualify
    golden: golden/cpu.yaml            # relative to conf/ (or absolute)
    defaults: {throughput_tolerance: 0.3, cv_max: 0.25, loss_rtol: 0.05}
    benchmarks:
      llama_tiny: {gates: [finished, throughput, cv, loss_trajectory, quality]}
      llama_replay:
        gates: [finished, throughput, cv]
        metrics: [{metric: time_error_pct, max: 25}, {metric: op_coverage_pct, min: 100}]

A golden file (``conf/golden/<platform>.yaml``) holds what a trusted run measured: per benchmark
its config hash, throughput, its variation and the loss trajectory. Both are read with
``yaml.safe_load`` and checked key by key; nothing passes by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

GATE_KINDS = ("finished", "throughput", "cv", "loss_trajectory", "quality")
DEFAULT_KEYS = ("throughput_tolerance", "cv_max", "loss_rtol")
GATES_KEYS = ("platform", "suite", "golden", "defaults", "benchmarks", "description")
BENCH_KEYS = ("gates", "metrics", "throughput_tolerance", "cv_max", "loss_rtol")
BOUND_KEYS = ("metric", "min", "max")
GOLDEN_KEYS = ("platform", "suite", "suite_version", "recorded", "source_run_id", "torch_version", "benchmarks")


class GateError(ValueError):
    """A gates or golden file that cannot be used; the message names the file and the key."""


@dataclass
class GateResult:
    benchmark: str
    gate: str
    passed: bool
    measured: str
    required: str
    detail: str = ""


@dataclass
class BenchmarkGates:
    gates: list[str]
    bounds: list[dict[str, Any]] = field(default_factory=list)
    throughput_tolerance: float = 0.3
    cv_max: float = 0.25
    loss_rtol: float = 0.05


@dataclass
class GatesFile:
    path: Path
    platform: str
    suite: str
    golden: Path
    benchmarks: dict[str, BenchmarkGates]


def _load_yaml(path: Path, what: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise GateError(f"{what} {path} cannot be read: {err}") from None
    except yaml.YAMLError as err:
        raise GateError(f"{what} {path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise GateError(f"{what} {path} must be a mapping, got {type(data).__name__}")
    return data


def _check_keys(data: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise GateError(f"{where}: unknown key(s) {unknown}; allowed: {', '.join(allowed)}")


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise GateError(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def load_gates(path: Path, conf_dir: Path) -> GatesFile:
    data = _load_yaml(path, "gates file")
    _check_keys(data, GATES_KEYS, str(path))
    for key in ("platform", "suite", "golden", "benchmarks"):
        if key not in data:
            raise GateError(f"{path}: missing key '{key}'")
    defaults = data.get("defaults") or {}
    _check_keys(defaults, DEFAULT_KEYS, f"{path}: defaults")
    if not isinstance(data["benchmarks"], dict) or not data["benchmarks"]:
        raise GateError(f"{path}: 'benchmarks' must map benchmark names to their gates")
    benchmarks = {}
    for name, spec in data["benchmarks"].items():
        where = f"{path}: benchmarks.{name}"
        if not isinstance(spec, dict):
            raise GateError(f"{where}: expected a mapping with 'gates'")
        _check_keys(spec, BENCH_KEYS, where)
        gates = list(spec.get("gates") or [])
        bad = [g for g in gates if g not in GATE_KINDS]
        if bad:
            raise GateError(f"{where}.gates: unknown gate(s) {bad}; allowed: {', '.join(GATE_KINDS)}")
        bounds = []
        for i, bound in enumerate(spec.get("metrics") or []):
            if not isinstance(bound, dict) or "metric" not in bound or not ({"min", "max"} & set(bound)):
                raise GateError(f"{where}.metrics[{i}]: expected {{metric: NAME, min: X and/or max: Y}}")
            _check_keys(bound, BOUND_KEYS, f"{where}.metrics[{i}]")
            for side in ("min", "max"):
                if side in bound:
                    _number(bound[side], f"{where}.metrics[{i}].{side}")
            bounds.append(bound)
        if not gates and not bounds:
            raise GateError(f"{where}: no gates and no metric bounds: a benchmark must be checked by something")
        merged = {**defaults, **{k: spec[k] for k in DEFAULT_KEYS if k in spec}}
        for key, value in merged.items():
            _number(value, f"{where}.{key}")
        benchmarks[name] = BenchmarkGates(gates, bounds, **{k: float(v) for k, v in merged.items()})
    golden = Path(data["golden"])
    return GatesFile(path, str(data["platform"]), str(data["suite"]),
                     golden if golden.is_absolute() else conf_dir / golden, benchmarks)


def load_golden(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise GateError(f"no golden reference {path}: record one from a trusted run with "
                        f"`cobench qualify --record-golden platform=<name>`")
    data = _load_yaml(path, "golden reference")
    _check_keys(data, GOLDEN_KEYS, str(path))
    if not isinstance(data.get("benchmarks"), dict):
        raise GateError(f"{path}: missing 'benchmarks'")
    return data


def write_golden(path: Path, golden: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Golden reference: what a trusted qualification run measured on this platform class.\n"
                    "# Re-record with `cobench qualify --record-golden` (see README, Qualification).\n"
                    + yaml.safe_dump(golden, sort_keys=False, width=120, default_flow_style=None))


def loss_deviation(measured: list[float], golden: list[float]) -> float:
    """Largest relative difference between two loss trajectories, point by point (common length)."""
    n = min(len(measured), len(golden))
    if n == 0:
        return math.inf
    return max(abs(m - g) / max(abs(g), 1e-12) for m, g in zip(measured[:n], golden[:n], strict=True))


def evaluate(name: str, gates: BenchmarkGates, status: str, error: str | None, metrics: dict[str, float],
             losses: list[float], golden: dict[str, Any] | None) -> list[GateResult]:
    """Every gate of one benchmark, each with measured vs required. A run that did not finish fails all."""
    results = []
    finished = status == "FINISHED"
    for gate in gates.gates:
        if gate == "finished" or not finished:
            results.append(GateResult(name, gate, finished, status, "FINISHED", "" if finished else (error or "")))
            continue
        if golden is None and gate in ("throughput", "loss_trajectory"):
            results.append(GateResult(name, gate, False, "-", "a golden reference", "no golden entry"))
            continue
        if gate == "throughput":
            need = float(golden["throughput"]) * (1 - gates.throughput_tolerance)
            got = metrics.get("throughput", math.nan)
            results.append(GateResult(name, gate, got >= need, f"{got:.4g}",
                                      f">= {need:.4g} (golden {float(golden['throughput']):.4g} "
                                      f"x (1 - {gates.throughput_tolerance:g}))"))
        elif gate == "cv":
            got = metrics.get("throughput_cv", math.nan)
            results.append(GateResult(name, gate, got <= gates.cv_max, f"{got:.3f}", f"<= {gates.cv_max:g}"))
        elif gate == "loss_trajectory":
            reference = list(golden.get("train_loss") or [])
            deviation = loss_deviation(losses, reference)
            results.append(GateResult(name, gate, deviation <= gates.loss_rtol, f"max rel. dev. {deviation:.3g}",
                                      f"<= {gates.loss_rtol:g}", f"{min(len(losses), len(reference))} points"))
        elif gate == "quality":
            got = metrics.get("quality_target_reached")
            results.append(GateResult(name, gate, got == 1.0, "reached" if got == 1.0 else
                                      ("not reached" if got is not None else "no target"), "reached"))
    for bound in gates.bounds:
        metric = bound["metric"]
        got = metrics.get(metric)
        ok = finished and got is not None and math.isfinite(got)
        if ok and "min" in bound:
            ok = got >= float(bound["min"])
        if ok and "max" in bound:
            ok = got <= float(bound["max"])
        required = " and ".join(f"{'>=' if side == 'min' else '<='} {bound[side]:g}" for side in ("min", "max")
                                if side in bound)
        results.append(GateResult(name, metric, ok, "missing" if got is None else f"{got:.4g}", required))
    return results
