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
        gates: [finished, cv]
        metrics: [{metric: time_error_pct, max: 10}, {metric: op_coverage_pct, min: 100}]

Each gate is a rule (:data:`RULES`): a small function over numbers, registered with the
tolerances it reads. The YAML is the only source of tolerances — a gate whose tolerance is set
neither in ``defaults`` nor on the benchmark is refused when the file is loaded, never filled in.
Every result carries the number measured, the bound and the comparison (``verdict.json`` holds
numbers), plus the text a person reads.

A golden file (``conf/golden/<platform>.yaml``) holds what trusted runs measured: per benchmark
its config hash, and the median over the recorded runs (``--record-golden --runs N``) of the
throughput, its variation and, point by point, the loss trajectory. Both files are read with
``yaml.safe_load`` and checked key by key; nothing passes by default.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

GATES_KEYS = ("platform", "suite", "golden", "defaults", "benchmarks", "description")
BOUND_KEYS = ("metric", "min", "max")
GOLDEN_KEYS = ("platform", "suite", "suite_version", "recorded", "source_run_id", "torch_version", "runs",
               "benchmarks")


class GateError(ValueError):
    """A gates or golden file that cannot be used; the message names the file and the key."""


@dataclass
class GateResult:
    """One gate of one benchmark. ``measured`` and ``bound`` are numbers (None where there is none:
    a run that did not finish, a missing metric); ``comparison`` is how they were compared."""

    benchmark: str
    gate: str
    passed: bool
    measured: float | None
    comparison: str  # ">=", "<=" or "=="
    bound: float | None
    detail: str = ""

    @property
    def measured_text(self) -> str:
        return "missing" if self.measured is None else f"{self.measured:.4g}"

    @property
    def required_text(self) -> str:
        return "-" if self.bound is None else f"{self.comparison} {self.bound:.4g}"


@dataclass
class Evidence:
    """What a rule judges: one benchmark's outcome, its golden entry and its tolerances."""

    benchmark: str
    status: str
    error: str | None
    metrics: dict[str, float]
    losses: list[float]
    golden: dict[str, Any] | None
    tolerances: dict[str, float]


@dataclass(frozen=True)
class Rule:
    name: str
    check: Callable[[Evidence], GateResult]
    tolerances: tuple[str, ...] = ()  # keys the YAML must set for this gate
    needs_golden: bool = False
    doc: str = ""


RULES: dict[str, Rule] = {}


def rule(name: str, *, tolerances: tuple[str, ...] = (), needs_golden: bool = False
         ) -> Callable[[Callable[[Evidence], GateResult]], Callable[[Evidence], GateResult]]:
    """Register a gate: ``@rule("cv", tolerances=("cv_max",))`` over a function of :class:`Evidence`."""

    def decorate(check: Callable[[Evidence], GateResult]) -> Callable[[Evidence], GateResult]:
        RULES[name] = Rule(name, check, tolerances, needs_golden, (check.__doc__ or "").strip())
        return check

    return decorate


def _compare(value: float | None, comparison: str, bound: float) -> bool:
    if value is None or not math.isfinite(value):
        return False
    return {">=": value >= bound, "<=": value <= bound, "==": value == bound}[comparison]


def _result(e: Evidence, gate: str, value: float | None, comparison: str, bound: float, detail: str = "") -> GateResult:
    return GateResult(e.benchmark, gate, _compare(value, comparison, bound), value, comparison, bound, detail)


@rule("finished")
def finished(e: Evidence) -> GateResult:
    """The run ended FINISHED (1) rather than FAILED or KILLED (0)."""
    done = e.status == "FINISHED"
    return GateResult(e.benchmark, "finished", done, 1.0 if done else 0.0, "==", 1.0,
                      "" if done else f"{e.status}: {e.error or ''}")


@rule("throughput", tolerances=("throughput_tolerance",), needs_golden=True)
def throughput(e: Evidence) -> GateResult:
    """throughput >= golden throughput x (1 - throughput_tolerance)."""
    assert e.golden is not None
    reference = float(e.golden["throughput"])
    tolerance = e.tolerances["throughput_tolerance"]
    return _result(e, "throughput", e.metrics.get("throughput"), ">=", reference * (1 - tolerance),
                   f"golden {reference:.4g} x (1 - {tolerance:g})")


@rule("cv", tolerances=("cv_max",))
def cv(e: Evidence) -> GateResult:
    """throughput_cv (std ÷ mean of the repetitions' throughputs, a fraction) <= cv_max."""
    return _result(e, "cv", e.metrics.get("throughput_cv"), "<=", e.tolerances["cv_max"])


