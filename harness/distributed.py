"""torch.distributed set-up from the ``torchrun`` environment, and gathering results to rank 0."""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from harness.files import write_atomic

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def node_count() -> int:
    """Nodes of this launch: torchrun's agents (``GROUP_WORLD_SIZE``), else world ÷ local world."""
    if os.environ.get("GROUP_WORLD_SIZE"):
        return int(os.environ["GROUP_WORLD_SIZE"])
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    return max(1, world // local) if local else 1


def adopt_slurm_tasks() -> bool:
    """Under a SLURM job step of several tasks (``srun``, e.g. Hydra's submitit launcher with
    ``hydra.launcher.tasks_per_node=2``) and no torchrun: export the ``RANK``/``WORLD_SIZE``/
    ``MASTER_ADDR``/... that torchrun would have set, from SLURM's variables (submitit's own mapping),
    so that the rest of the harness sees one launch either way. True when it did."""
    if int(os.environ.get("SLURM_NTASKS", "1")) <= 1 or "WORLD_SIZE" in os.environ:
        return False
    from submitit.helpers import TorchDistributedEnvironment  # installed with hydra-submitit-launcher

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    os.environ.setdefault("GROUP_WORLD_SIZE", os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    return True


def env_dist_info() -> DistInfo:
    """What torchrun told this process (a single process when it did not)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return DistInfo(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=world_size,
    )


def default_backend(device: torch.device) -> str:
    """The collective library of ``device``'s vendor: NCCL on CUDA (ROCm's torch maps it to RCCL), oneCCL on
    XPU, HCCL on Intel Gaudi (HPU; registered by its bridge, ``habana_frameworks.torch``), gloo on the CPU and
    anything else. A collective on a CPU tensor needs gloo: with nccl, keep such tensors on the device."""
    return {"cuda": "nccl", "xpu": "xccl", "hpu": "hccl"}.get(device.type, "gloo")


def init_distributed(device: torch.device, backend: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Join the process group torchrun set up; a no-op for a single process."""
    info = env_dist_info()
    if not info.enabled:
        return info
    chosen = default_backend(device) if backend == "auto" else backend
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": chosen, "timeout": timedelta(seconds=timeout_s)}
        if device.type != "cpu":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    return DistInfo(info.rank, info.local_rank, info.world_size, chosen)


def shutdown_distributed() -> None:
    """Destroy the process group, then collect what still holds it (a sharded model's reference cycles) while
    the interpreter is whole: a gloo group freed during interpreter teardown can abort the process
    ("terminate called without an active exception") after its work is done."""
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()


def exit_rank(code: int) -> NoReturn:
    """End a process launched under torchrun (a probe's rank, a failure scenario's) once its work is written and
    said: flush, leave the process group, and skip the interpreter's teardown. Even with the group destroyed first,
    a probe's rank that had finished everything aborted in that teardown (SIGABRT, "terminate called without an
    active exception", no Python frame left) in 2 of 46 launches on a loaded 2-core host, and torchrun then failed
    the launch; the failure scenario's plain job, ending through it, in 2 of 12 scenarios beside a busy process."""
    sys.stdout.flush()
    sys.stderr.flush()
    shutdown_distributed()
    os._exit(code)


def gather_to_all(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable, produced by our own code), in rank order."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_from_main(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (e.g. a validation error, so all ranks stop together)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def process_started(pid: int) -> float | None:
    """When process ``pid`` of this host started (epoch seconds); None when there is no such process
    (or only its zombie is left); 0.0 when it exists but its start time is not readable."""
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:  # killed; its parent has not collected it yet
            return None
        return process.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return 0.0


def record_rank(work_dir: Path, rank: int) -> None:
    """Note which process on which host is this rank (``<work_dir>/ranks/rank<r>.json``), so a
    failure can say which rank died."""
    folder = work_dir / "ranks"
    folder.mkdir(parents=True, exist_ok=True)
    me = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "started": process_started(os.getpid())}
    write_atomic(folder / f"rank{rank}.json", json.dumps(me))  # peers read it when a rank is lost


def record_rank_exit(work_dir: Path, rank: int, how: str) -> None:
    """Note that this rank is leaving on purpose (a signal it handled), so that no other rank reports
    it as died (``<work_dir>/ranks/rank<r>.exit``)."""
    folder = work_dir / "ranks"
    if folder.is_dir():
        write_atomic(folder / f"rank{rank}.exit", how)


