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

from suite.zoo import markdown, missing_modules
from suite.zoo_programs import ZOO

FAST = ["gpt2_lm", "wav2vec2_ctc"]


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("zoo")
    results, out = tmp / "results", tmp / "zoo"
    absent = next(name for name, p in ZOO.items() if missing_modules(p.requires))  # e.g. torchvision's here
    proc = subprocess.run([sys.executable, "-m", "suite.cli", "trace", "zoo", "--programs", ",".join([*FAST, absent]),
                           "--judgements", "2", "--rounds", "4", "--round-steps", "3", "--budget-s", "3",
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
        # each judgement a fresh capture in a process of its own: its bundle, its record and its log
        assert len(row["time_error_signed_pct"]) == len(row["rounds"]) == 2
        for j in range(2):
            assert (out / name / f"judgement{j}" / "fidelity.json").is_file()
            assert f"{name}: replay " in (out / name / f"log{j}.txt").read_text()
        low, high = row["time_error_ci_pct"][0]
        assert low <= row["time_error_signed_pct"][0] <= high
        assert row["ops_per_step"] > 100 and row["step_ms"] > 0
        # where the figure lies, both sides measured again while judged: every part is a figure, or the
        # judgement says why not (the machine's load moved under every probe of a side)
        parts = ("host_shift_pct", "host_error_pct", "op_error_pct", "time_error_judged_host_pct")
        assert all(math.isfinite(row[part][0]) for part in parts) or \
            any("not measured again" in note for note in row["notes"]), row
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
    if any(math.isfinite(r.get("time_error_judged_host_pct", [math.nan])[0]) for r in rows if r["program"] in FAST):
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


def test_a_judgement_that_could_not_measure_its_host_time_again_is_named_under_the_table():
    """Where every probe of a side was spoilt by the machine's load, the row's error parts are absent: the
    table's summary counts only the programs measured, and a note under the table says which and why."""
    def row(program: str, moved: float, notes: list[str]) -> dict:
        return {"program": program, "library": "lib", "status": "judged", "ops_per_step": 100.0, "step_ms": 5.0,
                "op_coverage_pct": 100.0, "time_error_signed_pct": [1.0], "time_error_ci_pct": [[0.0, 2.0]],
                "fidelity_valid": [True], "judgements_overlap": True, "memory_error_pct": [0.5],
                "capture_overhead_pct": 3.0, "rounds": [8], "reasons": [""], "briefs": ["-"], "reason": "",
                "notes": notes,
                **{part: [moved] for part in ("host_shift_pct", "host_error_pct", "op_error_pct",
                                              "time_error_judged_host_pct")}}

    note = "the host and op time were not measured again on every side: ..."
    table = markdown([row("a", 1.5, []), row("b", math.nan, [note])], "# zoo")
    assert "(1 of 2, those measured again on every side): within 5 % on 1" in table
    assert f"- **b**: {note}" in table.split("What a judgement could not measure:", 1)[1]
    assert "What a judgement could not measure" not in markdown([row("a", 1.5, [])], "# zoo")


def _record(side, **found) -> dict:
    """A judgement's record as the judge writes it, of a summarised side-by-side and what else it found."""
    return {"metrics": side.metrics(), "side_by_side": {"invalid_reason": side.invalid_reason}, **found}


def test_the_tables_short_reason_names_what_made_a_verdict_not_valid():
    """The table's reason column says in a few words, from the judgement's record, why a verdict is not valid: a
    replay whose ops failed is not the same finding as captured steps unlike the program's typical ones (a layer
    dropped at random), nor as an interval too wide."""
    from harness.traces.side_by_side import SideBySide
    from suite.zoo import brief
    from workloads.trace_replay.fidelity import unrepresentative_reason

    class Step:
        kineto_ops, program_kineto_ops = 997, 930.0

    source, order = [[10.0, 10.1] for _ in range(20)], ["source", "replay"] * 10
    narrow = SideBySide(source, [[10.2, 10.1] for _ in range(20)], order, budget_s=60.0, elapsed_s=30.0).summarise()
    assert narrow.fidelity_valid and brief(_record(narrow)) == "-"
    narrow.fidelity_valid = False  # as the judge marks one whose replay is not the program
    assert brief(_record(narrow, unrepresentative=unrepresentative_reason([Step()]))) == \
        "captured steps not the program's typical ones"
    assert brief(_record(narrow, unfaithful="2 ops failed (aten::foo)")) == "ops failed or diverged"
    few = SideBySide(source[:6], [[10.2, 10.1] for _ in range(6)], order[:6], budget_s=60.0, elapsed_s=9.0).summarise()
    assert brief(_record(few)) == "too few rounds"


def test_the_tables_short_reason_says_whether_a_larger_budget_would_have_given_a_verdict():
    """An interval too wide for a verdict: the table's reason column says whether more budget would have
    narrowed it (and about how much, as the judge's reason says), that no budget would (the capture's spread
    holding it), or that more rounds than a judgement runs would be needed."""
    import random

    from harness.traces.side_by_side import SideBySide, above
    from suite.zoo import brief

    rng = random.Random(3)
    source = [[10.0] for _ in range(60)]
    replay = [[10.3 * math.exp(rng.gauss(0.0, 0.12))] for _ in range(60)]
    order = ["source", "replay"] * 30
    budget = SideBySide(source, replay, order, budget_s=60.0, elapsed_s=59.0).summarise()
    seconds = math.ceil(59.0 * budget.rounds_needed / 60)
    assert f"a budget of about {seconds} s (--budget-s)" in budget.invalid_reason
    assert brief(_record(budget)) == \
        f"interval ±{budget.half_width_pct:.1f} %, budget spent: about {seconds} s would narrow it"
    held = SideBySide(source, replay, order, budget_s=60.0, elapsed_s=59.0,
                      replay_shift_ms=[rng.gauss(0.0, 0.5) for _ in range(2000)]).summarise()
    assert f"no number of rounds narrows it below ±{held.floor_half_width_pct:.1f} %" in held.invalid_reason
    assert brief(_record(held)) == (f"interval ±{held.half_width_pct:.1f} %, budget spent: no budget narrows "
                                    f"it below ±{held.floor_half_width_pct:.1f} %")
    scattered = SideBySide(source, [[10.3 * math.exp(rng.gauss(0.0, 0.6))] for _ in range(60)], order,
                           budget_s=60.0, elapsed_s=59.0).summarise()
    assert brief(_record(scattered)).endswith("budget spent: beyond the rounds a judgement runs")
    fixed = SideBySide(source, replay, order).summarise()  # a fixed number of rounds: no budget to name
    assert brief(_record(fixed)).startswith(f"interval ±{fixed.half_width_pct:.1f} %, 60 rounds")
    # a half-width just above the target reads above it, in the judge's reason and the table alike
    assert (above(2.53, 2.5), above(2.56, 2.5), above(4.04, 2.5)) == ("2.53", "2.6", "4.0")


def test_a_judgement_that_fails_or_runs_out_of_time_names_itself_and_its_log(tmp_path: Path):
    """Each judgement runs in a child process of its own: one that fails, or outlasts the program's time, ends
    the program's row as failed with which judgement it was, why, and where its log is; no later one runs."""
    from suite.zoo import run_program

    options = {"judgements": 2, "rounds": 4, "steps_per_round": 3, "warmup": 1, "capture_steps": 1,
               "baseline_steps": 2, "budget_s": 1.0}
    row = run_program("gpt2_lm", tmp_path / "bad", {**options, "no_such_option": 1}, timeout_s=300)
    assert row["status"] == "failed" and row["reason"].startswith("judgement 1 of 2: exit 1:"), row
    assert "no_such_option" in row["reason"] and str(tmp_path / "bad" / "log0.txt") in row["reason"]
    assert "no_such_option" in (tmp_path / "bad" / "log0.txt").read_text()
    assert not (tmp_path / "bad" / "log1.txt").exists()
    row = run_program("gpt2_lm", tmp_path / "slow", options, timeout_s=1)
    assert row["status"] == "failed", row
    assert row["reason"].startswith("judgement 1 of 2 did not finish within the program's 1 s"), row
    assert (tmp_path / "slow" / "log0.txt").is_file()
