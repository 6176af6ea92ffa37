"""The accelerator check: one command that says, step by step, what cobench does on this machine's device.

    python3 tools/accelerator_check.py OUT [--platform auto|cpu] [--budget-s S] [--only A,B] [--portable-spec F]

``tools/accelerator_check.py`` first installs the carried wheels (``tools/wheelhouse.sh``) when the machine
lacks them, then runs :func:`main`. Every step runs in its own child process (a crash, a hang or a CUDA error
ends that step only) with a time limit, and ends PASS, FAIL or SKIPPED with its reason and its figures; the
whole check keeps within ``--budget-s`` (a step that no longer fits is SKIPPED, saying so). OUT receives
``check.json`` and ``check.md`` (the table), one log per step under ``logs/`` and the runs' folders under
``runs/``. Tracking is off (nothing needs a server or MLflow).

``--platform cpu`` is the dry run: the same steps at tiny sizes on the CPU, with the ones that need an
accelerator SKIPPED — the tests run it, so the check cannot rot between the machines it is meant for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from suite.accelerator_check.device_steps import CHILD_STEPS, in_child, torchrun
from suite.accelerator_check.framework import FAIL, PASS, ROOT, SKIPPED, Check, Outcome, Step, child_env
from suite.accelerator_check.report import header_facts, markdown
from suite.accelerator_check.run_steps import (
    BF16,
    DLRM,
    DRY_INFER,
    DRY_MEDIUM,
    DRY_MOE_MEDIUM,
    DRY_SHORT,
    INFER,
    MEDIUM_TRAIN,
    MOE_MEDIUM,
    MOE_TINY,
    SEQREC,
    TINY_TRAIN,
    cobench_run,
    doctor_step,
    recsys_missing,
    serving_verdict,
)
from suite.accelerator_check.trace_steps import capture_portable, fidelity_step, portability_step

DEFAULT_BUDGET_S = 540.0  # nine minutes: the check's promise is ten on one GPU, start-up included

# In order of what a first look at a device most needs, so a short budget drops the least; the compiled runs
# last, as they take the longest (a 1.5 B model's compilation alone is minutes).
STEPS: list[Step] = [
    Step("doctor", "the machine as cobench sees it", doctor_step, 15),
    Step("codec", "error-bounded codec encode+decode GB/s vs a bf16/fp16 cast", in_child("codec"), 40),
    Step("llama_tiny_bf16", "Llama tiny, bf16, eager", cobench_run("llama_tiny_bf16", [*TINY_TRAIN, *BF16], DRY_SHORT),
         25),
    Step("llama_medium_bf16", "Llama ~1.5 B shape (2 layers of 8B), bf16, eager",
         cobench_run("llama_medium_bf16", [*MEDIUM_TRAIN, *BF16], DRY_MEDIUM), 40),
    Step("moe_tiny", "Llama 4-style MoE tiny (grouped GEMM), bf16",
         cobench_run("moe_tiny", [*MOE_TINY, *BF16], DRY_SHORT), 30),
    Step("moe_medium", "Llama 4 Scout's MoE layer once (16 experts + shared), bf16",
         cobench_run("moe_medium", [*MOE_MEDIUM, *BF16], DRY_MOE_MEDIUM), 60),
    Step("infer_offline", "llama_infer under LoadGen, Offline",
         cobench_run("infer_offline", [*INFER, "workload.scenario=Offline"], DRY_INFER, serving_verdict), 30),
    Step("infer_server", "llama_infer under LoadGen, Server",
         cobench_run("infer_server", [*INFER, "workload.scenario=Server"], DRY_INFER, serving_verdict), 40),
    Step("collectives", "process group on the device's backend, collectives checked",
         in_child("collectives", launcher=torchrun), 20),
    Step("trace_fidelity", "trace capture/generate/replay side by side", fidelity_step, 60),
    Step("portability", "a spec captured elsewhere replayed here, judged against a capture here",
         portability_step, 60),
    Step("dlrm", "DLRM tiny (TorchRec, fbgemm-gpu)", cobench_run("dlrm", DLRM, DRY_SHORT), 40, skip_if=recsys_missing),
    Step("seqrec", "seqrec tiny (TorchRec, fbgemm-gpu)", cobench_run("seqrec", SEQREC, DRY_SHORT), 40,
         skip_if=recsys_missing),
    Step("llama_tiny_compile", "Llama tiny, bf16, torch.compile",
         cobench_run("llama_tiny_compile", [*TINY_TRAIN, *BF16, "workload.compile=true"], DRY_SHORT), 60,
         accelerator_only=True),
    Step("llama_medium_compile", "Llama ~1.5 B shape, bf16, torch.compile",
         cobench_run("llama_medium_compile", [*MEDIUM_TRAIN, *BF16, "workload.compile=true"], DRY_MEDIUM), 120,
         accelerator_only=True),
]


def run_check(out: Path, dry_run: bool, budget_s: float, only: list[str] | None = None,
              portable_spec: Path | None = None) -> list[Outcome]:
    """Run the steps (``only`` those named) within ``budget_s``; writes OUT/check.json and OUT/check.md after
    every step, so a check stopped midway still leaves what it found."""
    unknown = sorted(set(only or []) - {s.name for s in STEPS})
    if unknown:
        raise ValueError(f"unknown step(s) {', '.join(unknown)}; the steps: {', '.join(s.name for s in STEPS)}")
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, dry_run, time.monotonic() + budget_s, portable_spec, child_env())
    header = header_facts(dry_run)
    outcomes: list[Outcome] = []
    for step in STEPS:
        if only and step.name not in only:
            continue
        started = time.monotonic()
        if dry_run and step.accelerator_only:
            outcome = Outcome(step.name, SKIPPED, "dry run: needs an accelerator (on the CPU it is exercised by "
                                                  "the tests at tiny size)")
        elif step.skip_if and (why := step.skip_if(check)):
            outcome = Outcome(step.name, SKIPPED, why)
        elif check.left_s < step.needs_s:
            outcome = Outcome(step.name, SKIPPED, f"time budget: {check.left_s:.0f} s left, the step takes "
                                                  f"about {step.needs_s:.0f} s (raise --budget-s or use --only)")
        else:
            print(f"[{time.strftime('%H:%M:%S')}] {step.name}: {step.what} ...", flush=True)
            try:
                outcome = step.run(check)
            except Exception as err:  # noqa: BLE001 - one step's failure is its verdict; the others still run
                outcome = Outcome(step.name, FAIL, f"{type(err).__name__}: {err}")
        outcome.seconds = time.monotonic() - started
        outcomes.append(outcome)
        first = outcome.reason.splitlines()[0] if outcome.reason else ""
        print(f"    {outcome.status} in {outcome.seconds:.0f} s {first}", flush=True)
        (out / "check.json").write_text(json.dumps({**header, "steps": [asdict(o) for o in outcomes]}, indent=1))
        (out / "check.md").write_text(markdown(outcomes, header))
    return outcomes


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tools/accelerator_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, nargs="?", help="folder for check.json, check.md, logs/ and runs/")
    parser.add_argument("--platform", choices=("auto", "cpu"), default="auto",
                        help="auto: the accelerator (refused where there is none); cpu: the dry run")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds the whole check may take (default {DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--only", help="comma-separated steps to run (default: all)")
    parser.add_argument("--portable-spec", type=Path, help="a spec captured on another platform "
                        "(default .whl/cpu_bundle/spec.json where it exists)")
    parser.add_argument("--capture-portable", type=Path, metavar="DIR",
                        help="only capture Llama tiny on this CPU into DIR/spec.json, for --portable-spec elsewhere")
    parser.add_argument("--step", help=argparse.SUPPRESS)  # a child process: run one step, write --result
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.step:  # a child: one step, its outcome as JSON
        outcome = CHILD_STEPS[args.step](args.platform, args.platform == "cpu")
        if args.result and int(os.environ.get("RANK", "0")) == 0:
            args.result.write_text(json.dumps(asdict(outcome)))
        return 0
    if args.capture_portable:
        folder = args.capture_portable.resolve()
        try:
            spec = capture_portable(folder, Check(folder, True, time.monotonic() + 600, None, child_env()))
        except RuntimeError as err:
            print(f"accelerator check: {err}", file=sys.stderr)
            return 1
        print(f"{spec} ({spec.stat().st_size >> 10} KiB)")
        return 0
    if args.out is None:
        _parser().error("the output folder is required")
    import torch

    if args.platform == "auto" and torch.accelerator.current_accelerator(check_available=True) is None:
        print("accelerator check: no accelerator here (torch.accelerator finds none); the dry run on the CPU is "
              "--platform cpu", file=sys.stderr)
        return 2
    spec = args.portable_spec or (ROOT / ".whl" / "cpu_bundle" / "spec.json")
    spec = spec if spec.is_file() else None
    if args.portable_spec and spec is None:
        print(f"accelerator check: --portable-spec {args.portable_spec}: no such file", file=sys.stderr)
        return 2
    only = [s for s in args.only.split(",") if s] if args.only else None
    try:
        outcomes = run_check(args.out, args.platform == "cpu", args.budget_s, only, spec)
    except ValueError as err:
        print(f"accelerator check: {err}", file=sys.stderr)
        return 2
    print((args.out / "check.md").read_text())
    counts = {s: sum(o.status == s for o in outcomes) for s in (PASS, FAIL, SKIPPED)}
    print(f"accelerator check: {counts[PASS]} PASS, {counts[FAIL]} FAIL, {counts[SKIPPED]} SKIPPED; "
          f"{args.out / 'check.md'}")
    return 1 if any(o.status == FAIL for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
