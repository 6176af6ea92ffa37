"""``cobench trace zoo``: how far a generated benchmark can be trusted, judged on the model zoo.

Every program of :mod:`suite.zoo_programs` is judged ``judgements`` times, each in a fresh process of its
own (under torchrun with gloo when it spans ranks): built, captured, generated and replayed side by side
with itself (:func:`harness.traces.judge.judge`). Two judgements then differ by all that a capture can:
the program's warm-up, its allocator's state and the profiler's cost by kind of event, which a capture
measures once a process. The judgements give one row:
ops per step, step time, op coverage, the time error with its 95 % interval and verdict per
judgement, whether the judgements' intervals overlap, the memory error and the capture's overhead.
The table goes to ``zoo.md``, ``zoo.csv`` and ``zoo.json`` in the output folder and, one run per
program under a parent run, to MLflow.
"""

from __future__ import annotations

import csv
import importlib
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

COLUMNS = ["program", "library", "status", "ops_per_step", "step_ms", "op_coverage_pct", "time_error_pct",
           "time_interval_pct", "valid", "judgements_overlap", "host_shift_pct", "host_error_pct", "op_error_pct",
           "memory_error_pct", "capture_overhead_pct", "rounds", "reason"]
# where each judgement's time error lies, both sides measured again while judged (harness.traces.side_by_side)
ERROR_PARTS = ("host_shift_pct", "host_error_pct", "op_error_pct")


def missing_modules(requires: tuple[str, ...]) -> str:
    """Why a program cannot run here ('' when every module it needs imports)."""
    for module in requires:
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - any import failure: the program is not run, with the reason
            return f"{module} does not import here: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return ""


def judge_one(name: str, out: Path, *, rounds: int, steps_per_round: int, warmup: int, capture_steps: int,
              baseline_steps: int, budget_s: float = 60.0) -> dict[str, Any]:
    """Build the program and judge it once from a fresh capture into ``out``; this rank's fidelity record (rank 0
    writes it to ``out/fidelity.json``)."""
    import torch
    import torch.distributed as dist

    from harness.traces.judge import judge
    from suite.zoo_programs import ZOO

    program = ZOO[name]
    if program.world_size > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(1234 + rank)
    step, model = program.build()
    return judge(step, out, model=model, rounds=rounds, steps_per_round=steps_per_round, warmup=warmup,
                 capture_steps=capture_steps, baseline_steps=baseline_steps, source=name, verbose=rank == 0,
                 budget_s=budget_s)


def summarise(name: str, records: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """One row of the table from a program's judgement records."""
    from suite.zoo_programs import ZOO
    from workloads.trace_bundle import rank_dirs, read_meta

    program = ZOO[name]
    first = records[0]["metrics"]
    meta = read_meta(rank_dirs(out / "judgement0")[0])
    intervals = [(r["metrics"]["time_error_ci_low_pct"], r["metrics"]["time_error_ci_high_pct"]) for r in records]
    overlap = max(low for low, _ in intervals) <= min(high for _, high in intervals)
    reasons = [r["side_by_side"]["invalid_reason"] for r in records]
    return {
        "program": name, "library": program.library, "description": program.description, "status": "judged",
        "world_size": program.world_size,
        "ops_per_step": first["ops_per_step"], "step_ms": first["source_step_ms"],
        "op_coverage_pct": min(r["metrics"]["op_coverage_pct"] for r in records),
        "ops_divergent": max(r["metrics"].get("ops_divergent", 0.0) for r in records),
        "time_error_signed_pct": [r["metrics"]["time_error_signed_pct"] for r in records],
        "time_error_ci_pct": [list(i) for i in intervals],
        "fidelity_valid": [bool(r["metrics"]["fidelity_valid"]) for r in records],
        "judgements_overlap": overlap,
        "memory_error_pct": [r["metrics"].get("memory_error_pct", math.nan) for r in records],
        "capture_overhead_pct": meta.capture_overhead_pct,
        "rounds": [int(r["metrics"]["judgement_rounds"]) for r in records],
        "reasons": reasons,  # per judgement ('' for a valid one)
        "briefs": [brief(r) for r in records],  # the same in a few words ('-' for a valid one)
        "reason": "; ".join(dict.fromkeys(r for r in reasons if r)),
        "notes": list(dict.fromkeys(n for r in records for n in r["side_by_side"].get("notes", []))),
        "capture_half_width_pct": [r["metrics"].get("capture_half_width_pct", 0.0) for r in records],
        **{part: [r["metrics"].get(part, math.nan) for r in records]
           for part in (*ERROR_PARTS, "time_error_judged_host_pct")},
        "captured_step_peak_mb": first.get("captured_step_peak_mb"),
    }


def run_program(name: str, out: Path, options: dict[str, int], timeout_s: float) -> dict[str, Any]:
    """The program judged ``options["judgements"]`` times, each in a process of its own (torchrun for several
    ranks) into ``out/judgement<j>``; its row, or why it has none. ``timeout_s`` covers all its judgements."""
    from harness.traces.judge import FIDELITY_FILE
    from suite.zoo_programs import ZOO

    program = ZOO[name]
    base = {"program": name, "library": program.library, "description": program.description,
            "world_size": program.world_size}
    missing = missing_modules(program.requires)
    if missing:
        return {**base, "status": "not run", "reason": missing}
    out.mkdir(parents=True, exist_ok=True)
    options = dict(options)
    judgements = options.pop("judgements")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    records = []
    for j in range(judgements):
        where = out / f"judgement{j}"
        args = ["-m", "suite.zoo", name, str(where), json.dumps(options)]
        if program.world_size > 1:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc-per-node={program.world_size}", *args]
        else:
            command = [sys.executable, *args]
        log, record_path = out / f"log{j}.txt", where / FIDELITY_FILE
        record_path.unlink(missing_ok=True)  # a record left by an earlier run in this folder is not this one's
        left = timeout_s - (time.perf_counter() - started)
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=max(left, 1.0))
        except subprocess.TimeoutExpired as err:
            log.write_text(_text(err.stdout) + _text(err.stderr))
            return {**base, "status": "failed",
                    "reason": f"judgement {j + 1} of {judgements} did not finish within the program's "
                              f"{timeout_s:.0f} s (log: {log})"}
        log.write_text(done.stdout + done.stderr)
        if done.returncode != 0 or not record_path.is_file():
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            return {**base, "status": "failed",
                    "reason": f"judgement {j + 1} of {judgements}: exit {done.returncode}: {tail[:300]} (log: {log})"}
        records.append(json.loads(record_path.read_text()))
    row = summarise(name, records, out)
    row["wall_s"] = time.perf_counter() - started
    return row