def lost_ranks_settled(work_dir: Path, grace_s: float = 2.0) -> list[str]:
    """:func:`lost_ranks`, for a rank whose run is ending because something outside it happened: stopped by a
    signal (torchrun, or a user, signals the survivors right after a kill), or its collective failed (the
    killed peer's sockets close while the kernel is still ending it, before it is a zombie). A peer killed a
    moment earlier may still be dying, so wait up to ``grace_s`` until each other rank of this host has either
    left saying so (its ``.exit``) or is gone."""
    deadline = time.monotonic() + grace_s
    while True:
        lost = lost_ranks(work_dir)
        if lost or time.monotonic() >= deadline:
            return lost
        host, waiting = socket.gethostname(), False
        for path in (work_dir / "ranks").glob("rank*.json"):
            try:
                rank = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if rank.get("host") == host and rank.get("pid") != os.getpid() and not path.with_suffix(".exit").exists():
                waiting = True
        if not waiting:
            return []
        time.sleep(0.1)


def lost_ranks(work_dir: Path) -> list[str]:
    """Ranks of this host whose process is gone without saying it was leaving, e.g. ``rank 1 (pid
    4242 on node3)``: killed, crashed. Other hosts' ranks cannot be checked from here."""
    host, lost = socket.gethostname(), []
    for path in sorted((work_dir / "ranks").glob("rank*.json")):
        if path.with_suffix(".exit").exists():
            continue
        try:
            rank = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if rank.get("host") != host or rank.get("pid") == os.getpid():
            continue
        started = process_started(int(rank["pid"]))
        if started is None or (rank.get("started") and started > float(rank["started"]) + 1.0):
            lost.append(f"rank {rank['rank']} (pid {rank['pid']} on {host})")
    return lost


class PeerWatch:
    """The main rank's watch over a run under way: when another rank of this host is gone without saying so
    (:func:`lost_ranks`) and this rank has not begun to close the run ``grace_s`` later, the run is closed from
    the watch's thread (``close(reason)``: FAILED, naming the rank), every thread's stack written to stderr and to
    the run folder's ``error.txt`` first, and the process ended (``exit``).

    A rank whose peer died sees its collective fail and closes the run itself; but its main thread may be stuck
    where no Python runs — a collective that never hears of the death, a long computation — and then torchrun's
    SIGTERM waits for it, torchrun's SIGKILL follows 30 s later, and the run would stay RUNNING for ever. The main
    thread calls :meth:`claim` before it closes the run: the run is closed once, by one of the two.
    """

    def __init__(self, work_dir: Path, close: Callable[[str], None], grace_s: float = 10.0, interval_s: float = 1.0,
                 exit: Callable[[int], None] = os._exit):  # noqa: A002 - the process's exit, replaceable in tests
        self.work_dir, self.grace_s, self.interval_s = work_dir, grace_s, interval_s
        self._close, self._exit = close, exit
        self._lock, self._stop, self._done = threading.Lock(), threading.Event(), threading.Event()
        self._claimed_at: float | None = None  # when the main thread began to close the run
        self._closing = False  # the watch is closing it
        self._thread = threading.Thread(target=self._watch, name="cobench-peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def claim(self) -> bool:
        """The main thread is about to close the run: True, and the watch only looks on (should the closing
        itself stall for ``2 × grace_s``, it writes every thread's stack to stderr, once); False once the watch
        has closed the run (it then ends the process: this returns only where ``exit`` does)."""
        with self._lock:
            if not self._closing:
                self._claimed_at = time.monotonic()
                return True
        self._done.wait()
        return False

    def _watch(self) -> None:
        lost_since: float | None = None
        while not self._stop.wait(self.interval_s):
            if self._claimed_at is not None:
                if time.monotonic() - self._claimed_at > 2 * self.grace_s:
                    logger.warning("closing the run has taken %g s; where each thread is:\n%s", 2 * self.grace_s,
                                   thread_stacks())
                    return
                continue
            lost = lost_ranks(self.work_dir)
            if not lost:
                lost_since = None
                continue
            lost_since = lost_since if lost_since is not None else time.monotonic()
            if time.monotonic() - lost_since < self.grace_s:
                continue
            with self._lock:
                if self._claimed_at is not None or self._stop.is_set():
                    return
                self._closing = True
            reason = (f"{', '.join(lost)} died (no longer running) during the run; this rank was still inside a step "
                      f"{self.grace_s:.0f} s later (its threads' stacks are on stderr), so its run was closed from "
                      "its watch")
            logger.error("%s", reason)
            stacks = thread_stacks()
            print(stacks, file=sys.stderr, flush=True)
            write_atomic(self.work_dir / "error.txt", f"{reason}\n\n{stacks}")
            try:
                self._close(reason)
            except Exception:  # noqa: BLE001 - the process ends either way; say why the records may be incomplete
                logger.exception("closing the run after a peer died failed")
            finally:
                self._done.set()
                self._exit(1)
            return


def thread_stacks() -> str:
    """Every thread's Python stack, where each is now (a thread inside a C++ call: the call it is in)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
                     for ident, frame in sys._current_frames().items())
