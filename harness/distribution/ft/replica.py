"""One process of the failure scenario: a rank of a torchft replica group (``--side torchft``) or of the
plain checkpointed job (``--side baseline``), started by torchrun as ``python -m harness.distribution.ft.replica``.

It builds the workload with its :class:`~workloads.fault_tolerance.FaultTolerance`, trains, logs one JSON
line per step attempt, kills its own group at the kill step (the victim's first incarnation) and, at the
end, writes a hash of its training state.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import torch
from omegaconf import OmegaConf

from harness.config import CobenchConfig
from harness.distributed import DistInfo, exit_rank
from harness.distribution.ft.checks import total_steps
from harness.distribution.ft.group_sync import SYNC_DIR, agree_to_stop, wait_for_all_groups
from harness.distribution.ft.processes import kill_tree
from harness.platform import Platform, synchronize
from workloads import discover
from workloads.base import RunContext, Workload
from workloads.fault_tolerance import FaultTolerance


def state_hash(state: dict[str, Any]) -> str:
    """sha256 of a training state's model tensors (each rank's shard), in key order."""
    digest = hashlib.sha256()
    for key in sorted(state["model"]):
        tensor = state["model"][key]
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def load_run_config(path: Path) -> CobenchConfig:
    """The run's resolved config, as the launcher wrote it, typed again (workload schema included)."""
    loaded = OmegaConf.load(path)
    spec = discover()[loaded.workload.name]
    schema = OmegaConf.structured(CobenchConfig(workload=spec.config_class()))
    return OmegaConf.to_object(OmegaConf.merge(schema, loaded))


def torchft_manager(lighthouse_port: int, replica: int, dist_info: DistInfo) -> Any:
    """torchft's ``Manager`` for this rank of replica group ``replica`` (gloo across the groups), its
    lighthouse on this machine's ``lighthouse_port``."""
    from torchft import Manager, ProcessGroupGloo

    # timeouts nest: a collective gives up before a step, a step before a quorum
    return Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                   load_state_dict=None, state_dict=None, replica_id=f"replica{replica}",
                   lighthouse_addr=f"http://localhost:{lighthouse_port}", rank=dist_info.rank,
                   world_size=dist_info.world_size, timeout=timedelta(seconds=30),
                   quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=60),
                   hostname="localhost",
                   # FSDP2 inside a group: every rank heals before its forward (an asynchronous heal
                   # on one rank while another all-gathers mismatches the group's collectives)
                   use_async_quorum=dist_info.world_size == 1)


