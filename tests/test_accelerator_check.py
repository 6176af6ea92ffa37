"""The accelerator check: its dry run on this CPU (every step that needs no accelerator, at tiny sizes), in a
bare venv with torch, a GPU image's common packages and the wheelhouse, offline; its budget, refusals and report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import suite.accelerator_check.check as accelerator_check
from suite.accelerator_check.check import STEPS
from suite.accelerator_check.framework import FAIL, PASS, SKIPPED, Outcome, Step
from suite.accelerator_check.report import markdown

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tools" / "accelerator_check.py"


def test_no_accelerator_is_refused_without_the_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, str(CHECK), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--platform cpu" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_step_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, str(CHECK), str(tmp_path), "--platform", "cpu", "--only", "llama,codec"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "unknown step(s) llama" in proc.stderr and "llama_tiny_bf16" in proc.stderr


def test_a_step_that_does_not_fit_the_budget_is_skipped_saying_so(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(accelerator_check, "STEPS", [
        Step("quick", "q", lambda check: ran.append("quick") or Outcome("quick", PASS), 0),
        Step("long", "l", lambda check: ran.append("long") or Outcome("long", PASS), 1e6),
        Step("broken", "b", lambda check: 1 / 0, 0),
    ])
    outcomes = accelerator_check.run_check(tmp_path, dry_run=True, budget_s=60)
    assert ran == ["quick"]
    assert [(o.step, o.status) for o in outcomes] == [("quick", PASS), ("long", SKIPPED), ("broken", FAIL)]
    assert "time budget" in outcomes[1].reason and "ZeroDivisionError" in outcomes[2].reason
    written = json.loads((tmp_path / "check.json").read_text())  # what a stopped check leaves is the same
    assert [s["status"] for s in written["steps"]] == [PASS, SKIPPED, FAIL]


def test_markdown_shows_failures_with_their_command():
    text = markdown([Outcome("a", PASS, figures={"mfu": 0.41234}), Outcome("b", FAIL, "boom\nline 2",
                                                                          command="python -m x")], {"mode": "m"})
    assert "| a | PASS | 0 | mfu 0.412 |  |" in text
    assert "## b: FAIL" in text and "`python -m x`" in text and "line 2" in text


@pytest.mark.slow
def test_a_dry_run_of_the_steps_each_kind_of_step_passes(tmp_path):
    """CI's subset of the dry run, in the project's environment: the doctor, a child-process step (the codec),
    a training run, a serving run, a torchrun step and DLRM (TorchRec here)."""
    only = ["doctor", "codec", "llama_tiny_bf16", "infer_offline", "collectives", "dlrm"]
    proc = subprocess.run([sys.executable, str(CHECK), str(tmp_path), "--platform", "cpu", "--only", ",".join(only)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = {s["step"]: s for s in json.loads((tmp_path / "check.json").read_text())["steps"]}
    assert {name: s["status"] for name, s in steps.items()} == dict.fromkeys(only, PASS)
    assert steps["collectives"]["figures"]["world_size"] == 2 and steps["dlrm"]["figures"]["throughput"] > 0
    assert all(row["bound_violations"] == 0 for row in steps["codec"]["figures"]["table"]
               if row["codec"].startswith("eb"))
    assert f"{len(only)} PASS, 0 FAIL, 0 SKIPPED" in proc.stdout


@pytest.mark.wheelhouse
def test_the_dry_run_passes_offline_in_a_bare_venv_with_torch_and_the_wheelhouse(tmp_path):
    """What the GPU machine has (torch and a GPU image's common packages, none of cobench's own dependencies,
    no network) plus the wheelhouse runs the whole dry run: the wheels are installed offline by the check's
    first lines, every step that needs no accelerator passes, and DLRM/seqrec (no TorchRec there, as on the
    GPU image) are SKIPPED with the import that failed."""
    wheels = tmp_path / "wheels"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    built = subprocess.run(["bash", str(ROOT / "tools" / "wheelhouse.sh"), str(wheels), version, "--no-bundle"],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert built.returncode == 0, built.stderr[-2000:]
    sizes = sum(f.stat().st_size for f in wheels.glob("*.whl"))
    assert 0 < sizes < 8 << 20  # far inside the 64 MiB a working tree may carry
    bare = tmp_path / "venv"
    venv.create(bare, with_pip=True)
    python = bare / "bin" / "python"
    # the GPU image's packages cobench uses (torch from this machine's disk, the CPU build)
    image = ["torch==2.13.0", "numpy", "packaging", "pyyaml", "rich", "psutil", "jinja2", "pandas", "scipy", "ninja"]
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *image], check=True, timeout=900)
    missing = subprocess.run([str(python), "-c", "import hydra"], capture_output=True, timeout=60)
    assert missing.returncode != 0  # bare: cobench's own dependencies are not there
    checkout = tmp_path / "checkout"  # the working tree as it travels (tracked and not ignored), wheels in .whl/
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], capture_output=True, text=True,
                            check=True, cwd=ROOT).stdout.splitlines()
    for name in listed:
        if (ROOT / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            (checkout / name).write_bytes((ROOT / name).read_bytes())
    (checkout / ".whl").mkdir()
    for wheel in wheels.glob("*.whl"):
        (checkout / ".whl" / wheel.name).write_bytes(wheel.read_bytes())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env |= {"PIP_NO_INDEX": "1", "TMPDIR": str(tmp_path)}  # offline: pip may not reach an index
    out = tmp_path / "out"
    proc = subprocess.run([str(python), "tools/accelerator_check.py", str(out), "--platform", "cpu",
                           "--budget-s", "1200"], capture_output=True, text=True, timeout=1500, cwd=checkout, env=env)
    assert "installing 5 wheels" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    record = json.loads((out / "check.json").read_text())
    assert record["mode"] == "dry run on the CPU"
    steps = {s["step"]: s for s in record["steps"]}
    assert list(steps) == [s.name for s in STEPS]  # every step has its verdict, in order
    for step in STEPS:
        expected = SKIPPED if step.accelerator_only or step.name in ("dlrm", "seqrec") else PASS
        assert steps[step.name]["status"] == expected, (step.name, steps[step.name])
    assert "TorchRec + fbgemm-gpu do not load here" in steps["dlrm"]["reason"]
    figures = {name: step["figures"] for name, step in steps.items()}
    assert figures["llama_tiny_bf16"]["throughput"] > 0 and figures["llama_tiny_bf16"]["peak_memory_mb"] > 0
    assert figures["moe_tiny"]["expert_load_max_over_mean"] >= 1.0
    assert figures["collectives"] == {**figures["collectives"], "backend": "gloo", "world_size": 2}
    assert all(row["bound_violations"] == 0 for row in figures["codec"]["table"] if row["codec"].startswith("eb"))
    assert figures["portability"]["judgement"] in ("portability", "cross_process")
    assert figures["portability"]["replay_peak_memory_mb"] > 0 and figures["portability"]["source_peak_memory_mb"] > 0
    # the source's own spread beside the verdict (where the error lies too, when the host probe gave a figure)
    assert figures["trace_fidelity"]["source_round_cv_pct"] > 0
    doctor = json.loads((out / "doctor.json").read_text())
    assert doctor["workloads"]["llama"]["supported"] and not doctor["workloads"]["dlrm"]["supported"]
    table = (out / "check.md").read_text()
    assert "| llama_medium_compile | SKIPPED |" in table and "| codec | PASS |" in table
    assert f"{len(STEPS) - 4} PASS, 0 FAIL, 4 SKIPPED" in proc.stdout
