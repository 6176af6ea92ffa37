"""The failure scenario (``ft=torchft``): replica groups under torchft, one killed and restarted.

``cobench run workload=llama ft=torchft ft.replicas=2 ft.kill_at_step=20`` runs, in this order:

1. checks (bad input costs nothing): a workload that supports fault tolerance, enough processes for
   ``replicas × procs_per_replica``, a kill step inside the run with room to recover, a free
   lighthouse port;
2. torchft's ``torchft_lighthouse`` and R replica groups, each its own ``torchrun`` (its own TCPStore
   and process group; FSDP2 inside a group of more than one rank). Each process builds the workload
   with a :class:`~workloads.fault_tolerance.FaultTolerance` holding torchft's ``Manager`` (a
   ``ProcessGroupGloo`` across replicas); the workload wraps its model and optimizer with it;
3. once group ``kill_replica`` has committed ``kill_at_step``, SIGKILL to its whole process group;
   ``restart_delay_s`` later it starts again and heals from a peer over HTTP while the survivors go on;
4. with ``ft.baseline``, the same failure without torchft: one job of all the processes, checkpointed
   every ``checkpoint_interval`` steps, killed at the same step, restarted after the same delay from
   its last checkpoint;
5. one MLflow run with both sides' metrics (:func:`scenario_metrics`), the step logs as artifacts.

Every process appends one JSON line per step attempt to ``<run>/ft_<side>_replica<r>_rank<k>.jsonl``
(wall-clock start/end, the manager's committed step, whether it was committed, samples) and, at the
end, a hash of its training state, from which the launcher computes everything.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch
from omegaconf import OmegaConf

from harness.config import CobenchConfig, results_root
from harness.files import write_atomic
from harness.runner import STATUS_FAILED, STATUS_FINISHED, BenchmarkResult, new_run_dir, open_run, write_and_publish
from workloads import discover

MIN_STEPS_AFTER_KILL = 5  # the restarted replica needs steps to heal and commit before the run ends
SUPPORTING_WORKLOADS = ("llama",)  # workloads whose setup() calls RunContext.fault_tolerance.attach


# -- checks ----------------------------------------------------------------------------------------

def total_steps(cfg: CobenchConfig) -> int:
    return cfg.runner.warmup_steps + cfg.runner.steps


def check_scenario(cfg: CobenchConfig) -> None:
    """Bad input → ValueError naming the key and the fix, before any process starts."""
    ft = cfg.ft
    if cfg.workload.name not in SUPPORTING_WORKLOADS:
        raise ValueError(f"invalid config 'ft': workload {cfg.workload.name!r} does not support fault tolerance; "
                         f"use one of {', '.join(SUPPORTING_WORKLOADS)} or ft=none")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("ft=torchft starts its own replica groups (one torchrun each): run `cobench run ... "
                         "ft=torchft` once, without torchrun; ft.procs_per_replica sets the ranks per group")
    available = ft.max_processes or os.cpu_count() or 1
    needed = ft.replicas * ft.procs_per_replica
    if needed > available:
        raise ValueError(f"invalid config 'ft.replicas': {ft.replicas} replica groups × {ft.procs_per_replica} "
                         f"process(es) = {needed} processes, but only {available} are available here "
                         f"(ft.max_processes, default the CPU count); lower ft.replicas or ft.procs_per_replica")
    steps = total_steps(cfg)
    if ft.kill_at_step > steps - MIN_STEPS_AFTER_KILL:
        raise ValueError(f"invalid config 'ft.kill_at_step': {ft.kill_at_step} is beyond the run: it has {steps} "
                         f"steps (runner.warmup_steps + runner.steps) and the restarted replica needs "
                         f"{MIN_STEPS_AFTER_KILL} after the kill; use ft.kill_at_step <= "
                         f"{steps - MIN_STEPS_AFTER_KILL} or more runner.steps")
    if ft.baseline and ft.checkpoint_interval >= ft.kill_at_step:
        raise ValueError(f"invalid config 'ft.checkpoint_interval': {ft.checkpoint_interval} >= ft.kill_at_step "
                         f"({ft.kill_at_step}): the baseline would have no checkpoint to restart from")
    if lighthouse_binary() is None:
        raise ValueError("ft=torchft needs torchft (its torchft_lighthouse program): pip install 'cobench[ft]' "
                         "(torchft==0.2.*)")
    if not port_is_free(ft.lighthouse_port):
        raise ValueError(f"invalid config 'ft.lighthouse_port': port {ft.lighthouse_port} is in use (another "
                         f"lighthouse or service?); pass a free one, e.g. ft.lighthouse_port={free_port()}")


def lighthouse_binary() -> str | None:
    """torchft's lighthouse program: beside this Python (a virtual environment's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    return str(beside) if beside.exists() else shutil.which("torchft_lighthouse")


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds: TIME_WAIT is no user
        try:
            sock.bind(("::" if socket.has_ipv6 else "", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the replica process ------------------------------------------------------------------------------

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


SYNC_DIR = "ft_sync"  # the groups' words to each other: when all started, when to stop (not results)
STOP_WAIT_S = 10.0  # how long a group that is ready to stop waits for the others' word on the same step


def agree_to_stop(folder: Path, step: int, replica: int, replicas: int, ready: bool) -> bool:
    """Whether every replica group stops after ``step``: the same answer for all of them, whenever they ask.

    Each group posts whether it is ready (its last step committed by every group); a ready group waits up
    to :data:`STOP_WAIT_S` for the others' posts for the same step. The first group to publish a decision
    for the step wins (an atomic ``link``), and everyone takes the published one: a group that lags or has
    died makes the decision "go on", never half the groups stopping. Reading each other's step logs instead
    raced (a rank saw a peer's line a moment before its counterpart did and left its group mid-step).
    """
    folder.mkdir(exist_ok=True)

    def post(name: str, value: str) -> str:  # create ``name`` with ``value`` unless it exists; its value
        tmp = folder / f".{name}.{replica}.{os.getpid()}"
        tmp.write_text(value)
        try:
            os.link(tmp, folder / name)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        return (folder / name).read_text()

    post(f"{step}.replica{replica}", "ready" if ready else "not ready")
    decision = "stop" if ready else "go on"
    deadline = time.monotonic() + STOP_WAIT_S
    while ready and decision == "stop":
        if (folder / f"{step}.decision").exists():
            break
        words = [(folder / f"{step}.replica{r}") for r in range(replicas)]
        if all(w.exists() for w in words):
            decision = "stop" if all(w.read_text() == "ready" for w in words) else "go on"
            break
        if time.monotonic() > deadline:
            decision = "go on"
            break
        time.sleep(0.005)
    return post(f"{step}.decision", decision) == "stop"


def meet(folder: Path, name: str, replica: int, replicas: int, timeout_s: float) -> None:
    """Wait until every replica group has come here (a file barrier): the lighthouse forms the first
    quorum with whoever joined within ``ft.join_timeout_ms``, and under load one group's start-up can
    take seconds longer than another's (it then healed at step 30 and never reached the kill step)."""
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.replica{replica}").touch()
    deadline = time.monotonic() + timeout_s
    while not all((folder / f"{name}.replica{r}").exists() for r in range(replicas)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"replica group {replica}: the other groups did not start within "
                               f"ft.timeout_s={timeout_s}")
        time.sleep(0.005)


def replica_main(argv: list[str]) -> int:
    """One process of a replica group (``--side torchft``) or of the plain job (``--side baseline``)."""
    from harness.loop import seed_everything
    from harness.platform import synchronize
    from harness.runner import join_process_group
    from workloads.base import RunContext
    from workloads.fault_tolerance import FaultTolerance

    parser = argparse.ArgumentParser(prog="python -m harness.ft")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--side", choices=("torchft", "baseline"), required=True)
    parser.add_argument("--replica", type=int, default=0)
    parser.add_argument("--incarnation", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = load_run_config(args.run_dir / "config.yaml")
    ft = cfg.ft
    platform, dist_info = join_process_group(cfg)
    manager = None
    if args.side == "torchft":
        from torchft import Manager, ProcessGroupGloo

        # timeouts nest: a collective gives up before a step, a step before a quorum
        manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                          load_state_dict=None, state_dict=None, replica_id=f"replica{args.replica}",
                          lighthouse_addr=f"http://localhost:{ft.lighthouse_port}", rank=dist_info.rank,
                          world_size=dist_info.world_size, timeout=timedelta(seconds=30),
                          quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=60),
                          hostname="localhost",
                          # FSDP2 inside a group: every rank heals before its forward (an asynchronous heal
                          # on one rank while another all-gathers mismatches the group's collectives)
                          use_async_quorum=dist_info.world_size == 1)
    tolerance = FaultTolerance(replica=args.replica, replicas=ft.replicas if manager else 1, manager=manager)
    if manager is not None and args.incarnation == 0:  # all groups meet before their first quorum
        tolerance.before_first_quorum = lambda: meet(args.run_dir / SYNC_DIR, f"start.rank{dist_info.rank}",
                                                     args.replica, ft.replicas, ft.timeout_s)
    ctx = RunContext(device=platform.device, seed=cfg.seed, rank=dist_info.rank, world_size=dist_info.world_size,
                     process_group=torch.distributed.group.WORLD if dist_info.enabled else None,
                     deterministic=cfg.deterministic, work_dir=args.run_dir, device_name=platform.device_name,
                     fault_tolerance=tolerance)
    workload = discover()[cfg.workload.name].factory(cfg.workload, ctx)
    seed_everything(cfg.seed, cfg.deterministic)
    workload.setup()
    name = f"ft_{args.side}_replica{args.replica}_rank{dist_info.rank}"
    checkpoint = args.run_dir / f"ft_baseline_checkpoint_rank{dist_info.rank}.pt"
    step = 0
    if manager is None and checkpoint.exists():  # our own file, written below: tensors and plain values only
        saved = torch.load(checkpoint, weights_only=True)
        tolerance.load_state_dict(saved["state"])
        step = saved["step"]
    log = (args.run_dir / f"{name}.jsonl").open("a")
    victim = args.incarnation == 0 and args.replica == (ft.kill_replica if manager else 0)
    # with torchft, training goes on past the last step until every group is back (at most ft.timeout_s): a
    # restart takes seconds, and a group that came back after the others had finished could heal from no one.
    # From the last step on, the groups agree after each step whether to stop (:func:`agree_to_stop`): all
    # stop at the same step, with the same weights, or none does.
    def finished(at: int, ready: bool) -> bool:
        if manager is None:
            return at >= total_steps(cfg)
        if at < total_steps(cfg):
            return False
        done = agree_to_stop(args.run_dir / SYNC_DIR, at, args.replica, ft.replicas, ready) \
            if dist_info.rank == 0 else False
        if dist_info.enabled:  # the group's rank 0 decided for it: its ranks stop together (FSDP2 inside)
            flag = torch.tensor([1 if done else 0], device=platform.device)
            torch.distributed.broadcast(flag, src=0)
            done = flag.item() == 1
        return done

    full = False  # whether the last step was committed by every group: this group is ready to stop after it
    while not finished(step, full):
        before = manager.current_step() if manager else step
        start = time.time()
        result = workload.step()
        synchronize(platform.device)
        if manager is not None:  # waiting for the next quorum (a dead peer's heartbeat timeout) is in the step
            step = manager.current_step()
            committed = step > before
            participants = manager.num_participants()
            full = committed and participants == ft.replicas
            end = time.time()
        else:  # the plain job: its checkpoints' cost is in its steps
            step, committed, participants = step + 1, True, 1
            if step % ft.checkpoint_interval == 0:
                if dist_info.enabled:
                    torch.distributed.barrier()
                torch.save({"step": step, "state": tolerance.state_dict()}, checkpoint.with_suffix(".tmp"))
                os.replace(checkpoint.with_suffix(".tmp"), checkpoint)
            end = time.time()
        log.write(json.dumps({"incarnation": args.incarnation, "start": start, "end": end, "step": step,
                              "committed": committed, "participants": participants,
                              "samples": result.samples}) + "\n")
        log.flush()
        if victim and committed and step == ft.kill_at_step and dist_info.rank == 0:
            # the failure, at exactly this step: SIGKILL to the whole group (torchrun's agent and every rank)
            log.write(json.dumps({"killed_at": time.time(), "step": step}) + "\n")
            log.close()
            kill_tree(os.getppid())  # torchrun's agent for this group, then its ranks, this one last
    (args.run_dir / f"{name}.final.json").write_text(json.dumps({"step": step,
                                                                  "hash": state_hash(tolerance.state_dict())}))
    log.close()
    workload.teardown()
    if manager is not None:
        manager.shutdown(wait=False)
    return 0


# -- the launcher ---------------------------------------------------------------------------------------

@dataclass
class Side:
    """One side of the scenario as it ran: its processes' step logs, the kill and restart times."""

    name: str
    kill_time: float = 0.0
    restart_time: float = 0.0
    logs: dict[tuple[int, int], list[dict]] = field(default_factory=dict)  # (replica, rank) → step attempts
    hashes: dict[tuple[int, int], str] = field(default_factory=dict)


def _read_logs(run_dir: Path, side: Side) -> None:
    for path in run_dir.glob(f"ft_{side.name}_replica*_rank*.jsonl"):
        replica, rank = (int(x) for x in path.stem.removeprefix(f"ft_{side.name}_replica").split("_rank"))
        entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        side.logs[(replica, rank)] = [e for e in entries if "killed_at" not in e]
    for path in run_dir.glob(f"ft_{side.name}_replica*_rank*.final.json"):
        replica, rank = (int(x) for x in path.name.removeprefix(f"ft_{side.name}_replica")
                         .removesuffix(".final.json").split("_rank"))
        side.hashes[(replica, rank)] = json.loads(path.read_text())["hash"]


def _spawn(cfg: CobenchConfig, run_dir: Path, side: str, replica: int, incarnation: int, nprocs: int,
           out: Path) -> subprocess.Popen:
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs), "--master-port", str(port),
           "-m", "harness.ft", "--run-dir", str(run_dir), "--side", side, "--replica", str(replica),
           "--incarnation", str(incarnation)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.Popen(cmd, stdout=out.open("a"), stderr=subprocess.STDOUT, env=env, cwd=os.getcwd(),
                            start_new_session=True)  # apart from ours: a Ctrl-C here is the launcher's to handle


