"""The accelerator check's steps that run their body in a child process of this package
(``python -m suite.accelerator_check --step NAME``): the error-bounded codec's speed on the device and
the collectives on the device's backend."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from suite.accelerator_check.framework import FAIL, PASS, STEP_LIMITS, Check, Outcome

if TYPE_CHECKING:  # torch and the workloads are imported where a step runs
    import torch

    from workloads.dlrm.error_bounded.codec import ErrorBoundedCodec

CODEC_SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20]


def in_child(name: str, launcher: Callable[[Check], list[str]] | None = None) -> Callable[[Check], Outcome]:
    """A step whose body runs as ``python -m suite.accelerator_check --step NAME`` in a child process (under
    ``launcher``, e.g. torchrun); the child writes its :class:`Outcome` as JSON."""

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

    from harness.running.timing import StepTimer, step_stats
    from workloads.dlrm.error_bounded import fast_kernels
    from workloads.dlrm.error_bounded.codec import ErrorBoundedCodec
    from workloads.dlrm.error_bounded.config import ErrorBoundConfig

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
    figures = {"kernel": fast_kernels.kernel_name(device), "device": str(device), "table": rows_out}
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