@dataclass
class ReplicaProcess:
    """This process of one side: its config, its place in its group, torchft's manager (None for the
    baseline) and the fault-tolerance handle the workload was built with."""

    cfg: CobenchConfig
    run_dir: Path
    side: str
    replica: int
    incarnation: int
    platform: Platform
    dist_info: DistInfo
    manager: Any
    tolerance: FaultTolerance

    @property
    def name(self) -> str:
        return f"ft_{self.side}_replica{self.replica}_rank{self.dist_info.rank}"

    @property
    def checkpoint(self) -> Path:
        return self.run_dir / f"ft_baseline_checkpoint_rank{self.dist_info.rank}.pt"

    def build_workload(self) -> Workload:
        """The workload, built against a context that carries the fault-tolerance handle."""
        dist_info = self.dist_info
        ctx = RunContext(device=self.platform.device, seed=self.cfg.seed, rank=dist_info.rank,
                         world_size=dist_info.world_size,
                         process_group=torch.distributed.group.WORLD if dist_info.enabled else None,
                         deterministic=self.cfg.deterministic, work_dir=self.run_dir,
                         device_name=self.platform.device_name, fault_tolerance=self.tolerance)
        return discover()[self.cfg.workload.name].factory(self.cfg.workload, ctx)

    def finished(self, at: int, ready: bool) -> bool:
        """Whether to stop after step ``at``. With torchft, training goes on past the last step until every
        group is back (at most ft.timeout_s): a restart takes seconds, and a group that came back after the
        others had finished could heal from no one. From the last step on, the groups agree after each step
        whether to stop (:func:`~harness.distribution.ft.group_sync.agree_to_stop`): all stop at the same step, with the
        same weights, or none does. ``ready``: the last step was committed by every group."""
        if self.manager is None:
            return at >= total_steps(self.cfg)
        if at < total_steps(self.cfg):
            return False
        done = agree_to_stop(self.run_dir / SYNC_DIR, at, self.replica, self.cfg.ft.replicas, ready) \
            if self.dist_info.rank == 0 else False
        if self.dist_info.enabled:  # the group's rank 0 decided for it: its ranks stop together (FSDP2 inside)
            flag = torch.tensor([1 if done else 0], device=self.platform.device)
            torch.distributed.broadcast(flag, src=0)
            done = flag.item() == 1
        return done

    def resume_step(self) -> int:
        """The baseline restarts from its last checkpoint (our own file: tensors and plain values only)."""
        if self.manager is None and self.checkpoint.exists():
            saved = torch.load(self.checkpoint, weights_only=True)
            self.tolerance.load_state_dict(saved["state"])
            return saved["step"]
        return 0

    def save_checkpoint(self, step: int) -> None:
        """The baseline's checkpoint after ``step``, every rank's at once, replaced atomically."""
        if self.dist_info.enabled:
            torch.distributed.barrier()
        tmp = self.checkpoint.with_suffix(".tmp")
        torch.save({"step": step, "state": self.tolerance.state_dict()}, tmp)
        os.replace(tmp, self.checkpoint)

    def train(self, workload: Workload) -> int:
        """Step until :meth:`finished`, one log line per step attempt; the victim kills its group at the
        kill step. Returns the last step."""
        ft, manager = self.cfg.ft, self.manager
        step = self.resume_step()
        victim = self.incarnation == 0 and self.replica == (ft.kill_replica if manager else 0)
        full = False  # whether the last step was committed by every group: this group is ready to stop after it
        with (self.run_dir / f"{self.name}.jsonl").open("a") as log:
            while not self.finished(step, full):
                before = manager.current_step() if manager else step
                start = time.time()
                result = workload.step()
                synchronize(self.platform.device)
                if manager is not None:  # waiting for the next quorum (a dead peer's heartbeat timeout) is in the step
                    step = manager.current_step()
                    committed = step > before
                    participants = manager.num_participants()
                    full = committed and participants == ft.replicas
                else:  # the plain job: its checkpoints' cost is in its steps
                    step, committed, participants = step + 1, True, 1
                    if step % ft.checkpoint_interval == 0:
                        self.save_checkpoint(step)
                end = time.time()
                log.write(json.dumps({"incarnation": self.incarnation, "start": start, "end": end, "step": step,
                                      "committed": committed, "participants": participants,
                                      "samples": result.samples}) + "\n")
                log.flush()
                if victim and committed and step == ft.kill_at_step and self.dist_info.rank == 0:
                    self.kill_own_group(log, step)
        return step

    def kill_own_group(self, log: IO[str], step: int) -> None:
        """The failure, at exactly this step: SIGKILL to the whole group (torchrun's agent and every rank)."""
        log.write(json.dumps({"killed_at": time.time(), "step": step}) + "\n")
        log.close()
        kill_tree(os.getppid())  # torchrun's agent for this group, then its ranks, this one last


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness.distribution.ft.replica")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--side", choices=("torchft", "baseline"), required=True)
    parser.add_argument("--replica", type=int, default=0)
    parser.add_argument("--incarnation", type=int, default=0)
    parser.add_argument("--lighthouse-port", type=int, default=0, help="where the supervisor's lighthouse listens")
    return parser


def replica_main(argv: list[str]) -> int:
    """One process of a replica group (``--side torchft``) or of the plain job (``--side baseline``)."""
    from harness.running.loop import seed_everything
    from harness.running.runner import join_process_group

    args = _parser().parse_args(argv)
    cfg = load_run_config(args.run_dir / "config.yaml")
    ft = cfg.ft
    platform, dist_info = join_process_group(cfg)
    manager = torchft_manager(args.lighthouse_port, args.replica, dist_info) if args.side == "torchft" else None
    tolerance = FaultTolerance(replica=args.replica, replicas=ft.replicas if manager else 1, manager=manager)
    if manager is not None and args.incarnation == 0:  # all groups meet before their first quorum
        tolerance.before_first_quorum = lambda: wait_for_all_groups(
            args.run_dir / SYNC_DIR, f"start.rank{dist_info.rank}", args.replica, ft.replicas, ft.timeout_s)
    process = ReplicaProcess(cfg, args.run_dir, args.side, args.replica, args.incarnation, platform, dist_info,
                             manager, tolerance)
    workload = process.build_workload()
    seed_everything(cfg.seed, cfg.deterministic)
    workload.setup()
    step = process.train(workload)
    (args.run_dir / f"{process.name}.final.json").write_text(json.dumps({"step": step,
                                                                         "hash": state_hash(tolerance.state_dict())}))
    workload.teardown()
    if manager is not None:
        manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    exit_rank(replica_main(sys.argv[1:]))  # past the interpreter's teardown, where a gloo group can abort a rank
