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
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and the workloads are imported where a step runs
    import torch

    from workloads.dlrm.compression import ErrorBoundedCodec

ROOT = Path(__file__).resolve().parents[1]
PASS, FAIL, SKIPPED = "PASS", "FAIL", "SKIPPED"
DEFAULT_BUDGET_S = 540.0  # nine minutes: the check's promise is ten on one GPU, start-up included
CODEC_SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20]


@dataclass
class Outcome:
    """One step's verdict: PASS, FAIL or SKIPPED, why, and what it measured."""

    step: str
    status: str
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    command: str = ""


@dataclass
class Check:
    """What every step needs: where to write, which platform, how much time is left."""

    out: Path
    dry_run: bool
    deadline: float
    portable_spec: Path | None
    env: dict[str, str]
    device_type: str = "cpu"

    @property
    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def platform_overrides(self) -> list[str]:
        return ["platform=cpu"] if self.dry_run else []

    def child(self, step: str, argv: list[str], limit_s: float) -> tuple[int | None, str]:
        """Run ``python argv`` from the checkout, its output in ``logs/<step>.log``; (exit code or None on
        time-out, the log's last lines)."""
        log = self.out / "logs" / f"{step}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        timeout = max(1.0, min(limit_s, self.left_s))
        with log.open("w") as sink:
            try:
                proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=self.env, stdout=sink,
                                      stderr=subprocess.STDOUT, timeout=timeout, check=False)
                code: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                code = None
        tail = log.read_text(errors="replace").strip().splitlines()[-12:]
        return code, "\n".join(tail)


@dataclass
class Step:
    """A named step: what it needs (about how long it takes, whether only an accelerator runs it)."""

    name: str
    what: str
    run: Callable[[Check], Outcome]
    needs_s: float  # about how long it takes on a device; a step that does not fit the time left is skipped
    accelerator_only: bool = False
    skip_if: Callable[[Check], str | None] | None = None  # why it cannot run here, or None


# ---- steps that are cobench runs -----------------------------------------------------------------------------

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
STEP_LIMITS = {"llama_medium_compile": 300.0, "moe_medium": 200.0, "llama_tiny_compile": 240.0}


# ---- steps in a child process of this module -----------------------------------------------------------------


def in_child(name: str, launcher: Callable[[Check], list[str]] | None = None) -> Callable[[Check], Outcome]:
    """A step whose body is :func:`child_main` ``--step NAME`` in a child process (under ``launcher``, e.g.
    torchrun); the child writes its :class:`Outcome` as JSON."""

    def step(check: Check) -> Outcome:
        result = check.out / "logs" / f"{name}.json"
        result.unlink(missing_ok=True)
        argv = [*(launcher(check) if launcher else []), "-m", "suite.accelerator_check", "--step", name,
                "--result", str(result), "--platform", "cpu" if check.dry_run else "auto"]
        code, tail = check.child(name, argv, STEP_LIMITS.get(name, 240.0))
        command = "python " + " ".join(argv)
        if code is None:
            return Outcome(name, FAIL, f"timed out\n{tail}", command=command)
        if not result.is_file():
            return Outcome(name, FAIL, f"exit {code} before a result:\n{tail}", command=command)
        outcome = Outcome(**json.loads(result.read_text()))
        outcome.command = command
        return outcome

    return step


def _device(platform: str) -> torch.device:
    import torch

    from harness.platform import resolve_device

    device = resolve_device("cpu" if platform == "cpu" else "auto")
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index or 0)
    return device


