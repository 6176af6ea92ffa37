"""What DDP's gradient synchronisation adds to a step, timed at this process group's world size.

A single-rank capture cannot show what ``DistributedDataParallel`` does at W ranks: its reducer's autograd
hooks copy every gradient into a bucket, a bucket is all-reduced as soon as its gradients are ready (the
first, 1 MiB, while backward still runs; later ones, 25 MiB, as they fill; the last after backward), and the
step waits for the slowest rank's buckets and for the collective's threads to wake after a compute phase.
Measured on this host, that is far more than the collective alone (Llama tiny at 2 ranks: 3.0 ms a step,
where its 657 KB all-reduced back to back take 0.4 ms).

So it is measured on the target, as a component benchmark: a *skeleton* of one rank's predicted step —
the workload's gradients (shapes, dtypes, in the order backward makes them), each made after the compute
the prediction puts before it (busy matrix products, calibrated in this process to the predicted
milliseconds, so that they slow down as the real compute does when the collective competes for the
cores), the compute before the first gradient and after the last — run with the real DDP (the workload's
own wrapper settings) and without it, interleaved, on every rank at once. The synchronisation's cost is
what DDP adds to the step *as the job sees it* — at each pass the slowest rank's time, as the harness reports a
real run's step (:mod:`harness.running.metrics`) — over a rank's own step without DDP: the median over passes of the
slowest rank with DDP minus the ranks' mean median without. (A rank late in one pass makes the other wait; each
rank's own median hides that: Llama tiny's skeleton 0.2 … 0.9 ms a step here, a real 2-rank run 0.2 … 1.8 ms.)
The skeleton's spec comes from :mod:`harness.whatif.dataparallel` (:func:`~harness.whatif.dataparallel.sync_spec`);
this module only runs it:

    torchrun --nproc-per-node 2 -m harness.whatif.sync_probe PREDICTION.json --out FILE [--passes 100 --warmup 10]

times the skeleton a prediction at 2 ranks wrote (``cobench trace predict ... --json PREDICTION.json``, or its
``sync_spec`` alone); rank 0 writes the timing (JSON), what ``cobench trace predict --gradient-sync`` takes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from harness.cli import EXIT_BAD_INPUT, EXIT_OK
from harness.config import compose_config, to_run_config
from harness.distributed import env_dist_info, exit_rank, gather_to_all, shutdown_distributed
from harness.files import write_atomic
from harness.running.runner import join_process_group
from harness.running.timing import StepTimer
from harness.whatif.cache import read_json_file

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
WORK_DIM = 64  # the busy work's matrix size: ~10-20 µs a product on a CPU thread, fine enough for short gaps
BLOCK = 10  # passes of one variant in a row before the other's (interleaved: both see the host's same minutes)
PASSES = 100  # timed passes a launch, of each variant (with and without DDP)
WARMUP = 10  # untimed passes of each variant first


@dataclass
class SyncTiming:
    """One launch's timing of the skeleton with and without DDP (per rank: medians over its passes)."""

    world_size: int
    threads_per_rank: int
    gradients: int
    gradient_bytes: int
    spec_step_ms: float  # the step the skeleton stands for (the prediction's, one rank)
    passes: int  # of each variant
    plain_ms_p50: list[float]  # per rank: the skeleton without DDP (should be near spec_step_ms)
    ddp_ms_p50: list[float]  # per rank: with DDP
    job_ddp_ms_p50: float  # with DDP, the step as the job sees it: the median over passes of the slowest rank's
    sync_ms: float  # what DDP adds to the job's step: job_ddp_ms_p50 − the ranks' mean plain median
    rank_sync_ms: float  # what DDP adds to a rank's own median: the ranks' mean of (DDP − plain) medians
    ddp_settings: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class _Work(torch.autograd.Function):
    """Identity forward; in backward, a stretch of the step (compute between two gradients)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stretch: list[int | None], mat: torch.Tensor) -> torch.Tensor:
        ctx.stretch, ctx.mat = stretch, mat
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        _run(ctx.mat, ctx.stretch)
        return grad, None, None


def _busy(mat: torch.Tensor, iters: int) -> None:
    for _ in range(iters):
        mat.mm(mat)


def _run(mat: torch.Tensor, stretch: list[int | None]) -> None:
    """A stretch of the step: busy products (an int: how many), and the step's other collectives (None: a
    small all-reduce, which keeps the ranks in step there as the real one does)."""
    import torch.distributed as dist

    for piece in stretch:
        if piece is None:
            dist.all_reduce(torch.zeros(1, device=mat.device))
        else:
            _busy(mat, piece)


def _stretches(rate: float, ready: list[float], step_ms: float, collectives: list[float]) -> list[list[int | None]]:
    """The step cut at the gradients' ready times into stretches (before the first, between two, after the
    last), each its busy products at ``rate`` a millisecond, with the collectives that fall in it."""
    bounds = [0.0, *ready, step_ms]
    stretches = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        inside = sorted(t for t in collectives if lo <= t < hi or (hi == step_ms and t == hi))
        cuts = [lo, *inside, hi]
        stretch: list[int | None] = []
        for k, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
            if k:
                stretch.append(None)
            stretch.append(round(rate * (b - a)))
        stretches.append(stretch)
    return stretches


class _Skeleton(nn.Module):
    """Parameters of the gradients' shapes, registered in the reverse of backward's order (as a model's
    forward order is); backward makes gradient ``i`` after its stretch of the step."""

    def __init__(self, gradients: list[tuple[list[int], str]], stretches: list[list[int | None]],
                 mat: torch.Tensor, device: torch.device):
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.zeros(shape, dtype=DTYPES[dtype], device=device))
                                       for shape, dtype in reversed(gradients))
        self.stretches, self.mat = stretches, mat  # stretches[i]: what runs before gradient i (i >= 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # built first-registered first, so that backward meets the last-registered (first made) gradient
        # first: h = Work_i(h + Σ p_i); backward runs Work_i, then hands p_i its gradient, then Work_{i+1} ...
        count = len(self.params)
        h = x
        for k, p in enumerate(self.params):
            h = h + p.sum().to(h.dtype)
            h = _Work.apply(h, self.stretches[count - 1 - k] if k < count - 1 else [], self.mat)
        return h


def _rate_per_ms(mat: torch.Tensor, timer_device: torch.device) -> float:
    """Busy products per millisecond on this rank now (median of a few timings)."""
    rates = []
    for _ in range(5):
        timer = StepTimer(timer_device)
        timer.start()
        _busy(mat, 200)
        timer.stop()
        rates.append(200 / (1e3 * timer.durations_s()[0]))
    return statistics.median(rates)


def time_gradient_sync(spec: dict[str, Any], device: torch.device, passes: int, warmup: int) -> SyncTiming:
    """Run ``spec``'s skeleton with and without DDP in this process group (every rank calls this and gets
    the result). ``spec``: ``gradients`` ([shape, dtype] in backward's order), ``ready_ms`` (when each is
    made, from the step's start), ``step_ms``, ``threads_per_rank``, ``ddp`` (the wrapper's settings),
    ``collectives_ms`` (where the step's other collectives keep the ranks in step: a sharded stage's)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if passes < 3 or warmup < 0:
        raise ValueError(f"the skeleton needs at least 3 timed passes and warmup >= 0 (got {passes}, {warmup})")
    gradients = [(list(shape), str(dtype)) for shape, dtype in spec["gradients"]]
    ready, step_ms = [float(t) for t in spec["ready_ms"]], float(spec["step_ms"])
    if not gradients or len(ready) != len(gradients) or any(b < a for a, b in zip(ready, ready[1:], strict=False)) \
            or ready[-1] > step_ms + 1e-6:
        raise ValueError("a sync spec needs gradients with non-decreasing ready times within the step")
    unknown = sorted({d for _, d in gradients} - set(DTYPES))
    if unknown:
        raise ValueError(f"a sync spec's gradient dtypes {unknown} are not among {sorted(DTYPES)}")
    threads = int(spec.get("threads_per_rank") or torch.get_num_threads())
    torch.set_num_threads(threads)
    mat = torch.randn(WORK_DIM, WORK_DIM, device=device)
    _rate_per_ms(mat, device)  # warm the product up
    rate = statistics.median(gather_to_all(_rate_per_ms(mat, device)))  # the ranks share cores: one rate for all
    collectives = [float(t) for t in spec.get("collectives_ms") or []]
    stretches = _stretches(rate, ready, step_ms, collectives)
    before, after = stretches[0], stretches[-1]
    settings = {"static_graph": bool(spec["ddp"].get("static_graph", False)),
                "gradient_as_bucket_view": bool(spec["ddp"].get("gradient_as_bucket_view", False)),
                "bucket_cap_mb": float(spec["ddp"].get("bucket_cap_mb", 25))}
    plain = _Skeleton(gradients, stretches[:-1], mat, device)
    wrapped = DistributedDataParallel(_Skeleton(gradients, stretches[:-1], mat, device),
                                      device_ids=None if device.type == "cpu" else [device], **settings)
    x = torch.zeros((), device=device)

    def one(model: nn.Module) -> None:
        _run(mat, before)  # forward, and backward up to the first gradient
        model(x).backward()
        _run(mat, after)  # the rest of backward, the optimizer, the host's work

    timers = {"plain": StepTimer(device), "ddp": StepTimer(device)}
    models = {"plain": plain, "ddp": wrapped}
    for name in models:
        for _ in range(warmup):
            one(models[name])
    dist.barrier()
    for block in range(2 * -(-passes // BLOCK)):
        name = ("plain", "ddp")[block % 2]
        for _ in range(min(BLOCK, passes - (block // 2) * BLOCK)):
            timers[name].start()
            one(models[name])
            timers[name].stop()
    every = gather_to_all({name: [1e3 * s for s in t.durations_s()] for name, t in timers.items()})
    plain_p50 = [statistics.median(r["plain"]) for r in every]
    ddp_p50 = [statistics.median(r["ddp"]) for r in every]
    # DDP keeps the ranks in step, so pass k is the same step on every rank; the harness reports a real run's
    # step as the slowest rank's at each step (harness.running.metrics), and so does this: a rank that is late in one
    # pass makes the other wait, which each rank's own median does not show
    job_ddp = statistics.median(max(times) for times in zip(*(r["ddp"] for r in every), strict=True))
    nbytes = sum(torch.Size(shape).numel() * DTYPES[dtype].itemsize for shape, dtype in gradients)
    return SyncTiming(len(every), threads, len(gradients), nbytes, step_ms, passes, plain_p50, ddp_p50, job_ddp,
                      job_ddp - statistics.fmean(plain_p50),
                      statistics.fmean(d - p for d, p in zip(ddp_p50, plain_p50, strict=True)), settings)


def pooled(timings: list[dict[str, Any]]) -> dict[str, Any]:
    """Launches of the same skeleton as one: the sync cost their median (a launch's placement of ranks on
    a shared host's cores moves it); every launch's figures kept (``launch_*``; the rest are the first's)."""
    if not timings:
        raise ValueError("no sync timings to pool")
    keys = ("world_size", "gradients", "gradient_bytes", "spec_step_ms")
    if any(t.get(k) != timings[0].get(k) for t in timings for k in keys):
        raise ValueError("sync timings of different skeletons cannot be pooled: "
                         f"{[[t.get(k) for k in keys] for t in timings]}")
    ranks = [t["rank_sync_ms"] for t in timings]
    return timings[0] | {"launches": len(timings), "launch_sync_ms": [t["sync_ms"] for t in timings],
                         "sync_ms": statistics.median(t["sync_ms"] for t in timings),
                         "launch_job_ddp_ms_p50": [t["job_ddp_ms_p50"] for t in timings],
                         "launch_plain_ms_p50": [t["plain_ms_p50"] for t in timings],
                         "launch_rank_sync_ms": ranks, "rank_sync_ms": statistics.median(ranks),
                         "timed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def read_sync_spec(path: Path) -> dict:
    """A DDP skeleton's spec from ``path``: a prediction's JSON (its ``inputs.data_parallel.sync_spec``) or the
    spec itself."""
    record = read_json_file(path)
    spec = (record.get("inputs") or {}).get("data_parallel", {}).get("sync_spec") if "inputs" in record else record
    if not isinstance(spec, dict) or not {"gradients", "ready_ms", "step_ms", "world_size"} <= set(spec):
        raise ValueError(f"{path}: neither a prediction at world_size>1 (predict --json) nor its sync_spec")
    return spec


def time_sync(spec: dict, out: Path, passes: int, warmup: int) -> dict[str, Any]:
    """Time the skeleton in this process group (its world size must be the spec's); every rank gets the timing,
    rank 0 writes it to ``out``."""
    world = env_dist_info().world_size
    if world != int(spec["world_size"]):
        raise ValueError(f"the skeleton is of a step at {spec['world_size']} ranks, this runs {world}: launch it "
                         f"with torchrun --nproc-per-node {spec['world_size']} -m harness.whatif.sync_probe ...")
    if world < 2:
        raise ValueError("the sync probe needs 2 or more ranks: launch it with torchrun --nproc-per-node W")
    # this rank's device, in the process group
    platform, _ = join_process_group(to_run_config(compose_config(["tracking=off"])))
    timing = time_gradient_sync(spec, platform.device, passes, warmup).to_json()
    if os.environ.get("RANK", "0") == "0":
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, json.dumps(timing, indent=1))  # whole or absent, should the rank die after
    return timing


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness.whatif.sync_probe",
                                     description="under torchrun: time what DDP's gradient synchronisation adds to a "
                                                 "predicted step at this world size (on the skeleton `cobench trace "
                                                 "predict world_size=W` writes)")
    parser.add_argument("spec", type=Path,
                        help="the skeleton: a prediction's JSON (predict --json) or its sync_spec")
    parser.add_argument("--out", type=Path, required=True, help="the timing (JSON), for predict --gradient-sync")
    parser.add_argument("--passes", type=int, default=PASSES,
                        help=f"timed passes of each variant (default {PASSES})")
    parser.add_argument("--warmup", type=int, default=WARMUP,
                        help=f"untimed passes of each variant first (default {WARMUP})")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The entry point: time the skeleton; bad input is exit 2 with a message, as cobench's commands do."""
    args = _parser().parse_args(argv)
    try:
        timing = time_sync(read_sync_spec(args.spec), args.out, args.passes, args.warmup)
    except ValueError as err:
        print(f"sync probe: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        shutdown_distributed()
    if os.environ.get("RANK", "0") == "0":
        print(f"DDP gradient sync at {timing['world_size']} ranks ({timing['gradients']} gradients, "
              f"{timing['gradient_bytes'] / 1e6:.2f} MB): +{timing['sync_ms']:.2f} ms a step (skeleton "
              f"{statistics.median(timing['plain_ms_p50']):.2f} ms without DDP, "
              f"{statistics.median(timing['ddp_ms_p50']):.2f} with; {timing['passes']} passes each): {args.out}")
    return EXIT_OK


if __name__ == "__main__":
    exit_rank(main())
