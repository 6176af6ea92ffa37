"""A workload's sharded embedding stage, timed alone at this process group's world size.

What-if prediction of a TorchRec workload at W ranks needs what ``DistributedModelParallel`` does there —
the sharded lookups, the KJT's input all-to-alls, the embeddings' all-to-all and its backward, the fused
optimizer, and the waits for the rank whose shards are busiest — which a single-rank capture cannot show
(its tables run unsharded). Like TorchRec's own sharded-module benchmarks, this runs that stage alone
(:meth:`workloads.base.WorkloadBase.sharded_stage`) under ``torchrun`` on the target, on the workload's own
per-rank batches and sharding plan, and times it with the step timer. Every rank runs it; the stage's
collectives keep the ranks in step, so its time is the slowest rank's, which every rank then waits for.

    torchrun --nproc-per-node 2 -m harness.whatif.stage_probe BUNDLE --out FILE [--passes 100 --warmup 10]
             [workload.* changes]

times the stage of a single-rank capture's workload and config (with the prediction's ``workload.*`` changes)
at the launch's world size; rank 0 writes the timing (JSON), what ``cobench trace predict --sharded-stage``
takes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from harness.cli import EXIT_BAD_INPUT, EXIT_OK
from harness.config import CobenchConfig, compose_config, to_run_config
from harness.distributed import exit_rank, gather_to_all, shutdown_distributed
from harness.files import write_atomic
from harness.running.runner import set_up_workload
from harness.running.timing import StepTimer
from harness.whatif.cache import cache_dir
from harness.whatif.graph import load_graph

PASSES = 100  # timed passes a launch: 2 ranks on 2 shared cores swing it 2-3x pass to pass
WARMUP = 10  # untimed passes first


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
    with set_up_workload(cfg, work_dir) as opened:
        stage = opened.workload.sharded_stage()
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


def time_stage(bundle: Path, out: Path, passes: int, warmup: int, changes: list[str]) -> dict[str, Any]:
    """Time the sharded stage of ``bundle``'s workload (its captured config with ``changes``, ``workload.KEY=VALUE``
    items) in this process group; every rank gets the timing, rank 0 writes it to ``out``."""
    graph = load_graph(bundle)
    bad = [c for c in changes if not c.startswith("workload.") or "=" not in c]
    if bad:
        raise ValueError(f"the stage probe takes workload.KEY=VALUE changes only, got {bad[0]!r}")
    overrides = OmegaConf.to_container(OmegaConf.from_dotlist([c.removeprefix("workload.") for c in changes]))
    workload = graph.workload_config(overrides)
    if workload is None:
        raise ValueError(f"{bundle}: its workload {graph.workload!r} cannot be built by this version of cobench "
                         "(or the changes do not fit its config)")
    cfg = to_run_config(compose_config([f"workload={graph.workload}", "tracking=off",
                                        f"seed={graph.config.get('seed', 1234)}"]))
    cfg.workload = workload
    timing = time_sharded_stage(cfg, cache_dir(bundle) / "stage_probe", passes, warmup).to_json()
    timing["changes"] = changes
    if os.environ.get("RANK", "0") == "0":
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, json.dumps(timing, indent=1))  # whole or absent, should the rank die after
    return timing


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness.whatif.stage_probe",
                                     description="under torchrun: time a TorchRec workload's sharded embedding stage "
                                                 "alone at this world size (what `cobench trace predict world_size=W` "
                                                 "needs of it)")
    parser.add_argument("bundle", type=Path, help="the single-rank capture whose workload and config are timed")
    parser.add_argument("--out", type=Path, required=True, help="the timing (JSON), for predict --sharded-stage")
    parser.add_argument("--passes", type=int, default=PASSES, help=f"timed passes (default {PASSES})")
    parser.add_argument("--warmup", type=int, default=WARMUP, help=f"untimed passes first (default {WARMUP})")
    parser.add_argument("changes", nargs="*",
                        help="workload.* changes the prediction makes (e.g. workload.batch_size=B)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The entry point: time the stage; bad input is exit 2 with a message, as cobench's commands do."""
    args = _parser().parse_args(argv)
    try:
        timing = time_stage(args.bundle, args.out, args.passes, args.warmup, args.changes)
    except ValueError as err:
        print(f"stage probe: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        shutdown_distributed()
    if os.environ.get("RANK", "0") == "0":
        print(f"{timing['workload']} sharded stage ({timing['module']}) at {timing['world_size']} rank(s): "
              f"{timing['ms_p50']:.2f} ms a pass (p10 {timing['ms_p10']:.2f}, p90 {timing['ms_p90']:.2f}, "
              f"{timing['passes']} passes): {args.out}")
    return EXIT_OK


if __name__ == "__main__":
    exit_rank(main())
