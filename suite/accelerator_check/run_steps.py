"""The accelerator check's steps that are ``cobench`` commands in a child process: training and serving
runs at the sizes a device needs (tiny ones in the dry run), ``cobench doctor``, and whether TorchRec loads."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from suite.accelerator_check.framework import FAIL, PASS, ROOT, STEP_LIMITS, Check, Outcome

RUN_FIGURES = {  # metrics.json key → figure name, for the training and serving runs
    "throughput": "throughput", "mfu": "mfu", "peak_memory_mb": "peak_memory_mb",
    "step_time_ms_p50": "step_ms_p50", "step_time_cv": "step_cv", "mfu_suspect": "mfu_suspect",
    "expert_load_max_over_mean": "expert_load_max_over_mean", "model_params": "params",
    "tokens_per_s": "tokens_per_s", "ttft_ms_p99": "ttft_ms_p99", "tpot_ms_p99": "tpot_ms_p99",
    "ttft_limit_ms": "ttft_limit_ms", "tpot_limit_ms": "tpot_limit_ms", "result_valid": "valid",
    "loss": "loss",
}


def _run_record(runs: Path) -> tuple[dict[str, Any], Path] | None:
    records = sorted(runs.glob("runs/*/metrics.json"), key=lambda p: p.stat().st_mtime)
    return (json.loads(records[-1].read_text()), records[-1].parent) if records else None


def cobench_run(name: str, overrides: list[str], dry_overrides: list[str], judge: Callable | None = None
                ) -> Callable[[Check], Outcome]:
    """A step that is ``cobench run OVERRIDES`` (``dry_overrides`` replace the sizes in the dry run)."""

    def step(check: Check) -> Outcome:
        results = check.out / "runs" / name
        argv = ["-m", "suite.cli", "run", *overrides, *(dry_overrides if check.dry_run else []),
                *check.platform_overrides(), "tracking=off", "runner.progress=false", f"results_dir={results}"]
        code, tail = check.child(name, argv, STEP_LIMITS.get(name, 240.0))
        command = "python -m suite.cli " + " ".join(argv[2:])
        found = _run_record(results)
        if code is None:
            return Outcome(name, FAIL, f"timed out; log: logs/{name}.log\n{tail}", command=command)
        if found is None or found[0].get("status") != "FINISHED":
            error = found[0].get("error") if found else None
            return Outcome(name, FAIL, f"exit {code}: {error or tail}", command=command)
        metrics = found[0]["metrics"]
        figures = {label: metrics[key] for key, label in RUN_FIGURES.items() if key in metrics}
        figures["run_folder"] = str(found[1].relative_to(check.out))
        verdict = judge(check, metrics) if judge else None
        return Outcome(name, FAIL if verdict else PASS, verdict or "", figures, command=command)

    return step


def serving_verdict(check: Check, metrics: dict[str, float]) -> str | None:
    """On a device a serving run passes only VALID (TTFT/TPOT p99 within their limits); the dry run on a shared
    CPU checks the path only."""
    if check.dry_run or metrics.get("result_valid") == 1.0:
        return None
    figure = {key: metrics.get(key, float("nan")) for key in ("ttft_ms_p99", "ttft_limit_ms", "tpot_ms_p99",
                                                                "tpot_limit_ms")}
    return (f"LoadGen result INVALID: TTFT p99 {figure['ttft_ms_p99']:.1f} ms (limit {figure['ttft_limit_ms']:.0f}), "
            f"TPOT p99 {figure['tpot_ms_p99']:.1f} ms (limit {figure['tpot_limit_ms']:.0f})")


TINY_TRAIN = ["workload=llama", "workload.preset=tiny", "runner.warmup_steps=5", "runner.steps=30"]
# ~1.5 B parameters: Llama 3 8B's layer and vocabulary, two layers
MEDIUM_TRAIN = ["workload=llama", "workload.preset=llama3_8b", "workload.n_layers=2", "workload.batch_size=4",
                "workload.seq_len=2048", "workload.train_batches=8", "workload.eval_batches=1",
                "runner.warmup_steps=3", "runner.steps=15"]
# the dry run's stand-in for a size only an accelerator trains in a moment
DRY_MEDIUM = ["workload.preset=tiny", "workload.n_layers=null", "workload.batch_size=4", "workload.seq_len=64",
              "workload.train_batches=8", "runner.warmup_steps=1", "runner.steps=3"]
DRY_SHORT = ["runner.warmup_steps=1", "runner.steps=3"]
MOE_TINY = ["workload=llama", "workload.preset=tiny_moe", "runner.warmup_steps=5", "runner.steps=30"]
# Llama 4 Scout's MoE layer (16 routed experts + a shared one, grouped GEMM) once, at a smaller vocabulary
MOE_MEDIUM = ["workload=llama", "workload.preset=llama4_scout", "workload.n_layers=1", "workload.vocab_size=32000",
              "workload.batch_size=4", "workload.seq_len=2048", "workload.train_batches=8",
              "workload.eval_batches=1", "runner.warmup_steps=3", "runner.steps=15"]
DRY_MOE_MEDIUM = ["workload.preset=tiny_moe", "workload.n_layers=null", "workload.vocab_size=null",
                  "workload.seq_len=64", "runner.warmup_steps=1", "runner.steps=3"]
INFER = ["workload=llama_infer", "workload.preset=tiny"]
DRY_INFER = ["workload.samples=64", "workload.min_queries=64", "workload.warmup_requests=8"]
BF16 = ["workload.dtype=bfloat16"]
DLRM = ["workload=dlrm", "workload.preset=tiny", "runner.warmup_steps=5", "runner.steps=30"]
SEQREC = ["workload=seqrec", "workload.preset=tiny", "runner.warmup_steps=5", "runner.steps=30"]


def recsys_missing(check: Check) -> str | None:
    """Why DLRM and seqrec cannot run here, or None: they need TorchRec and FBGEMM's operators for the device
    (on a GPU, the CUDA build of fbgemm-gpu). Probed in a child: a CUDA build on CPU-only torch fails to load."""
    probe = ("import torch, fbgemm_gpu, torchrec\n"
             "from harness.platform import resolve_device\n"
             f"d = resolve_device({'cpu' if check.dry_run else 'auto'!r})\n"
             "assert d.type == 'cpu' or hasattr(torch.ops.fbgemm, 'asynchronous_complete_cumsum'), "
             "'fbgemm-gpu loaded without operators for ' + d.type\n")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=check.env, capture_output=True, text=True,
                          timeout=120, check=False)
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return f"TorchRec + fbgemm-gpu{' (its CUDA build)' if not check.dry_run else ''} do not load here: {last}"


def doctor_step(check: Check) -> Outcome:
    """``cobench doctor --json``: the machine as cobench sees it (device, versions, peaks, what is supported)."""
    code, tail = check.child("doctor", ["-m", "suite.cli", "doctor", "--json"], 120.0)
    log = check.out / "logs" / "doctor.log"
    if code != 0:
        return Outcome("doctor", FAIL, f"exit {code}: {tail}")
    text = log.read_text()
    try:
        report = json.loads(text[text.index("{"):])
    except ValueError as err:
        return Outcome("doctor", FAIL, f"not JSON: {err}")
    (check.out / "doctor.json").write_text(json.dumps(report, indent=1))
    return Outcome("doctor", PASS, "", {"report": "doctor.json"})
