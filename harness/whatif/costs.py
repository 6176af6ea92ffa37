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
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

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
        record = read_stage_timing(timing_file, world)
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


def read_stage_timing(timing_file: Path, world: int | str) -> dict[str, Any]:
    """A sharded-stage timing (``--sharded-stage``), refused where it does not exist or is not one."""
    if not timing_file.exists():
        raise ValueError(f"--sharded-stage {timing_file} does not exist: time the stage with `torchrun "
                         f"--nproc-per-node {world} -m harness.whatif.stage_probe BUNDLE --out FILE`")
    record = read_json_file(timing_file)
    ShardedStageCost.from_timing(record, str(timing_file))
    return record


def read_sync_timing(timing_file: Path, world: int | str) -> GradientSyncCost:
    """A gradient-sync timing (``--gradient-sync``), refused where it does not exist or is not one."""
    if not timing_file.exists():
        raise ValueError(f"--gradient-sync {timing_file} does not exist: time the skeleton with `torchrun "
                         f"--nproc-per-node {world} -m harness.whatif.sync_probe PREDICTION.json --out FILE`")
    return GradientSyncCost.from_timing(read_json_file(timing_file), str(timing_file))


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
        return read_sync_timing(timing_file, world)
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
    figure. A launch a signal ended (a rank aborted or was killed: on a shared host, gloo's transport can abort a
    rank) is run once more, and the pooled record keeps what it said (``crashed_launches``); a second such end,
    or a rank's own error (bad input), fails with every rank's last words. A launch that wrote its timing and
    crashed after (while tearing down) keeps its timing, the crash noted the same way."""
    records, crashed = [], []
    for i in range(launches):
        part = cached.with_suffix(f".launch{i}.json")
        for attempt in range(1 + CRASH_RETRIES):
            part.unlink(missing_ok=True)  # only this launch's timing counts
            with tempfile.TemporaryDirectory(prefix="cobench-launch-") as logs:
                done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                                       "--log-dir", logs, "--tee", "3", "-m", probe, *arguments, "--out", str(part)],
                                      capture_output=True, text=True)
                failure = launch_failure(done.stderr or done.stdout, Path(logs)) if done.returncode else None
            if part.exists():  # written whole (atomically) once every rank's timing was gathered: a crash after it
                if failure is not None:  # (a rank's transport tearing down) leaves the timing as it was
                    crashed.append({"launch": i, "signal": failure.signal, "after_timing": True,
                                    "ranks": failure.message[-2000:]})
                break
            if failure is None or failure.signal is None or attempt == CRASH_RETRIES:
                why = f", a rank ended by {failure.signal}" if failure and failure.signal else ""
                raise RuntimeError(f"timing {what} at {world} ranks failed (exit {done.returncode}{why}): "
                                   f"{failure.message if failure else 'it wrote no timing'}")
            print(f"  warning: launch {i + 1} of {what} at {world} ranks ended by {failure.signal}; running it again "
                  f"({failure.message[-300:]})", file=sys.stderr, flush=True)
            crashed.append({"launch": i, "signal": failure.signal, "after_timing": False,
                            "ranks": failure.message[-2000:]})
        records.append(read_json_file(part))
        part.unlink()
    pooled = pool(records)
    if crashed:
        pooled["crashed_launches"] = crashed
    cached.write_text(json.dumps(pooled, indent=1))


CRASH_RETRIES = 1  # a launch a signal ended is run once more (see launch_pooled)


class LaunchFailure(NamedTuple):
    """Why a torchrun launch failed: the signal that ended its first failed rank (None: that rank exited with an
    error of its own), and every rank's last lines of stderr."""

    signal: str | None
    message: str


def launch_failure(torchrun_stderr: str, log_dir: Path, tail: int = 1500) -> LaunchFailure:
    """Read a failed ``torchrun --log-dir LOG_DIR --tee 3`` launch: torchrun's report names the first rank that
    failed and its exit code (negative: a signal); each rank's own stderr is in LOG_DIR, which torchrun's report,
    printed last, would otherwise push out of sight."""
    root = torchrun_stderr.rpartition("Root Cause")[2]
    code = re.search(r"exitcode\s*:\s*(-?\d+)", root)
    signal_name = None
    if code and int(code.group(1)) < 0:
        try:
            signal_name = signal.Signals(-int(code.group(1))).name
        except ValueError:
            signal_name = f"signal {-int(code.group(1))}"
    ranks = []
    for path in sorted(log_dir.glob("*/attempt_*/*/stderr.log"), key=lambda p: int(p.parent.name)):
        text = path.read_text(errors="replace").strip()
        if text:
            ranks.append(f"[rank {path.parent.name}] ...{text[-tail:]}" if len(text) > tail
                         else f"[rank {path.parent.name}] {text}")
    message = "\n".join(ranks) if ranks else torchrun_stderr.strip()[-2000:]
    return LaunchFailure(signal_name, message)


def changes_key(changes: list[str]) -> str:
    """A cache file's suffix for a prediction's workload.* changes ("" for none): a timing kept per change."""
    key = "-".join(c.removeprefix("workload.").replace("=", "") for c in sorted(changes) if c.startswith("workload."))
    return f"_{key}" if key else ""
