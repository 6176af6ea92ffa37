"""How the replica groups agree through files in the run folder: when all have started (a barrier) and
after which step all stop together (a decision published once)."""

from __future__ import annotations

import os
import time
from pathlib import Path

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


def wait_for_all_groups(folder: Path, name: str, replica: int, replicas: int, timeout_s: float) -> None:
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
