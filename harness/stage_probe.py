"""A workload's sharded embedding stage, timed alone at this process group's world size.

What-if prediction of a TorchRec workload at W ranks needs what ``DistributedModelParallel`` does there —
the sharded lookups, the KJT's input all-to-alls, the embeddings' all-to-all and its backward, the fused
optimizer, and the waits for the rank whose shards are busiest — which a single-rank capture cannot show
(its tables run unsharded). Like TorchRec's own sharded-module benchmarks, this runs that stage alone
(:meth:`workloads.base.WorkloadBase.sharded_stage`) under ``torchrun`` on the target, on the workload's own
per-rank batches and sharding plan, and times it with the step timer. Every rank runs it; the stage's
collectives keep the ranks in step, so its time is the slowest rank's, which every rank then waits for.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness.config import CobenchConfig
from harness.distributed import gather_to_all
from harness.loop import seed_everything
from harness.runner import open_workload
from harness.timing import StepTimer


@dataclass
class StageTiming:
    """The sharded stage's time per pass at ``world_size`` ranks (median over passes of the slowest rank)."""

    workload: str
    module: str
    world_size: int
    batch_size: int | None
    threads_per_rank: int
    passes: int
    warmup: int
    ms_p50: float  # per pass, the slowest rank's time: the median over passes
    ms_p10: float
    ms_p90: float
    rank_ms_p50: list[float]  # each rank's own median
    slowest_ms: list[float]  # per pass, the slowest rank's time (what timings of several launches pool)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def time_sharded_stage(cfg: CobenchConfig, work_dir: Path, passes: int, warmup: int) -> StageTiming:
    """Set up the workload ``cfg`` names in this process group and time its sharded stage (every rank calls
    this; every rank gets the result). ValueError when the workload has no sharded stage."""
    import torch

    if passes < 3 or warmup < 0:
        raise ValueError(f"the stage needs at least 3 timed passes and warmup >= 0 (got {passes}, {warmup})")
    opened = open_workload(cfg, work_dir)
    seed_everything(cfg.seed, cfg.deterministic)
    workload = opened.workload
    workload.setup()
    try:
        stage = workload.sharded_stage()
        if stage is None:
            raise ValueError(f"workload {cfg.workload.name} has no sharded embedding stage to time")
        timer = StepTimer(opened.ctx.device)
        for i in range(warmup + passes):
            if i >= warmup:
                timer.start()
            stage.run()
            if i >= warmup:
                timer.stop()
        mine = [1e3 * s for s in timer.durations_s()]
    finally:
        workload.teardown()
    every = gather_to_all(mine) if opened.dist.enabled else [mine]
    slowest = [max(times) for times in zip(*every, strict=True)]
    return StageTiming(cfg.workload.name, stage.module, opened.dist.world_size,
                       getattr(cfg.workload, "batch_size", None), torch.get_num_threads(), passes, warmup,
                       *_spread(slowest), [statistics.median(times) for times in every], slowest)


def pooled(timings: list[dict[str, Any]]) -> dict[str, Any]:
    """Timings of the same stage from several launches as one: their passes pooled (a launch's placement of
    ranks on cores moves its median by ±15 % on a shared host; the pooled median is steadier)."""
    if not timings:
        raise ValueError("no stage timings to pool")
    first = timings[0]
    keys = ("workload", "module", "world_size", "batch_size")
    for other in timings[1:]:
        if any(other.get(k) != first.get(k) for k in keys):
            raise ValueError("stage timings of different stages or configs cannot be pooled: "
                             f"{[[t.get(k) for k in keys] for t in timings]}")
    slowest = [ms for t in timings for ms in t["slowest_ms"]]
    p50, p10, p90 = _spread(slowest)
    return first | {"passes": len(slowest), "ms_p50": p50, "ms_p10": p10, "ms_p90": p90, "launches": len(timings),
                    "launch_ms_p50": [t["ms_p50"] for t in timings], "slowest_ms": slowest,
                    "rank_ms_p50": [statistics.median(r) for r in zip(*(t["rank_ms_p50"] for t in timings),
                                                                       strict=True)]}


def _spread(values: list[float]) -> tuple[float, float, float]:
    """(median, 10th, 90th percentile)."""
    deciles = statistics.quantiles(values, n=10)
    return statistics.median(values), deciles[0], deciles[-1]
