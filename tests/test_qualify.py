"""`cobench qualify`: real suite runs judged against gates and golden references, verdicts in MLflow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import clean_env, mlflow_runs

# The qualify suite, shortened: every benchmark (including the Llama capture + replay) still runs; the
# replay's side-by-side judgement is 2 rounds of 3 samples and at most 1 s more, not 10 rounds of 10 and up to
# 30 s (these tests judge the verdict path, not the figure).
_REPLAY = [b["name"] for b in yaml.safe_load((Path(__file__).resolve().parent.parent / "conf" / "suite" /
                                              "qualify.yaml").read_text())["benchmarks"]].index("llama_replay")
SHORT = ["platform=cpu", "runner.warmup_steps=1", "runner.steps=4", "runner.repetitions=2", "runner.eval_interval=0",
         "runner.progress=false", f"suite.benchmarks.{_REPLAY}.rounds=2", f"suite.benchmarks.{_REPLAY}.round_steps=3",
         f"suite.benchmarks.{_REPLAY}.budget_s=1"]


def _qualify(*args: str, results: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "suite.cli", "qualify", *args, *SHORT, f"results_dir={results}"],
                          capture_output=True, text=True, timeout=600, env=clean_env(), cwd=cwd)


def _gates(tmp: Path, golden: Path, **changes) -> Path:
    gates = {
        "platform": "cpu",
        "suite": "qualify",
        "golden": str(golden),
        # cv_max: 2 repetitions of 4 steps on a shared CPU spread widely; these tests judge the verdict path
        "defaults": {"throughput_tolerance": 0.9, "cv_max": 10.0, "loss_rtol": 0.02},
        "benchmarks": {
            "llama_tiny": {"gates": ["finished", "throughput", "cv", "loss_trajectory"]},
            "dlrm_tiny": {"gates": ["finished", "throughput", "loss_trajectory"]},
            "seqrec_tiny": {"gates": ["finished", "throughput"]},
            "moe_tiny": {"gates": ["finished"], "metrics": [{"metric": "tokens_dropped", "max": 0}]},
            "llama_replay": {"gates": ["finished"], "metrics": [{"metric": "op_coverage_pct", "min": 100}]},
        },
    }
    for key, value in changes.items():
        gates[key] = value
    path = tmp / f"gates-{len(list(tmp.glob('gates-*')))}.yaml"
    path.write_text(yaml.safe_dump(gates))
    return path


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(work dir, gates file, golden file) after recording a golden reference from a real run."""
    tmp = tmp_path_factory.mktemp("qualify")
    golden = tmp / "golden.yaml"
    gates = _gates(tmp, golden)
    proc = _qualify("--gates", str(gates), "--record-golden", "--runs", "2", results=tmp / "record", cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, gates, golden


def test_record_golden_writes_every_benchmark(recorded):
    _, _, golden = recorded
    data = yaml.safe_load(golden.read_text())
    assert data["suite"] == "qualify" and data["platform"] == "cpu" and data["source_run_id"]
    assert set(data["benchmarks"]) == {"llama_tiny", "dlrm_tiny", "seqrec_tiny", "moe_tiny", "llama_replay"}
    llama = data["benchmarks"]["llama_tiny"]
    assert llama["throughput"] > 0 and len(llama["train_loss"]) == 5 and llama["config_hash"]
    # the golden is the median of the recorded runs, each run's figure kept beside it
    assert data["runs"] == 2 and len(llama["throughput_runs"]) == 2
    assert llama["throughput"] == pytest.approx(sum(llama["throughput_runs"]) / 2)


def test_qualify_passes_against_its_golden_and_logs_the_verdict(recorded):
    tmp, gates, _ = recorded
    results = tmp / "pass"
    proc = _qualify("--gates", str(gates), results=results, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "verdict PASS" in proc.stdout
    (verdict_dir,) = (results / "qualify").iterdir()
    verdict = json.loads((verdict_dir / "verdict.json").read_text())
    assert verdict["verdict"] == "PASS" and verdict["gates_failed"] == 0 and verdict["gates_passed"] >= 10
    assert "| llama_tiny | loss_trajectory | PASS |" in (verdict_dir / "verdict.md").read_text()
    # numbers, not strings: the measured value, the bound and how they compare
    throughput = next(g for g in verdict["gates"] if (g["benchmark"], g["gate"]) == ("llama_tiny", "throughput"))
    assert isinstance(throughput["measured"], float) and isinstance(throughput["bound"], float)
    assert throughput["comparison"] == ">=" and throughput["measured"] >= throughput["bound"]
    parent = next(r for r in mlflow_runs(results) if r.data.tags.get("qualification") == "true")
    assert parent.data.tags["verdict"] == "PASS" and parent.data.metrics["gates_failed"] == 0
    assert parent.info.run_id == verdict["parent_run_id"]


def test_qualify_needs_no_tracking_store(recorded):
    """The loss trajectories come with the runs' results, not read back from MLflow: `tracking=off` qualifies."""
    tmp, gates, _ = recorded
    results = tmp / "untracked"
    proc = _qualify("--gates", str(gates), "tracking=off", results=results, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (verdict_dir,) = (results / "qualify").iterdir()
    verdict = json.loads((verdict_dir / "verdict.json").read_text())
    assert verdict["verdict"] == "PASS" and verdict["parent_run_id"] is None
    trajectory = next(g for g in verdict["gates"] if (g["benchmark"], g["gate"]) == ("llama_tiny", "loss_trajectory"))
    assert trajectory["passed"] and trajectory["detail"] == "5 points"  # compared on every step's loss
    assert not (results / "mlflow.db").exists()


def test_an_impossible_gate_fails_loudly(recorded):
    """Judged on two of the suite's benchmarks (`suite.only`, gated by a file that names just those two): the
    FAIL path is under test here, and the whole suite's run is the passing test's."""
    tmp, _, golden = recorded
    two = {"llama_tiny": {"gates": ["finished", "throughput", "cv", "loss_trajectory"]},
           "dlrm_tiny": {"gates": ["finished", "throughput", "loss_trajectory"]}}
    gates = _gates(tmp, golden, defaults={"throughput_tolerance": -9.0, "cv_max": 1.0, "loss_rtol": 0.02},
                   benchmarks=two)
    results = tmp / "fail"
    proc = _qualify("--gates", str(gates), "suite.only=[llama_tiny,dlrm_tiny]", results=results, cwd=tmp)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL llama_tiny throughput: measured" in proc.stderr and "required >=" in proc.stderr
    (verdict_dir,) = (results / "qualify").iterdir()
    verdict = json.loads((verdict_dir / "verdict.json").read_text())
    assert verdict["verdict"] == "FAIL"
    assert {g["benchmark"] for g in verdict["gates"]} == set(two)  # the two chosen, judged against the golden
    failed = {(g["benchmark"], g["gate"]) for g in verdict["gates"] if not g["passed"]}
    assert ("llama_tiny", "throughput") in failed and ("dlrm_tiny", "loss_trajectory") not in failed
    parent = next(r for r in mlflow_runs(results) if r.data.tags.get("qualification") == "true")
    assert parent.data.tags["verdict"] == "FAIL" and parent.data.metrics["gates_failed"] >= 1


def test_bad_gates_and_goldens_are_refused_before_anything_runs(recorded, tmp_path: Path, capsys, monkeypatch):
    """Each refusal through the command's own entry point (`suite.cli.main`), in this process: no interpreter
    and library start per case, the same exit code and message."""
    from suite.cli import main

    tmp, gates, golden = recorded
    results = tmp_path / "res"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # as clean_env() gives a command
    monkeypatch.chdir(tmp_path)

    def refused(*args: str, overrides: tuple[str, ...] = ()) -> str:
        code = main(["qualify", *args, *SHORT, *overrides, f"results_dir={results}"])
        stderr = capsys.readouterr().err
        assert code == 2, stderr
        assert mlflow_runs(results) == []  # nothing ran
        return stderr

    assert "platform 'nowhere' has no gates" in refused(overrides=("platform.name=nowhere",))
    assert "no golden reference" in refused("--gates", str(gates), "--golden", str(tmp_path / "none.yaml"))
    other = yaml.safe_load(golden.read_text()) | {"suite_version": 99}
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(other))
    assert "version 99" in refused("--gates", str(gates), "--golden", str(tmp_path / "old.yaml"))
    assert "another configuration" in refused("--gates", str(gates), overrides=("runner.steps=5",))
    bad = _gates(tmp_path, golden, benchmarks={"llama_tiny": {"gates": ["fast_enough"]}})
    assert "unknown gate(s) ['fast_enough']" in refused("--gates", str(bad))
    typo = _gates(tmp_path, golden, defaults={"throughput_tolerence": 0.1})
    assert "unknown key(s) ['throughput_tolerence']" in refused("--gates", str(typo))
    # a tolerance comes from the gates file or nowhere: no silent built-in default
    unset = _gates(tmp_path, golden, defaults={"throughput_tolerance": 0.9, "loss_rtol": 0.02})
    assert "gate 'cv' needs cv_max" in refused("--gates", str(unset))