def _kill_record(run_dir: Path, side: str, replica: int) -> float | None:
    """When the group killed itself (its rank 0's last log line), or None if it ended otherwise."""
    path = run_dir / f"ft_{side}_replica{replica}_rank0.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    last = json.loads(lines[-1]) if lines else {}
    return last.get("killed_at")


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun puts its ranks in sessions of their own, so a
    process group kill would leave them running); the caller, if among them, dies last."""
    try:
        root = psutil.Process(pid)
        victims = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    me = os.getpid()
    for victim in sorted(victims, key=lambda p: p.pid == me):
        try:
            victim.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def _kill(proc: subprocess.Popen) -> None:
    kill_tree(proc.pid)
    proc.wait()


def run_side(cfg: CobenchConfig, run_dir: Path, side: str) -> Side:
    """Start the side's groups, kill one at the step, restart it after the delay, wait for the end."""
    ft = cfg.ft
    groups = ft.replicas if side == "torchft" else 1
    nprocs = ft.procs_per_replica if side == "torchft" else ft.replicas * ft.procs_per_replica
    victim = ft.kill_replica if side == "torchft" else 0
    result = Side(side)
    procs = {r: _spawn(cfg, run_dir, side, r, 0, nprocs, run_dir / f"ft_{side}_replica{r}.log") for r in range(groups)}
    deadline = time.monotonic() + ft.timeout_s
    try:
        try:  # the victim kills itself at the step (replica_main): exact, however short the steps
            procs[victim].wait(timeout=ft.timeout_s)
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"{side}: step {ft.kill_at_step} not reached within "
                               f"ft.timeout_s={ft.timeout_s}") from err
        killed = _kill_record(run_dir, side, victim)
        if killed is None:
            raise RuntimeError(f"{side}: replica group {victim} ended (exit {procs[victim].returncode}) before "
                               f"step {ft.kill_at_step}; see {run_dir}/ft_{side}_replica{victim}.log")
        result.kill_time = killed
        time.sleep(ft.restart_delay_s)
        result.restart_time = time.time()
        procs[victim] = _spawn(cfg, run_dir, side, victim, 1, nprocs, run_dir / f"ft_{side}_replica{victim}.log")
        for replica, proc in procs.items():
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as err:
                raise RuntimeError(f"{side}: replica group {replica} still running after ft.timeout_s={ft.timeout_s}"
                                   ) from err
            if code != 0:
                raise RuntimeError(f"{side}: replica group {replica} failed (exit {code}); "
                                   f"see {run_dir}/ft_{side}_replica{replica}.log")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                _kill(proc)
    _read_logs(run_dir, result)
    return result