@rule("loss_trajectory", tolerances=("loss_rtol",), needs_golden=True)
def loss_trajectory(e: Evidence) -> GateResult:
    """max over steps of |loss - golden loss| ÷ |golden loss| (common length) <= loss_rtol."""
    assert e.golden is not None
    reference = list(e.golden.get("train_loss") or [])
    deviation = loss_deviation(e.losses, reference)
    return _result(e, "loss_trajectory", None if math.isinf(deviation) else deviation, "<=",
                   e.tolerances["loss_rtol"], f"{min(len(e.losses), len(reference))} points")


@rule("quality")
def quality(e: Evidence) -> GateResult:
    """The workload's quality target was reached: quality_target_reached == 1."""
    got = e.metrics.get("quality_target_reached")
    return _result(e, "quality", got, "==", 1.0, "" if got is not None else "the workload has no target")


TOLERANCE_KEYS = tuple(sorted({key for r in RULES.values() for key in r.tolerances}))
BENCH_KEYS = ("gates", "metrics", *TOLERANCE_KEYS)


@dataclass
class BenchmarkGates:
    """One benchmark's gates, with exactly the tolerances they read (from the YAML, never defaulted)."""

    gates: list[str]
    bounds: list[dict[str, Any]] = field(default_factory=list)
    tolerances: dict[str, float] = field(default_factory=dict)


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
    _check_keys(defaults, TOLERANCE_KEYS, f"{path}: defaults")
    if not isinstance(data["benchmarks"], dict) or not data["benchmarks"]:
        raise GateError(f"{path}: 'benchmarks' must map benchmark names to their gates")
    benchmarks = {}
    for name, spec in data["benchmarks"].items():
        where = f"{path}: benchmarks.{name}"
        if not isinstance(spec, dict):
            raise GateError(f"{where}: expected a mapping with 'gates'")
        _check_keys(spec, BENCH_KEYS, where)
        gates = list(spec.get("gates") or [])
        bad = [g for g in gates if g not in RULES]
        if bad:
            raise GateError(f"{where}.gates: unknown gate(s) {bad}; allowed: {', '.join(RULES)}")
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
        merged = {**defaults, **{k: spec[k] for k in TOLERANCE_KEYS if k in spec}}
        tolerances = {}
        for gate in gates:
            for key in RULES[gate].tolerances:
                if key not in merged:
                    raise GateError(f"{where}: gate {gate!r} needs {key}: set it under 'defaults' or on the "
                                    f"benchmark (there is no built-in default)")
                tolerances[key] = _number(merged[key], f"{where}.{key}")
        benchmarks[name] = BenchmarkGates(gates, bounds, tolerances)
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
    path.write_text("# Golden reference: what trusted qualification runs measured on this platform class\n"
                    "# (medians over the recorded runs). Re-record with `cobench qualify --record-golden\n"
                    "# --runs N` (see docs/qualification.md).\n"
                    + yaml.safe_dump(golden, sort_keys=False, width=120, default_flow_style=None))


def median_trajectory(trajectories: list[list[float]]) -> list[float]:
    """Point-by-point median of several loss trajectories, over their common length."""
    n = min((len(t) for t in trajectories), default=0)
    return [statistics.median(t[i] for t in trajectories) for i in range(n)]


def loss_deviation(measured: list[float], golden: list[float]) -> float:
    """Largest relative difference between two loss trajectories, point by point (common length)."""
    n = min(len(measured), len(golden))
    if n == 0:
        return math.inf
    return max(abs(m - g) / max(abs(g), 1e-12) for m, g in zip(measured[:n], golden[:n], strict=True))


def evaluate(name: str, gates: BenchmarkGates, status: str, error: str | None, metrics: dict[str, float],
             losses: list[float], golden: dict[str, Any] | None) -> list[GateResult]:
    """Every gate of one benchmark, each with measured vs bound. A run that did not finish fails all."""
    evidence = Evidence(name, status, error, metrics, losses, golden, gates.tolerances)
    results = []
    done = status == "FINISHED"
    for gate in gates.gates:
        if gate != "finished" and not done:
            results.append(GateResult(name, gate, False, None, "==", None, f"did not finish: {status}"))
        elif RULES[gate].needs_golden and golden is None:
            results.append(GateResult(name, gate, False, None, "==", None, "no golden entry"))
        else:
            results.append(RULES[gate].check(evidence))
    for bound in gates.bounds:
        metric = bound["metric"]
        got = metrics.get(metric) if done else None
        checks = [(side, float(bound[side])) for side in ("min", "max") if side in bound]
        passed = all(_compare(got, ">=" if side == "min" else "<=", value) for side, value in checks)
        side, value = checks[-1]
        detail = " and ".join(f"{'>=' if s == 'min' else '<='} {v:g}" for s, v in checks) if len(checks) > 1 else ""
        results.append(GateResult(name, metric, passed, got, ">=" if side == "min" else "<=", value, detail))
    return results
