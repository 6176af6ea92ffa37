"""A generated spec is untrusted input: replaying one touches nothing but the replay's own tensors.

The file attack (an edited spec that maps a file into a tensor and overwrites it), the
policy of what may run, resource limits, code injection through every field that reaches the
generated step code, and a fuzz corpus of mutated real specs — all through the real replay.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import clean_env, mlflow_runs
from spec_fuzz import aim_at_file, try_one

from workloads.trace_bundle import TraceError
from workloads.trace_replay.memory import estimate_peak_bytes
from workloads.trace_replay.policy import op_refusal
from workloads.trace_replay.safety import check_spec
from workloads.trace_replay.spec import generate_spec, write_spec

REPLAY = ["runner.warmup_steps=1", "runner.steps=3", "runner.progress=false"]
PAYLOAD = "__import__('pathlib').Path('PWNED').write_text('x')"


def _program(out: Path, read_file: Path | None = None) -> None:
    """A small training program; with ``read_file`` it also maps that file into a tensor each step."""
    from harness.traces.capture import capture

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)

    def step() -> None:
        x = torch.randn(32, 16)
        if read_file is not None:
            x = x + torch.from_file(str(read_file), shared=False, size=16, dtype=torch.uint8).float()
        loss = torch.nn.functional.gelu(lin(x), approximate="tanh").div(3.0, rounding_mode="floor").sum()
        loss.backward()
        opt.step()
        opt.zero_grad()

    with capture(out, steps=2, warmup=1, baseline_steps=3, source="safety_program") as cap:
        while not cap.done:
            with cap.step():
                step()


@pytest.fixture(scope="module")
def program_spec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("safe")
    _program(work / "bundle")
    return write_spec(generate_spec(work / "bundle"), work / "spec.json")


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "suite.cli", *args], capture_output=True, text=True, timeout=300,
                          env=clean_env(), cwd=cwd)


def _attack(program_spec: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(victim file, spec edited to map it into a tensor and overwrite it): the file attack."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious data\n")
    evil = tmp_path / "evil.json"
    evil.write_text(json.dumps(aim_at_file(json.loads(program_spec.read_text()), victim)))
    return victim, evil


def test_a_spec_edited_to_overwrite_a_file_is_refused_naming_the_op(program_spec: Path, tmp_path: Path):
    victim, evil = _attack(program_spec, tmp_path)
    results = tmp_path / "results"
    proc = _run("run", "workload=generated", f"workload.spec={evil}", *REPLAY, f"results_dir={results}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "aten::from_file" in proc.stderr and "workload.trust_spec=true" in proc.stderr
    assert victim.read_text() == "precious data\n"
    assert mlflow_runs(results) == []  # refused before any run existed


def test_trusting_a_spec_is_an_explicit_opt_in_that_is_logged(program_spec: Path, tmp_path: Path):
    victim, evil = _attack(program_spec, tmp_path)
    results = tmp_path / "results"
    proc = _run("run", "workload=generated", f"workload.spec={evil}", "workload.trust_spec=true",
                "workload.probe=false", *REPLAY, f"results_dir={results}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "WITH ops the replay policy refuses: aten::from_file" in proc.stderr
    (run,) = mlflow_runs(results)
    assert run.data.tags["trusted_unsafe_ops"] == "aten::from_file"
    assert victim.read_text().startswith("AAAAAAAA")  # what the user vouched for really ran


def test_a_program_that_reads_a_file_is_flagged_when_its_spec_is_generated(tmp_path: Path):
    data = tmp_path / "data.bin"
    data.write_bytes(bytes(range(16)))
    _program(tmp_path / "bundle", read_file=data)
    proc = _run("trace", "generate", str(tmp_path / "bundle"), "--out", str(tmp_path / "spec.json"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "aten::from_file: maps a file into a tensor" in proc.stderr and "workload.trust_spec=true" in proc.stderr
    with pytest.raises(TraceError, match="aten::from_file"):
        check_spec(json.loads((tmp_path / "spec.json").read_text()), tmp_path / "spec.json")


@pytest.mark.parametrize("name,schema,why", [
    ("aten::from_file", "aten::from_file(str filename, bool? shared=None, int? size=0) -> Tensor", "file"),
    ("aten::set_", "aten::set_.source_Storage(Tensor(a!) self, Storage source) -> Tensor(a!)", "raw storage"),
    ("aten::manual_seed", "aten::manual_seed(int seed) -> ()", "reseeds"),
    ("aten::_record_function_enter_new", "aten::_record_function_enter_new(str name, str? args=None) -> Tensor",
     "profiler"),
    ("profiler::_record_function_exit", "profiler::_record_function_exit(Tensor x) -> ()", "namespace 'profiler::'"),
    ("mylib::my_op", "mylib::my_op(Tensor x) -> Tensor", "namespace 'mylib::'"),
    ("aten::relu", "aten::from_file(str filename) -> Tensor", "file"),  # the name disguises what is called
    ("aten::load_weights", "aten::load_weights(Tensor self, str path) -> Tensor", "takes a path"),
])
def test_the_policy_refuses_ops_that_reach_outside_the_tensors(name: str, schema: str, why: str):
    assert why in (op_refusal(name, schema) or "")


@pytest.mark.parametrize("name,schema", [
    ("aten::mm", "aten::mm(Tensor self, Tensor mat2) -> Tensor"),
    ("aten::div", "aten::div.Tensor_mode(Tensor self, Tensor other, *, str? rounding_mode) -> Tensor"),
    ("fbgemm::asynchronous_complete_cumsum", "fbgemm::asynchronous_complete_cumsum(Tensor t_in) -> Tensor"),
    ("c10d::allreduce_", "c10d::allreduce_(Tensor[] tensors, __torch__.torch.classes.c10d.ProcessGroup "
                         "process_group, __torch__.torch.classes.c10d.ReduceOp reduce_op, Tensor? sparse_indices, "
                         "bool asyncOp, int timeout) -> (Tensor[], __torch__.torch.classes.c10d.Work)"),
])
def test_the_policy_lets_tensor_compute_and_collectives_replay(name: str, schema: str):
    assert op_refusal(name, schema) is None


def test_a_spec_too_big_for_the_device_is_refused_with_both_figures(program_spec: Path, tmp_path: Path):
    spec = json.loads(program_spec.read_text())
    peak = estimate_peak_bytes(spec["ranks"][0])
    assert 0 < peak < 64 * 2**20
    check_spec(spec, program_spec, memory_limit_bytes=peak)  # fits exactly
    with pytest.raises(TraceError, match=r"need an estimated .* MiB .* more than the 0 MiB"):
        check_spec(spec, program_spec, memory_limit_bytes=peak - 1)
    # an op claiming a 2^40-element float output: 4 TiB, refused before anything is allocated
    op = next(op for op in spec["ranks"][0]["ops"] if op["name"] == "aten::randn")
    op["outputs"]["shapes"][0] = [2**20, 2**20]
    op["outputs"]["strides"][0] = [2**20, 1]
    big = write_spec(spec, tmp_path / "big.json")
    proc = _run("run", "workload=generated", f"workload.spec={big}", *REPLAY, f"results_dir={tmp_path / 'res'}",
                cwd=tmp_path)
    assert proc.returncode == 2 and "4,194,304 MiB" in proc.stderr, proc.stderr[-2000:]
    # the seconds its calibrations may take: a number >= 0, refused before anything runs
    proc = _run("run", "workload=generated", f"workload.spec={program_spec}", "workload.calibration_s=-1", *REPLAY,
                f"results_dir={tmp_path / 'res2'}", cwd=tmp_path)
    assert proc.returncode == 2 and "workload.calibration_s" in proc.stderr and ">= 0" in proc.stderr, \
        proc.stderr[-2000:]


def test_what_a_composite_kept_whole_held_is_checked_and_counted_before_any_run(program_spec: Path):
    """``held_bytes`` (what a composite op the replay keeps whole held at its return, made right after it)
    is memory the replay allocates: counted in the estimate the device's memory is checked against, and
    refused when it is not a byte count."""
    spec = json.loads(program_spec.read_text())
    rank = spec["ranks"][0]
    peak = estimate_peak_bytes(rank)
    rank["ops"][1]["held_bytes"] = 2**40  # 1 TiB claimed by one op
    assert estimate_peak_bytes(rank) >= 2**40
    with pytest.raises(TraceError, match=r"need an estimated .* MiB"):
        check_spec(spec, program_spec, memory_limit_bytes=peak + 2**30)
    rank["ops"][1]["held_bytes"] = -4096
    with pytest.raises(TraceError, match=r"held_bytes"):
        check_spec(spec, program_spec)


@pytest.mark.parametrize("value", [0, -2, 1.5, "3", True])
def test_where_a_collective_was_waited_for_must_be_a_count_of_ops_after_it(program_spec: Path, value: object):
    spec = json.loads(program_spec.read_text())
    spec["ranks"][0]["ops"][1]["waited_after_ops"] = value
    with pytest.raises(TraceError, match=r"ops\[1\]\.waited_after_ops"):
        check_spec(spec, program_spec)
    spec["ranks"][0]["ops"][1]["waited_after_ops"] = 3
    check_spec(spec, program_spec)


@pytest.mark.parametrize("field", ["name", "schema", "str_argument", "int_argument", "gap", "tensor_id", "scope",
                                   "category", "step", "repeat", "tensor_data_key", "list_argument"])
def test_nothing_in_a_spec_is_executed(program_spec: Path, tmp_path: Path, monkeypatch, field: str):
    """Code hidden in any field that reaches the generated step code never runs: the spec is refused,
    or it replays with the text as data (an op that rejects it fails, recorded)."""
    monkeypatch.chdir(tmp_path)
    spec = json.loads(program_spec.read_text())
    ops = spec["ranks"][0]["ops"]
    div = next(op for op in ops if op["name"] == "aten::div" and "rounding_mode" in op["schema"])
    gelu = next(op for op in ops if op["name"] == "aten::gelu")
    view = next(op for op in ops if "SymInt[]" in op["schema"] and op["inputs"]["types"][1] == "GenericList[Int]")
    if field == "name":
        div["name"] = PAYLOAD
    elif field == "schema":
        div["schema"] = f"aten::div.Tensor_mode(Tensor self, Tensor other, *, str? rounding_mode={PAYLOAD!r}) -> Tensor"
    elif field == "str_argument":  # a schema `str`: reaches the code as a literal, the op refuses the value
        div["inputs"]["values"][2] = f"floor'); {PAYLOAD} #"
        gelu["inputs"]["values"][1] = f'tanh"); {PAYLOAD} #'
    elif field == "int_argument":
        view["inputs"]["values"][1] = PAYLOAD
    elif field == "list_argument":
        view["inputs"]["values"][1] = [PAYLOAD]
    elif field == "gap":
        ops[3]["gap_us"] = PAYLOAD
    elif field == "tensor_id":
        div["inputs"]["values"][0][0] = PAYLOAD
    elif field == "scope":
        div["scopes"] = [PAYLOAD]
    elif field == "category":
        div["category"] = PAYLOAD
    elif field == "step":
        div["step"] = PAYLOAD
    elif field == "repeat":
        spec["options"]["repeat"] = PAYLOAD
    elif field == "tensor_data_key":
        div["tensor_data"] = {PAYLOAD: "AAAA"}
    outcome = try_one(spec, tmp_path)
    assert outcome in ("refused", "replayed"), outcome
    assert not (tmp_path / "PWNED").exists()
    if field == "str_argument":
        assert outcome == "replayed"  # schema-valid strings are data: the ops reject them at run time


def test_fuzz_corpus_every_mutant_replays_or_is_refused(program_spec: Path, tmp_path: Path):
    """Specs mutated at random from a real one: none crashes, hangs or touches a file."""
    out = tmp_path / "fuzz.json"
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text("untouched\n")
    before = {p.name for p in tmp_path.iterdir()}
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "spec_fuzz.py"), str(out), "21", "150",
                           str(program_spec)], capture_output=True, text=True, timeout=900, env=clean_env(),
                          cwd=tmp_path)
    report = json.loads(out.read_text())
    assert proc.returncode == 0, f"the fuzz died (rc {proc.returncode}) at {report['last']}: {proc.stderr[-2000:]}"
    counts = report["counts"]
    assert counts["tried"] == 151 and counts["crashed"] == 0, report["crashes"][:5]
    assert counts["refused"] > 0 and counts["replayed"] > 0
    assert sentinel.read_text() == "untouched\n"
    assert {p.name for p in tmp_path.iterdir()} - before == {"fuzz.json"}
