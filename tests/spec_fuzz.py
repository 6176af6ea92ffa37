"""Fuzz the replay with specs mutated at random from real ones; run as a child process by the tests.

    python tests/spec_fuzz.py OUT_JSON SEED COUNT SPEC [SPEC ...]

Each mutant goes the way ``cobench run workload=generated`` takes it — the workload's constructor
(load + safety check: a refusal is exit 2), ``setup`` (compile, synthesise, dry run), two steps and
the fidelity record — in this process, so the driver itself is the crash detector: the parent sees
a crash (signal), a hang (time-out) or a non-refusal exception counted as ``crashed``. Every
:data:`CALIBRATED_EVERY`-th mutant, and every file attack, goes through the host-time calibration
too; the rest replay with ``host_gaps`` off. Mutations: types swapped, numbers made huge, negative or
non-finite, fields removed, ops renamed (to operators that reach files or process state, to unknown
ones, to code). The last mutants aim ``aten::from_file`` at a sentinel file; the parent checks it is
never touched.
"""

from __future__ import annotations

import copy
import json
import random
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

RENAMES = [
    ("aten::from_file", "aten::from_file(str filename, bool? shared=None, int? size=0, *, ScalarType? dtype=None, "
                        "Layout? layout=None, Device? device=None, bool? pin_memory=None) -> Tensor"),
    ("aten::set_", "aten::set_.source_Storage(Tensor(a!) self, Storage source) -> Tensor(a!)"),
    ("aten::manual_seed", "aten::manual_seed(int seed) -> ()"),
    ("profiler::_record_function_enter", "profiler::_record_function_enter(str name, str? args=None) -> Tensor"),
    ("os::system", "os::system(str command) -> int"),
    ("aten::relu", "aten::relu(Tensor self) -> Tensor"),
    ("aten::not_an_op", "aten::not_an_op(Tensor self) -> Tensor"),
    ("__import__('os').system('touch PWNED')", "x"),
    ("aten::relu", "aten::relu(Tensor self) -> Tensor\nimport os"),
]
CALIBRATED_EVERY = 5  # every fifth mutant also through the host-time calibration, the slow part of a replay's setup
HOSTILE = [None, True, -1, 0, 2**62, -(2**62), 2**70, 1e308, float("inf"), float("nan"), -0.5, "", "x" * 5000,
           "__import__('os').system('touch PWNED')", "'); import os; os.system('touch PWNED') #", [], [[[[[1]]]]],
           {}, {"a": 1}, [1, 2, "a"], "1e400"]


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out.extend(_paths(value, (*prefix, key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out.extend(_paths(value, (*prefix, i)))
    return out


def _get(node: Any, path: tuple) -> Any:
    for key in path:
        node = node[key]
    return node


def mutate(spec: dict[str, Any], rng: random.Random) -> tuple[dict[str, Any], str]:
    """One random mutation of a copy of ``spec``; returns it and what was done."""
    spec = copy.deepcopy(spec)
    kind = rng.choice(["swap", "number", "remove", "rename", "swap", "number"])
    ops = spec["ranks"][0]["ops"]
    if kind == "rename":
        op = rng.choice(ops)
        op["name"], op["schema"] = rng.choice(RENAMES)
        return spec, f"rename op {op.get('id')} to {op['name'][:40]!r}"
    paths = [p for p in _paths(spec) if p]
    if kind == "number":
        paths = [p for p in paths if type(_get(spec, p)) in (int, float)] or paths
    path = rng.choice(paths)
    parent = _get(spec, path[:-1])
    if kind == "remove":
        if isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
        return spec, f"remove {'.'.join(map(str, path))}"
    if kind == "number":
        value = rng.choice([-1, -(2**40), 2**40, 2**63 - 1, 2**64, 1e308, float("inf"), float("nan"), 0, -1e-3])
    else:
        value = rng.choice(HOSTILE)
    parent[path[-1]] = value
    return spec, f"set {'.'.join(map(str, path))} = {repr(value)[:40]}"


def aim_at_file(spec: dict[str, Any], target: Path) -> dict[str, Any]:
    """The file attack: map ``target`` into a tensor and overwrite it."""
    spec = copy.deepcopy(spec)
    name, schema = RENAMES[0]
    ref = [900001, 900002, 0, 8, 1, "cpu"]
    from_file = {"id": 900000, "name": name, "schema": schema, "step": 0, "tid": 1, "scopes": [],
                 "category": "memory", "inputs": {"values": [str(target), True, 8, 0, "<None>", "cpu", False],
                                                  "shapes": [[]] * 7, "strides": [[]] * 7,
                                                  "types": ["String", "Bool", "Int", "Int", "None", "Device", "Bool"]},
                 "outputs": {"values": [ref], "shapes": [[8]], "types": ["Tensor(unsigned char)"], "strides": [[1]]},
                 "tensor_range": {}, "tensor_data": {}, "dur_us": 1.0, "gap_us": 1.0, "deps": []}
    fill = {"id": 900003, "name": "aten::fill_", "schema": "aten::fill_.Scalar(Tensor(a!) self, Scalar value) -> "
            "Tensor(a!)", "step": 0, "tid": 1, "scopes": [], "category": "memory",
            "inputs": {"values": [ref, 65], "shapes": [[8], []], "types": ["Tensor(unsigned char)", "Int"],
                       "strides": [[1], []]},
            "outputs": {"values": [ref], "shapes": [[8]], "types": ["Tensor(unsigned char)"], "strides": [[1]]},
            "tensor_range": {}, "tensor_data": {}, "dur_us": 1.0, "gap_us": 1.0, "deps": []}
    spec["ranks"][0]["ops"][1:1] = [from_file, fill]
    return spec


def try_one(spec: dict[str, Any], work: Path, host_gaps: bool = True) -> str:
    """'replayed', 'refused' (the message the user would see) or 'crashed: ...'. ``host_gaps``: the replay
    calibrates its own cost per op call and spends the program's host time (the default run's way; some
    seconds of profiled steps per replay), else it runs its ops back to back (``workload.host_gaps=false``)."""
    from workloads.base import RunContext
    from workloads.trace_replay.config import GeneratedConfig
    from workloads.trace_replay.workload import GeneratedWorkload

    path = work / "spec.json"
    path.write_text(json.dumps(spec))
    ctx = RunContext(device=torch.device("cpu"), seed=0, work_dir=work)
    try:
        config = GeneratedConfig(spec=str(path), probe=False, op_timing=True, host_gaps=host_gaps)
        workload = GeneratedWorkload(config, ctx)
    except ValueError as err:  # the CLI's exit 2, with this message
        return "refused" if "workload.spec" in str(err) else f"crashed: {err}"
    try:
        workload.setup()
        for _ in range(2):
            workload.step()
        workload.observe_step_times([1e-3, 1e-3])
        workload.extra_metrics()
        workload.teardown()
    except Exception:  # noqa: BLE001 - anything here would have ended a user's run FAILED
        return "crashed: " + traceback.format_exc(limit=3)[-800:]
    return "replayed"


def main(argv: list[str]) -> int:
    out, seed, count, *spec_paths = argv
    rng = random.Random(int(seed))
    bases = [json.loads(Path(p).read_text()) for p in spec_paths]
    counts = {"tried": 0, "replayed": 0, "refused": 0, "crashed": 0}
    crashes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="cobench-fuzz-") as tmp:
        work = Path(tmp)
        sentinel = Path(out).parent / "sentinel.txt"
        mutants = []
        for i in range(int(count)):
            spec, what = mutate(bases[i % len(bases)], rng)
            mutants.append((spec, what))
        mutants += [(aim_at_file(base, sentinel), "aten::from_file at the sentinel") for base in bases]
        for i, (spec, what) in enumerate(mutants):
            outcome = try_one(spec, work, host_gaps=i % CALIBRATED_EVERY == 0 or i >= int(count))
            counts["tried"] += 1
            counts[outcome.split(":")[0]] += 1
            if outcome.startswith("crashed"):
                crashes.append(f"{what}: {outcome}")
            Path(out).write_text(json.dumps({"counts": counts, "crashes": crashes, "last": what}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main(sys.argv[1:]))