def codec_step(platform: str, dry_run: bool) -> Outcome:
    """The error-bounded all-to-all codec on the device: encode + decode GB/s (float32 bytes in, as DLRM's
    pooled embeddings: rows of 128 drawn N(0, 0.1)) from 64 KiB to 64 MiB beside a plain bf16 and fp16 cast
    round trip on the same device, the compression ratio and the bound violations (must be 0)."""
    import torch

    from harness.timing import StepTimer, step_stats
    from workloads.dlrm import eb_kernels
    from workloads.dlrm.compression import ErrorBoundConfig, ErrorBoundedCodec

    device = _device(platform)
    sizes = CODEC_SIZES[:1] if dry_run else CODEC_SIZES
    rows_out, violations = [], 0
    for size in sizes:
        x = (torch.randn(size // 4 // 128, 128, generator=torch.Generator().manual_seed(0)) * 0.1).to(device)
        rounds = 3 if dry_run else (30 if size <= 1 << 20 else 10)
        for name in ("eb-rel-1e-2", "eb-rel-1e-3", "cast-bf16", "cast-fp16"):
            if name.startswith("eb"):  # as DLRM runs it: rel bound 1e-2 (7-bit codes) or 1e-3 (10-bit)
                codec = ErrorBoundedCodec(ErrorBoundConfig(eb=1e-2 if name.endswith("2") else 1e-3,
                                                           measure_error=False))

                def round_trip(codec: ErrorBoundedCodec = codec, x: torch.Tensor = x) -> torch.Tensor:
                    ctx = codec.create_context()
                    message = codec.encode(x, ctx)
                    codec.decode(message, ctx)
                    return message
            else:
                dtype = torch.bfloat16 if name == "cast-bf16" else torch.float16

                def round_trip(dtype: torch.dtype = dtype, x: torch.Tensor = x) -> torch.Tensor:
                    message = x.to(dtype)
                    message.to(torch.float32)
                    return message
            for _ in range(2):
                message = round_trip()  # warm-up: compilation, kernel selection
            timer = StepTimer(device)
            for _ in range(rounds):
                timer.start()
                message = round_trip()
                timer.stop()
            stats = step_stats(timer.durations_s())
            nbytes = 4 * x.numel()
            row = {"bytes": nbytes, "codec": name, "gb_per_s": nbytes / (stats.p50_ms / 1e3) / 1e9,
                   "ratio": nbytes / (message.numel() * message.element_size()), "p50_ms": stats.p50_ms,
                   "cv": stats.cv}
            if name.startswith("eb"):
                row["bound_violations"] = codec.stats.bound_violations
                violations += codec.stats.bound_violations
            rows_out.append(row)
    base = {(r["bytes"]): r["gb_per_s"] for r in rows_out if r["codec"] == "cast-bf16"}
    for row in rows_out:
        row["vs_bf16_cast"] = row["gb_per_s"] / base[row["bytes"]]
    figures = {"kernel": eb_kernels.kernel_name(device), "device": str(device), "table": rows_out}
    largest = max(sizes)
    for row in rows_out:
        if row["bytes"] == largest:
            figures[f"{row['codec']}_gb_per_s_{largest >> 10}KiB"] = round(row["gb_per_s"], 2)
    if violations:
        return Outcome("codec", FAIL, f"{violations} bound violations", figures)
    return Outcome("codec", PASS, "", figures)


def collectives_step(platform: str, dry_run: bool) -> Outcome:
    """A process group on the backend cobench picks for the device (NCCL on CUDA; gloo on the CPU), started
    as runs start it, and every collective the workloads use checked for the right answer."""
    import torch
    import torch.distributed as dist

    from harness.distributed import default_backend, env_dist_info, init_distributed, shutdown_distributed

    device = _device(platform)
    if device.type != "cpu":
        device = torch.device(device.type, env_dist_info().local_rank % torch.accelerator.device_count())
        torch.accelerator.set_device_index(device.index)
    started = time.perf_counter()
    info = init_distributed(device, timeout_s=60.0)  # as runs join torchrun's group (none for one process)
    backend = info.backend or default_backend(device)
    if not dist.is_initialized():  # one process: a group of one all the same, on the same backend
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=60),
                                **({"device_id": device} if device.type != "cpu" else {}))
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(x)
    wrong = []
    if not torch.all(x == world * (world + 1) / 2):
        wrong.append("all_reduce")
    init_s = time.perf_counter() - started
    gathered = torch.empty(world * 4, device=device)
    dist.all_gather_into_tensor(gathered, torch.full((4,), float(rank), device=device))
    if not torch.equal(gathered.cpu(), torch.arange(world).repeat_interleave(4).float()):
        wrong.append("all_gather")
    sent = torch.arange(world * 2, dtype=torch.float32, device=device) + 100 * rank
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent)
    expect = torch.tensor([100 * src + 2 * rank + i for src in range(world) for i in range(2)], dtype=torch.float32)
    if not torch.equal(received.cpu(), expect):
        wrong.append("all_to_all")
    reduced = torch.empty(2, device=device)
    dist.reduce_scatter_tensor(reduced, torch.ones(world * 2, device=device))
    if not torch.all(reduced == world):
        wrong.append("reduce_scatter")
    root = torch.full((8,), float(rank), device=device)
    dist.broadcast(root, 0)
    if not torch.all(root == 0):
        wrong.append("broadcast")
    shutdown_distributed()
    figures = {"backend": backend, "world_size": world, "init_and_first_all_reduce_s": round(init_s, 3)}
    if wrong:
        return Outcome("collectives", FAIL, f"wrong results: {', '.join(wrong)}", figures)
    return Outcome("collectives", PASS, "", figures)