def _text(output: str | bytes | None) -> str:
    """What a timed-out child had printed (bytes or str, or nothing)."""
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def _pm(values: list[float], fmt: str = "+.1f") -> str:
    return " / ".join(format(v, fmt) for v in values)


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The rows as the table shows them (one judgement's figures after another, separated by '/')."""
    shown = []
    for row in rows:
        if row["status"] != "judged":
            shown.append({c: "" for c in COLUMNS} | {"program": row["program"], "library": row["library"],
                                                     "status": row["status"], "reason": row.get("reason", "")})
            continue
        shown.append({
            "program": row["program"], "library": row["library"], "status": row["status"],
            "ops_per_step": f"{row['ops_per_step']:.0f}", "step_ms": f"{row['step_ms']:.2f}",
            "op_coverage_pct": "100" if row["op_coverage_pct"] == 100.0 else f"{row['op_coverage_pct']:.2f}",
            "time_error_pct": _pm(row["time_error_signed_pct"]),
            "time_interval_pct": " / ".join(f"[{lo:+.1f}, {hi:+.1f}]" for lo, hi in row["time_error_ci_pct"]),
            "valid": " / ".join("yes" if v else "no" for v in row["fidelity_valid"]),
            "judgements_overlap": "yes" if row["judgements_overlap"] else "no",
            **{part: _pm(row.get(part, [math.nan])) for part in ERROR_PARTS},
            "memory_error_pct": _pm(row["memory_error_pct"]),
            "capture_overhead_pct": f"{row['capture_overhead_pct']:+.0f}",
            "rounds": " / ".join(str(r) for r in row["rounds"]),
            "reason": " / ".join(row["briefs"]),
        })
    return shown


def brief(record: dict[str, Any]) -> str:
    """A judgement's verdict in a few words, from its record's figures (the notes under the table give the
    judge's reason whole): '-' for a valid one."""
    from harness.traces.side_by_side import MAX_ROUNDS, MIN_VALID_ROUNDS, TARGET_HALF_WIDTH_PCT, above

    metrics = record["metrics"]
    if metrics["fidelity_valid"]:
        return "-"
    words = []
    if record.get("unfaithful"):
        words.append("ops failed or diverged")
    if record.get("unrepresentative"):
        words.append("captured steps not the program's typical ones")
    rounds = int(metrics["judgement_rounds"])
    if rounds < MIN_VALID_ROUNDS:
        words.append("too few rounds")
    half, target = metrics["time_error_ci_pct"], metrics.get("time_error_ci_target_pct", TARGET_HALF_WIDTH_PCT)
    if not half <= target:
        # what more rounds would do, as the judge worked it out (harness.traces.side_by_side.rounds_to_narrow)
        floor = metrics.get("time_error_floor_half_width_pct", math.nan)
        budget = metrics.get("judgement_budget_needed_s", math.nan)
        ended = (f"{MAX_ROUNDS} rounds run" if rounds >= MAX_ROUNDS else
                 "budget spent" if "judgement_budget_s" in metrics else f"{rounds} rounds")
        more = (f"no budget narrows it below ±{above(floor, target)} %" if floor > target else
                f"about {budget:.0f} s would narrow it" if math.isfinite(budget) else
                "beyond the rounds a judgement runs" if not math.isfinite(metrics.get("judgement_rounds_needed", 0))
                else "")
        words.append(f"interval ±{above(half, target)} %, {ended}" + (f": {more}" if more else ""))
    return ", ".join(words) or record["side_by_side"]["invalid_reason"][:60]


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    shown = table_rows(rows)
    lines = [header, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r[c].replace("|", "\\|") for c in COLUMNS) + " |" for r in shown]
    judged = [r for r in rows if r["status"] == "judged"]
    if judged:
        within5 = sum(all(abs(e) <= 5 for e in r["time_error_signed_pct"]) for r in judged)
        within10 = sum(all(abs(e) <= 10 for e in r["time_error_signed_pct"]) for r in judged)
        lines += ["", f"{len(judged)} programs judged: coverage 100 % on "
                      f"{sum(r['op_coverage_pct'] == 100.0 for r in judged)}, memory within 10 % on "
                      f"{sum(all(abs(m) <= 10 for m in r['memory_error_pct']) for r in judged)}, every verdict valid "
                      f"on {sum(all(r['fidelity_valid']) for r in judged)}, time within 5 % on {within5} and within "
                      f"10 % on {within10} (every judgement), intervals overlapping on "
                      f"{sum(r['judgements_overlap'] for r in judged)}."]
        moved = [errors for errors in (r.get("time_error_judged_host_pct", [math.nan]) for r in judged)
                 if all(math.isfinite(e) for e in errors)]
        if moved:
            of = "" if len(moved) == len(judged) else \
                f" ({len(moved)} of {len(judged)}, those measured again on every side)"
            lines[-1] += (f" Had each replay spent the host time its program had while judged (not the capture's)"
                          f"{of}: within 5 % on {sum(all(abs(e) <= 5 for e in errors) for errors in moved)} and "
                          f"within 10 % on {sum(all(abs(e) <= 10 for e in errors) for errors in moved)}.")
    notes = [f"- **{r['program']}**: {r['reason']}" for r in rows if r.get("reason")]
    if notes:
        lines += ["", "Why a judgement is not valid, or a program was not judged:", "", *notes]
    measured = [f"- **{r['program']}**: {note}" for r in judged for note in r.get("notes", [])]
    if measured:
        lines += ["", "What a judgement could not measure:", "", *measured]
    return "\n".join(lines) + "\n"


