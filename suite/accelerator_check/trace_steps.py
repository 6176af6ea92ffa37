"""The accelerator check's trace steps: capture, generate and replay judged side by side on this device,
and a spec captured on another machine's CPU replayed here (the portability figure)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from suite.accelerator_check.framework import FAIL, PASS, SKIPPED, Check, Outcome


def fidelity_step(check: Check) -> Outcome:
    """``cobench trace fidelity workload=llama``: capture, generate and replay side by side with the source."""
    results = check.out / "runs" / "trace_fidelity"
    # the dry run checks the path (a shared CPU cannot judge fidelity); a device gets the judgement's own sizes
    sizes = (["--rounds", "2", "--round-steps", "3", "--warmup", "1", "--baseline-steps", "3", "--budget-s", "5"]
             if check.dry_run else ["--rounds", "5", "--round-steps", "20", "--warmup", "3", "--baseline-steps", "10",
                                    "--budget-s", "60"])
    argv = ["-m", "suite.cli", "trace", "fidelity", *sizes, "--steps", "2", "workload=llama", "workload.preset=tiny",
            *check.platform_overrides(), "tracking=off", "runner.progress=false", f"results_dir={results}"]
    code, tail = check.child("trace_fidelity", argv, 240.0)
    command = "python -m suite.cli " + " ".join(argv[2:])
    records = sorted(results.glob("runs/*/fidelity.json"))
    if code != 0 or not records:
        return Outcome("trace_fidelity", FAIL, f"exit {code}: {tail}", command=command)
    metrics = json.loads(records[-1].parent.joinpath("metrics.json").read_text())["metrics"]
    # the verdict, then where the difference lies (host time, time inside ops, each in % of a step) and the
    # figures that say how far to trust it (the source's own spread, this host's speed against the capture's)
    keys = ("time_error_signed_pct", "time_error_ci_low_pct", "time_error_ci_high_pct", "replay_step_ms",
            "source_step_ms", "op_coverage_pct", "memory_error_pct", "fidelity_valid", "host_error_pct",
            "op_error_pct", "source_round_cv_pct", "replay_host_speed_scale_p50")
    return Outcome("trace_fidelity", PASS, "", {k: metrics[k] for k in keys if k in metrics}, command=command)


PORTABLE_CAPTURE = ["--steps", "2", "--warmup", "3", "--baseline-steps", "20"]
DRY_CAPTURE = ["--steps", "1", "--warmup", "1", "--baseline-steps", "3"]
PORTABLE_PROGRAM = ["workload=llama", "workload.preset=tiny"]


def capture_portable(folder: Path, check: Check, sizes: list[str] = PORTABLE_CAPTURE) -> Path:
    """Capture Llama tiny on this machine's CPU and generate its spec: ``folder/spec.json``, the one file a
    replay elsewhere needs (the bundle's traces are removed: they do not travel)."""
    bundle = folder / "bundle"
    shutil.rmtree(folder, ignore_errors=True)
    code, tail = check.child("portable_capture", ["-m", "suite.cli", "trace", "capture", "--out", str(bundle),
                                                  *sizes, *PORTABLE_PROGRAM, "platform=cpu", "tracking=off",
                                                  "runner.progress=false", f"results_dir={folder / 'results'}"], 300)
    if code != 0:
        raise RuntimeError(f"capturing Llama tiny on the CPU failed (exit {code}): {tail}")
    spec = folder / "spec.json"
    code, tail = check.child("portable_generate", ["-m", "suite.cli", "trace", "generate", str(bundle), "--out",
                                                   str(spec)], 120)
    if code != 0:
        raise RuntimeError(f"generating the spec failed (exit {code}): {tail}")
    shutil.rmtree(bundle)
    shutil.rmtree(folder / "results", ignore_errors=True)
    return spec


def portability_step(check: Check) -> Outcome:
    """A spec generated from a bundle captured elsewhere (the CPU of the machine that carried it here) replayed
    on this device, judged against the same program captured on this device: the portability figure."""
    results = check.out / "runs" / "portability"
    base = [*PORTABLE_PROGRAM, "tracking=off", "runner.progress=false", f"results_dir={results}"]
    spec = check.portable_spec
    if spec is None:
        if not check.dry_run:
            return Outcome("portability", SKIPPED, "no spec captured elsewhere was carried (tools/wheelhouse.sh "
                           "writes one to .whl/cpu_bundle/spec.json); pass --portable-spec")
        try:  # the dry run captures its own: the same path, judged on one CPU
            spec = capture_portable(check.out / "portable_source", check, DRY_CAPTURE)
        except RuntimeError as err:
            return Outcome("portability", FAIL, str(err))
    reference = check.out / "portable_reference"
    code, tail = check.child("portability_reference", ["-m", "suite.cli", "trace", "capture", "--out", str(reference),
                                                       *(DRY_CAPTURE if check.dry_run else PORTABLE_CAPTURE), *base,
                                                       *check.platform_overrides()], 180.0)
    if code != 0:
        return Outcome("portability", FAIL, f"capturing the reference failed (exit {code}): {tail}")
    argv = ["-m", "suite.cli", "run", "workload=generated", f"workload.spec={spec}",
            f"workload.reference_bundle={reference}", "runner.warmup_steps=3",
            # the dry run leaves out the per-op timing and the crash probe (the trace tests cover both)
            *(["runner.steps=3", "workload.op_timing=false", "workload.probe=false"] if check.dry_run
              else ["runner.steps=20"]),
            *check.platform_overrides(), "tracking=off", "runner.progress=false", f"results_dir={results}"]
    code, tail = check.child("portability", argv, 180.0)
    command = "python -m suite.cli " + " ".join(argv[2:])
    records = sorted(results.glob("runs/*/fidelity.json"))
    if code != 0 or not records:
        return Outcome("portability", FAIL, f"exit {code}: {tail}", command=command)
    record = json.loads(records[-1].read_text())
    metrics = record["metrics"]
    figures = {"judgement": record["judgement"], "source_platform": record["source"]["platform"].get("device_name"),
               **{k: metrics[k] for k in ("time_error_signed_pct", "replay_step_ms", "reference_step_ms",
                                          "op_coverage_pct", "ops_failed", "memory_error_pct", "replay_peak_memory_mb",
                                          "source_peak_memory_mb") if k in metrics}}
    return Outcome("portability", PASS, "", figures, command=command)