def _failure_free_step_s(logs: list[list[dict]], skip: int) -> float:
    """The median committed step with every group taking part, leaving out each process start's first
    ``skip`` steps (the harness's warm-up: allocations, first-touch)."""
    full = max(e["participants"] for log in logs for e in log)
    durations = []
    for log in logs:
        for incarnation in {e["incarnation"] for e in log}:
            mine = [e for e in log if e["incarnation"] == incarnation][skip:]
            durations += [e["end"] - e["start"] for e in mine if e["committed"] and e["participants"] == full]
    return statistics.median(durations)


def scenario_metrics(side: Side, prefix: str = "", skip: int = 0) -> dict[str, float]:
    """The side's figures (names below; the baseline's carry ``prefix`` ``baseline_``):

    - ``stall_s``: the survivors' longest step beyond their median step (for the baseline, whose
      every rank died: the kill → its first step after the restart, ``restart_s``);
    - ``recovery_s``: the kill → the restarted group's first committed step (baseline: → the step it
      was killed at, reached again);
    - ``steps_lost``: committed steps that had to be trained again (torchft: a committed step number
      a survivor committed twice; baseline: the kill step − the checkpoint it restarted from);
    - ``steps``: the last committed step (torchft trains past the run's last step until every group is back);
    - ``effective_training_time_pct``: the time rank 0 of a surviving group (baseline: of the job) spent
      in steps that count (committed and never redone) ÷ the wall time from the first step's start to
      the last step's end, × 100: stalls, restarts and redone steps are what is lost (time-based like
      the seed's figure, so the survivors training faster alone on a shared CPU does not inflate it);
    - ``goodput``: committed samples per second ÷ failure-free samples per second: every group training
      at the median committed step with all groups taking part (warm-up steps left out). On a shared
      CPU a group training alone steps faster than beside its peers, which lifts torchft's figure;
      on separate devices it does not;
    - ``weights_identical``: 1 when every replica group ends with the same training state (torchft).
    """
    rank0 = {r: log for (r, k), log in side.logs.items() if k == 0}
    victims = {r for r, log in rank0.items() if any(e["incarnation"] == 1 for e in log)}
    survivors = [log for r, log in rank0.items() if r not in victims] or list(rank0.values())
    clean_step_s = _failure_free_step_s(survivors, skip)
    every = [e for log in side.logs.values() for e in log]
    steps = max(e["step"] for e in every)  # torchft trains on until the restarted group is back
    wall = max(e["end"] for e in every) - min(e["start"] for e in every)
    reborn = [e for r in victims for e in rank0[r] if e["incarnation"] == 1 and e["committed"]]
    if not reborn:
        raise RuntimeError(f"{side.name}: the restarted group committed no step before the run ended; give it time "
                           f"to come back: more runner.steps or a shorter ft.restart_delay_s")
    if not prefix and not any(e["participants"] > 1 for e in reborn):
        raise RuntimeError("torchft: the restarted replica group trained alone: the survivors had finished before it "
                           "came back, so it could not heal from them; run more runner.steps (a restart takes "
                           "seconds) or a shorter ft.restart_delay_s")
    first_back = min(e["end"] for e in reborn) - side.kill_time
    m: dict[str, float] = {}
    if prefix:  # the baseline: one job, every rank restarted
        killed_at = max(e["step"] for log in rank0.values() for e in log if e["incarnation"] == 0)
        resumed_from = min(e["step"] for e in reborn) - 1
        m["restart_s"] = m["stall_s"] = first_back
        m["recovery_s"] = min(e["end"] for e in reborn if e["step"] >= killed_at) - side.kill_time
        m["steps_lost"] = float(killed_at - resumed_from)
        committed_samples = sum(e["samples"] for log in side.logs.values() for e in log
                                if e["incarnation"] == 1 or e["step"] <= resumed_from)
        kept = [[e for e in log if e["incarnation"] == 1 or e["step"] <= resumed_from] for log in rank0.values()]
        useful_s = statistics.fmean(sum(e["end"] - e["start"] for e in log) for log in kept)
    else:
        durations = [e["end"] - e["start"] for log in survivors for e in log]
        m["stall_s"] = max(durations) - statistics.median(durations)
        m["recovery_s"] = first_back
        committed = [e["step"] for log in survivors for e in log if e["committed"]]
        m["steps_lost"] = float(len(committed) - len(set(committed)))
        m["steps_retried"] = float(sum(not e["committed"] for log in survivors for e in log))
        committed_samples = sum(e["samples"] for log in side.logs.values() for e in log if e["committed"])
        useful_s = statistics.fmean(sum(e["end"] - e["start"] for e in log if e["committed"]) for log in survivors)
        by_rank: dict[int, set[str]] = {}  # a group's ranks hold different shards: compare rank k with rank k
        for (_, rank), digest in side.hashes.items():
            by_rank.setdefault(rank, set()).add(digest)
        every_one = len(side.hashes) == len(side.logs)  # every process reached the end and said what it holds
        m["weights_identical"] = float(every_one and all(len(h) == 1 for h in by_rank.values()))
    clean_rate = sum(log[0]["samples"] for log in side.logs.values()) / clean_step_s
    m["steps"] = float(steps)
    m["step_time_s_failure_free"] = clean_step_s
    m["wall_s"] = wall
    m["effective_training_time_pct"] = 100 * useful_s / wall
    m["goodput"] = committed_samples / wall / clean_rate
    return {f"{prefix}{k}": v for k, v in m.items()}


