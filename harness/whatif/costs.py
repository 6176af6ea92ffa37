"""The measured costs a prediction at W ranks takes: TorchRec's sharded stage and DDP's gradient synchronisation.

Each comes from a timing file made on the target, else from the bundle's what-if cache
(:mod:`harness.whatif.cache`, one record per world size and ``workload.*`` changes), else it is timed now:
``torchrun`` launches of its probe (:mod:`.stage_probe`, :mod:`.sync_probe`) on this host, their records pooled —
a launch's placement of ranks on a shared host's cores moves its figure — or, when this process already runs
at W ranks, in its own process group. For another platform neither is timed here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.whatif import stage_probe, sync_probe
from harness.whatif.cache import cache_dir, read_json_file
from harness.whatif.dataparallel import GradientSyncCost, ShardedStageCost
from harness.whatif.graph import Graph
from workloads import discover
from workloads.base import WorkloadBase

STAGE_LAUNCHES = 3  # launches pooled: where a launch's ranks land on the cores moves its median by ±15 %
SYNC_LAUNCHES = 3  # launches pooled, the sync cost their median
SYNC_REUSE = 0.2  # a bundle's sync timing serves a prediction whose step is within this share of the one it timed


def has_sharded_stage(workload: str) -> bool:
    """Whether the registered workload has a TorchRec sharded stage (it implements ``sharded_stage``)."""
    spec = discover().get(workload)
    if spec is None:
        return False
    return getattr(spec.factory, "sharded_stage", WorkloadBase.sharded_stage) is not WorkloadBase.sharded_stage


def stage_cost(bundle: Path, graph: Graph, world: int, changes: list[str], timing_file: Path | None,
               other_platform: bool) -> ShardedStageCost:
    """The sharded stage's time at ``world`` ranks: ``timing_file`` (``--sharded-stage``), else the bundle's
    timing for these ``changes``, else timed now (the stage probe under torchrun on this host, launches pooled;
    in this process group when this process already runs under torchrun at that world size)."""
    stage_changes = sorted(c for c in changes if c.startswith("workload."))
    if timing_file is not None:
        if not timing_file.exists():
            raise ValueError(f"--sharded-stage {timing_file} does not exist: time the stage with `torchrun "
                             f"--nproc-per-node {world} -m harness.whatif.stage_probe BUNDLE --out FILE`")
        record = read_json_file(timing_file)
        if sorted(record.get("changes") or []) != stage_changes:
            raise ValueError(f"--sharded-stage {timing_file} was timed with changes {record.get('changes')}, "
                             f"this prediction makes {stage_changes}: time it with the same workload.* changes")
        return ShardedStageCost.from_timing(record, str(timing_file))
    if other_platform:
        raise ValueError(f"predicting {graph.workload} at world_size={world} for another platform needs its sharded "
                         f"stage timed there: `torchrun --nproc-per-node {world} -m harness.whatif.stage_probe BUNDLE "
                         "--out FILE` on the target, then --sharded-stage FILE")
    cached = cache_dir(bundle) / f"sharded_stage_{world}ranks{changes_key(stage_changes)}.json"
    if not cached.exists():
        if int(os.environ.get("WORLD_SIZE", "1")) == world:  # already W ranks (predict --measure under torchrun):
            # every rank times it together and gets the same record (rank 0 also keeps it in the bundle)
            record = stage_probe.time_stage(bundle, cached, STAGE_LAUNCHES * stage_probe.PASSES, stage_probe.WARMUP,
                                            stage_changes)
            return ShardedStageCost.from_timing(record, str(cached))
        print(f"  timing {graph.workload}'s sharded embedding stage at {world} ranks ({STAGE_LAUNCHES} torchrun "
              f"launches of {stage_probe.PASSES} passes) ...", flush=True)
        launch_pooled(world, stage_probe.__name__, [str(bundle), *stage_changes], cached, STAGE_LAUNCHES,
                      stage_probe.pooled, "the sharded stage")
    return ShardedStageCost.from_timing(read_json_file(cached), str(cached))


def sync_cost(bundle: Path, spec: dict | None, world: int, changes: list[str], timing_file: Path | None,
              from_table: bool, other_platform: bool) -> GradientSyncCost | None:
    """DDP's gradient synchronisation at ``world`` ranks for this prediction's skeleton ``spec``: ``timing_file``
    (``--gradient-sync``), else the bundle's timing of a skeleton of these ``changes`` (the same gradients, its
    step within :data:`SYNC_REUSE`), else timed now (the sync probe under torchrun on this host, launches
    pooled; in this process group when this process already runs at that world size). None: ``from_table``
    (``--sync-from table``), one rank, or another platform without a timing made there."""
    if spec is None or world < 2:
        return None
    if timing_file is not None:
        if not timing_file.exists():
            raise ValueError(f"--gradient-sync {timing_file} does not exist: time the skeleton with `torchrun "
                             f"--nproc-per-node {world} -m harness.whatif.sync_probe PREDICTION.json --out FILE`")
        return GradientSyncCost.from_timing(read_json_file(timing_file), str(timing_file))
    if from_table:
        return None
    if other_platform:
        print("  note: DDP's synchronisation on another platform is timed there: `torchrun --nproc-per-node "
              f"{world} -m harness.whatif.sync_probe PREDICTION.json --out FILE` on the target (PREDICTION.json: "
              "this command's --json), then --gradient-sync FILE; until then the all-reduce alone is counted")
        return None
    cached = cache_dir(bundle) / f"gradient_sync_{world}ranks{changes_key(changes)}.json"
    if cached.exists():
        record = read_json_file(cached)
        if record.get("gradients") != len(spec["gradients"]) or "job_ddp_ms_p50" not in record or \
                abs(float(record.get("spec_step_ms", 0.0)) / spec["step_ms"] - 1.0) > SYNC_REUSE:
            # a skeleton of another step (other curves, another stage timing), or a timing of each rank's own
            # median (an earlier cobench): time this one
            cached.unlink()
    spec_file = cached.with_suffix(".spec.json")
    if not cached.exists():
        if int(os.environ.get("WORLD_SIZE", "1")) == world:  # already W ranks: time it in this process group
            record = sync_probe.time_sync(spec, cached, SYNC_LAUNCHES * sync_probe.PASSES, sync_probe.WARMUP)
            return GradientSyncCost.from_timing(record | {"launch_sync_ms": [record["sync_ms"]]}, str(cached))
        print(f"  timing DDP's gradient synchronisation at {world} ranks on a skeleton of this step ({SYNC_LAUNCHES} "
              f"torchrun launches of {sync_probe.PASSES} passes) ...", flush=True)
        spec_file.write_text(json.dumps(spec))
        launch_pooled(world, sync_probe.__name__, [str(spec_file)], cached, SYNC_LAUNCHES, sync_probe.pooled,
                      "DDP's gradient sync")
    return GradientSyncCost.from_timing(read_json_file(cached), str(cached))


def launch_pooled(world: int, probe: str, arguments: list[str], cached: Path, launches: int,
                  pool: Callable[[list[dict[str, Any]]], dict[str, Any]], what: str) -> None:
    """``launches`` torchrun launches at ``world`` ranks of ``python -m <probe> <arguments> --out PART``, their
    records pooled (``pool``) into ``cached``: a launch's placement of ranks on a shared host's cores moves its
    figure."""
    records = []
    for i in range(launches):
        part = cached.with_suffix(f".launch{i}.json")
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "-m",
                               probe, *arguments, "--out", str(part)], capture_output=True, text=True)
        if done.returncode != 0 or not part.exists():
            raise RuntimeError(f"timing {what} at {world} ranks failed (exit {done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()[-2000:]}")
        records.append(read_json_file(part))
        part.unlink()
    cached.write_text(json.dumps(pool(records), indent=1))


def changes_key(changes: list[str]) -> str:
    """A cache file's suffix for a prediction's workload.* changes ("" for none): a timing kept per change."""
    key = "-".join(c.removeprefix("workload.").replace("=", "") for c in sorted(changes) if c.startswith("workload."))
    return f"_{key}" if key else ""