def write_tables(rows: list[dict[str, Any]], out: Path, header: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "zoo.json").write_text(json.dumps(rows, indent=2))
    (out / "zoo.md").write_text(markdown(rows, header))
    with (out / "zoo.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table_rows(rows))


def log_to_mlflow(rows: list[dict[str, Any]], out: Path, tracker: Any) -> str:
    """A parent run (the tables as artifacts) with one child run per program; returns the parent's id."""
    import torch

    parent = tracker.start_run("trace_zoo", {"benchmark": "trace_zoo", "workload": "generated",
                                            "torch_version": torch.__version__})
    for row in rows:
        child = tracker.start_run(row["program"], {"benchmark": "trace_zoo", "workload": "generated",
                                                   "source_workload": row["program"], "library": row["library"],
                                                   "zoo_status": row["status"]}, parent)
        if row["status"] == "judged":
            metrics = {"ops_per_step": row["ops_per_step"], "source_step_ms": row["step_ms"],
                       "op_coverage_pct": row["op_coverage_pct"], "capture_overhead_pct": row["capture_overhead_pct"],
                       "judgements_overlap": float(row["judgements_overlap"])}
            for j, (error, (low, high), valid, memory) in enumerate(zip(
                    row["time_error_signed_pct"], row["time_error_ci_pct"], row["fidelity_valid"],
                    row["memory_error_pct"], strict=True)):
                metrics.update({f"time_error_signed_pct_{j}": error, f"time_error_ci_low_pct_{j}": low,
                                f"time_error_ci_high_pct_{j}": high, f"fidelity_valid_{j}": float(valid),
                                f"memory_error_pct_{j}": memory})
                metrics.update({f"{part}_{j}": row.get(part, [])[j] for part in ERROR_PARTS
                                if j < len(row.get(part, []))})
            tracker.log_metrics(child, {k: v for k, v in metrics.items() if math.isfinite(v)})
        if row.get("reason"):
            tracker.set_tags(child, {"zoo_reason": row["reason"][:4000]})
        tracker.end_run(child, "FINISHED" if row["status"] == "judged" else "FAILED", row.get("reason") or None)
    for name in ("zoo.md", "zoo.csv", "zoo.json"):
        tracker.log_artifact(parent, out / name)
    tracker.end_run(parent, "FINISHED")
    return parent


def main(argv: list[str]) -> int:
    """Child process: ``python -m suite.zoo NAME OUT OPTIONS_JSON``, one judgement (rank 0 writes
    ``OUT/fidelity.json``)."""
    name, out, options = argv[0], Path(argv[1]), json.loads(argv[2])
    try:
        judge_one(name, out, **options)
    except Exception:  # noqa: BLE001 - any failure is the child's verdict: its traceback, exit 1
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a rank under torchrun: past the interpreter's teardown
        from harness.distributed import exit_rank

        exit_rank(code)
    sys.exit(code)