def run_ft(cfg: CobenchConfig) -> BenchmarkResult:
    """The whole scenario as one benchmark run (see the module docstring)."""
    from harness.platform import discover_platform
    from harness.tracking import Tracker

    check_scenario(cfg)
    platform = discover_platform(cfg.platform)
    tracker = Tracker.connect(cfg.tracking, results_root(cfg)) if cfg.tracking.enabled else None
    name = f"{cfg.workload.name}_ft"
    run_dir = Path(new_run_dir(results_root(cfg), name))
    result = BenchmarkResult(name, cfg.workload.name, platform.name, STATUS_FINISHED, "samples/s", run_dir)
    open_run(cfg, result, platform, cfg.ft.replicas * cfg.ft.procs_per_replica, tracker,
             tags={"ft": cfg.ft.name, "ft_replicas": cfg.ft.replicas})
    lighthouse = None
    try:
        lighthouse = subprocess.Popen(
            [lighthouse_binary(), "--min_replicas", "1", "--bind", f"[::]:{cfg.ft.lighthouse_port}",
             "--quorum_tick_ms", str(cfg.ft.quorum_tick_ms), "--join_timeout_ms", str(cfg.ft.join_timeout_ms),
             "--heartbeat_timeout_ms", str(cfg.ft.heartbeat_timeout_ms)],
            stdout=(run_dir / "ft_lighthouse.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        skip = cfg.runner.warmup_steps
        result.metrics = scenario_metrics(run_side(cfg, run_dir, "torchft"), skip=skip)
        if cfg.ft.baseline:
            result.metrics |= scenario_metrics(run_side(cfg, run_dir, "baseline"), prefix="baseline_", skip=skip)
    except Exception as err:  # noqa: BLE001 - the run ends FAILED with the reason, the logs kept
        result.status, result.error = STATUS_FAILED, f"{type(err).__name__}: {err}"
        write_atomic(run_dir / "error.txt", traceback.format_exc())
    finally:
        if lighthouse is not None:
            lighthouse.terminate()
            lighthouse.wait(timeout=30)
    for path in run_dir.glob("ft_baseline_checkpoint_rank*.pt"):
        path.unlink()  # the baseline's restart points, not results
    shutil.rmtree(run_dir / SYNC_DIR, ignore_errors=True)  # the groups' words to each other, not results
    # like every run: a store that went away leaves the folder whole and marked for `cobench upload`
    write_and_publish(result, tracker, {"status": result.status, "error": result.error, "metrics": result.metrics,
                                        "losses": []})
    return result


if __name__ == "__main__":
    raise SystemExit(replica_main(sys.argv[1:]))