def torchrun(check: Check) -> list[str]:
    """One process per device (NCCL refuses two ranks on one GPU); two on the CPU, so gloo moves real data."""
    import torch

    ranks = 2 if check.dry_run else torch.accelerator.device_count()
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]


CHILD_STEPS: dict[str, Callable[[str, bool], Outcome]] = {
    "codec": codec_step, "collectives": collectives_step,
}


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


# ---- trace steps ---------------------------------------------------------------------------------------------


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
    keys = ("time_error_signed_pct", "time_error_ci_low_pct", "time_error_ci_high_pct", "replay_step_ms",
            "source_step_ms", "op_coverage_pct", "memory_error_pct", "fidelity_valid")
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
                                          "op_coverage_pct", "ops_failed", "memory_error_pct") if k in metrics}}
    return Outcome("portability", PASS, "", figures, command=command)


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


STEPS: list[Step] = [  # in order of what a first look at a device most needs, so a short budget drops the least
    Step("doctor", "the machine as cobench sees it", doctor_step, 15),
    Step("codec", "error-bounded codec encode+decode GB/s vs a bf16/fp16 cast", in_child("codec"), 40),
    Step("llama_tiny_bf16", "Llama tiny, bf16, eager", cobench_run("llama_tiny_bf16", [*TINY_TRAIN, *BF16], DRY_SHORT),
         25),
    Step("llama_medium_bf16", "Llama ~1.5 B shape (2 layers of 8B), bf16, eager",
         cobench_run("llama_medium_bf16", [*MEDIUM_TRAIN, *BF16], DRY_MEDIUM), 40),
    Step("llama_medium_compile", "the same, torch.compile",
         cobench_run("llama_medium_compile", [*MEDIUM_TRAIN, *BF16, "workload.compile=true"], DRY_MEDIUM), 120,
         accelerator_only=True),
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
]


# ---- the report ----------------------------------------------------------------------------------------------


def _figure(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def markdown(outcomes: list[Outcome], header: dict[str, Any]) -> str:
    lines = ["# cobench accelerator check", "",
             *[f"- {key}: {value}" for key, value in header.items()], "",
             "| step | status | seconds | figures | reason |", "| --- | --- | ---: | --- | --- |"]
    for o in outcomes:
        figures = ", ".join(f"{k} {_figure(v)}" for k, v in o.figures.items() if k != "table")
        reason = o.reason.splitlines()[0][:200] if o.reason else ""
        lines.append(f"| {o.step} | {o.status} | {o.seconds:.0f} | {figures} | {reason} |")
    for o in outcomes:
        if "table" in o.figures:
            lines += ["", f"## {o.step}: encode + decode, {o.figures.get('device')} ({o.figures.get('kernel')})", "",
                      "| message | codec | GB/s | vs bf16 cast | ratio | violations |",
                      "| ---: | --- | ---: | ---: | ---: | ---: |"]
            lines += [f"| {r['bytes'] >> 10} KiB | {r['codec']} | {r['gb_per_s']:.2f} | {r['vs_bf16_cast']:.2f} | "
                      f"{r['ratio']:.2f} | {r.get('bound_violations', '')} |" for r in o.figures["table"]]
    failed = [o for o in outcomes if o.status == FAIL]
    for o in failed:
        lines += ["", f"## {o.step}: FAIL", "", f"`{o.command}`" if o.command else "", "", "```", o.reason, "```"]
    return "\n".join(lines) + "\n"


def header_facts(dry_run: bool) -> dict[str, Any]:
    import platform

    import torch

    facts: dict[str, Any] = {"mode": "dry run on the CPU" if dry_run else "device", "torch": torch.__version__,
                             "python": platform.python_version(), "host": platform.node()}
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is not None and not dry_run:
        from harness.platform import device_name

        facts["device"] = device_name(torch.device(accelerator.type, 0))
        facts["devices"] = torch.accelerator.device_count()
        if torch.version.cuda:
            facts["cuda"] = torch.version.cuda
    return facts


def child_env() -> dict[str, str]:
    """The steps' environment: this checkout importable (it need not be installed), output unbuffered."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


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
