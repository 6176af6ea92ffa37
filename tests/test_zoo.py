"""`cobench trace zoo` on a fast subset of the model zoo (the whole zoo: `nox -s zoo`, its own environment).

The subset runs what this environment has (transformers): GPT-2 and Wav2Vec2 (a conv encoder, time
masks drawn each step into boolean indices, a CTC loss over random-length labels), captured,
generated and replayed side by side as `nox -s zoo` does. Coverage and memory are asserted; the time
figure is reported, not asserted (this machine's load decides it). A program whose library does not
import here is reported as not run, with the reason, and the table and MLflow runs say so.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env, mlflow_runs

from suite.zoo import missing_modules
from suite.zoo_programs import ZOO

FAST = ["gpt2_lm", "wav2vec2_ctc"]


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("zoo")
    results, out = tmp / "results", tmp / "zoo"
    absent = next(name for name, p in ZOO.items() if missing_modules(p.requires))  # e.g. torchvision's here
    proc = subprocess.run([sys.executable, "-m", "suite.cli", "trace", "zoo", "--programs", ",".join([*FAST, absent]),
                           "--judgements", "1", "--rounds", "4", "--round-steps", "3", "--budget-s", "3",
                           "--baseline-steps", "5", "--out", str(out), f"results_dir={results}"],
                          capture_output=True, text=True, timeout=1200, env=clean_env(), cwd=tmp)
    return results, out, proc


def test_zoo_programs_replay_every_op_with_the_programs_memory(zoo_run):
    results, out, proc = zoo_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["program"]: row for row in json.loads((out / "zoo.json").read_text())}
    for name in FAST:
        row = rows[name]
        assert row["status"] == "judged", row
        assert row["op_coverage_pct"] == 100.0 and row["ops_divergent"] == 0.0, row["reason"]
        assert all(abs(m) <= 10.0 for m in row["memory_error_pct"]), row["memory_error_pct"]
        low, high = row["time_error_ci_pct"][0]
        assert low <= row["time_error_signed_pct"][0] <= high
        assert row["ops_per_step"] > 100 and row["step_ms"] > 0
        # where the figure lies, both sides measured again while judged: every part is a figure
        assert all(math.isfinite(row[part][0]) for part in ("host_shift_pct", "host_error_pct", "op_error_pct",
                                                             "time_error_judged_host_pct")), row
        print(f"{name}: time {row['time_error_signed_pct'][0]:+.1f} % [{low:+.1f}, {high:+.1f}], valid "
              f"{row['fidelity_valid'][0]}, memory {row['memory_error_pct'][0]:+.1f} %")


def test_zoo_table_names_what_did_not_run_and_lands_in_mlflow(zoo_run):
    results, out, proc = zoo_run
    rows = json.loads((out / "zoo.json").read_text())
    (absent,) = [r for r in rows if r["program"] not in FAST]
    assert absent["status"] == "not run" and "does not import here" in absent["reason"]
    table = (out / "zoo.md").read_text()
    assert "| gpt2_lm | transformers | judged |" in table and absent["program"] in table
    assert "programs judged: coverage 100 % on 2" in table
    assert "Had each replay spent the host time its program had while judged" in table
    assert "| host_shift_pct | host_error_pct | op_error_pct |" in table
    with (out / "zoo.csv").open() as f:
        assert [r["program"] for r in csv.DictReader(f)] == [*FAST, absent["program"]]
    runs = mlflow_runs(results)
    parent = next(r for r in runs if r.info.run_name == "trace_zoo")
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert set(children) == {*FAST, absent["program"]}
    assert children["gpt2_lm"].info.status == "FINISHED"
    assert children["gpt2_lm"].data.metrics["op_coverage_pct"] == 100.0
    assert children[absent["program"]].info.status == "FAILED"
    assert "tables:" in proc.stdout and "zoo.md" in proc.stdout


def test_an_unknown_zoo_program_is_refused_before_anything_runs(tmp_path: Path):
    proc = subprocess.run([sys.executable, "-m", "suite.cli", "trace", "zoo", "--programs", "gpt2_lm,nonesuch",
                           f"results_dir={tmp_path}"], capture_output=True, text=True, timeout=300, env=clean_env(),
                          cwd=tmp_path)
    assert proc.returncode == 2 and "unknown zoo program(s) nonesuch" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "zoo").exists()
