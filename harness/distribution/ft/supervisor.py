"""The failure scenario's supervisor: starts torchft's lighthouse and each side's replica groups
(one ``torchrun`` of :mod:`harness.distribution.ft.replica` each), restarts the killed group after the delay, waits for
the end and logs both sides' figures as one benchmark run (:func:`run_ft`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

from harness.config import CobenchConfig, results_root
from harness.distribution.ft.checks import check_scenario
from harness.distribution.ft.group_sync import SYNC_DIR
from harness.distribution.ft.metrics import FailureRun, scenario_metrics
from harness.distribution.ft.processes import kill_tree, start_lighthouse
from harness.files import write_atomic
from harness.running.runner import (
    STATUS_FAILED,
    STATUS_FINISHED,
    BenchmarkResult,
    new_run_dir,
    open_run,
    write_and_publish,
)


def _read_logs(run_dir: Path, side: FailureRun) -> None:
    for path in run_dir.glob(f"ft_{side.name}_replica*_rank*.jsonl"):
        replica, rank = (int(x) for x in path.stem.removeprefix(f"ft_{side.name}_replica").split("_rank"))
        entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        side.logs[(replica, rank)] = [e for e in entries if "killed_at" not in e]
    for path in run_dir.glob(f"ft_{side.name}_replica*_rank*.final.json"):
        replica, rank = (int(x) for x in path.name.removeprefix(f"ft_{side.name}_replica")
                         .removesuffix(".final.json").split("_rank"))
        side.hashes[(replica, rank)] = json.loads(path.read_text())["hash"]


def _spawn(run_dir: Path, side: str, replica: int, incarnation: int, nprocs: int, lighthouse_port: int,
           out: Path) -> subprocess.Popen:
    # --standalone: the group's rendezvous store binds a free port itself (a port picked here could be taken first)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nprocs),
           "-m", "harness.distribution.ft.replica", "--run-dir", str(run_dir), "--side", side,
           "--replica", str(replica), "--incarnation", str(incarnation),
           "--lighthouse-port", str(lighthouse_port)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.Popen(cmd, stdout=out.open("a"), stderr=subprocess.STDOUT, env=env, cwd=os.getcwd(),
                            start_new_session=True)  # apart from ours: a Ctrl-C here is the launcher's to handle


def _kill_record(run_dir: Path, side: str, replica: int) -> float | None:
    """When the group killed itself (its rank 0's last log line), or None if it ended otherwise."""
    path = run_dir / f"ft_{side}_replica{replica}_rank0.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    last = json.loads(lines[-1]) if lines else {}
    return last.get("killed_at")


def log_excerpt(path: Path, lines: int = 30) -> str:
    """How a group ended, from its log: the end of the last Python traceback that is not torchrun's own (the
    rank's error, which torchrun's report after it pushes out of sight), else the log's last lines; at most
    ``lines``."""
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    starts = [i for i, line in enumerate(text) if line.startswith("Traceback (most recent call last)")]
    blocks = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)][:len(starts)], strict=True)]
    ranks = [b for b in blocks if not any("torch/distributed/run.py" in line for line in b)]
    if not ranks:
        return "\n".join(text[-lines:])
    block = ranks[-1]
    end = next((i for i, line in enumerate(block) if i and line and not line[0].isspace()), len(block) - 1)
    # ^ its exception's line: the first after the frames (indented) that is not indented
    return "\n".join(block[max(0, end + 1 - lines):end + 1])


def _group_failed(message: str, log: Path) -> RuntimeError:
    return RuntimeError(f"{message}; see {log}\n{log_excerpt(log)}")


def _kill(proc: subprocess.Popen) -> None:
    kill_tree(proc.pid)
    proc.wait()


def run_side(cfg: CobenchConfig, run_dir: Path, side: str, lighthouse_port: int) -> FailureRun:
    """Start the side's groups, kill one at the step, restart it after the delay, wait for the end."""
    ft = cfg.ft
    groups = ft.replicas if side == "torchft" else 1
    nprocs = ft.procs_per_replica if side == "torchft" else ft.replicas * ft.procs_per_replica
    victim = ft.kill_replica if side == "torchft" else 0
    result = FailureRun(side)
    procs = {r: _spawn(run_dir, side, r, 0, nprocs, lighthouse_port, run_dir / f"ft_{side}_replica{r}.log")
             for r in range(groups)}
    deadline = time.monotonic() + ft.timeout_s
    try:
        try:  # the victim kills itself at the step (harness.distribution.ft.replica): exact, however short the steps
            procs[victim].wait(timeout=ft.timeout_s)
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"{side}: step {ft.kill_at_step} not reached within "
                               f"ft.timeout_s={ft.timeout_s}") from err
        killed = _kill_record(run_dir, side, victim)
        if killed is None:
            raise _group_failed(f"{side}: replica group {victim} ended (exit {procs[victim].returncode}) before "
                                f"step {ft.kill_at_step}", run_dir / f"ft_{side}_replica{victim}.log")
        result.kill_time = killed
        time.sleep(ft.restart_delay_s)
        result.restart_time = time.time()
        procs[victim] = _spawn(run_dir, side, victim, 1, nprocs, lighthouse_port,
                               run_dir / f"ft_{side}_replica{victim}.log")
        for replica, proc in procs.items():
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as err:
                raise RuntimeError(f"{side}: replica group {replica} still running after ft.timeout_s={ft.timeout_s}"
                                   ) from err
            if code != 0:
                raise _group_failed(f"{side}: replica group {replica} failed (exit {code})",
                                    run_dir / f"ft_{side}_replica{replica}.log")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                _kill(proc)
    _read_logs(run_dir, result)
    return result


def run_ft(cfg: CobenchConfig) -> BenchmarkResult:
    """The whole scenario as one benchmark run (see :mod:`harness.distribution.ft`)."""
    from harness.platform import discover_platform
    from harness.recording.tracking import Tracker

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
        lighthouse, port = start_lighthouse(cfg.ft, run_dir / "ft_lighthouse.log")
        skip = cfg.runner.warmup_steps
        result.metrics = scenario_metrics(run_side(cfg, run_dir, "torchft", port), skip=skip)
        if cfg.ft.baseline:
            result.metrics |= scenario_metrics(run_side(cfg, run_dir, "baseline", port), prefix="baseline_",
                                               skip=skip)
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
