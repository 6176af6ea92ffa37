"""How the tests share the machine when pytest-xdist runs them on two workers (`nox -s tests`: `pytest -n 2
--dist loadgroup`). Each worker is a test session of its own, with its own session fixtures; groups keep
apart what must not run twice or beside another test. They are set here from what a test uses or is marked
with, not by hand in each file:

- ``clusters``: every file with a test on the scratch PostgreSQL cluster (``postgres_uri`` and the servers made
  on it) or on the SLURM cluster (``slurm_cluster``) runs on one worker, so each cluster starts once. Two SLURM
  clusters must never run at once: their daemons run as root under this host's one node name, each offering
  every CPU to its jobs. Two PostgreSQL clusters could (free ports, folders of their own), but the SLURM suite
  writes into the PostgreSQL one, and one start of it and of the team's server is enough.
- every other file is a group of its own, so a file's tests run on one worker and its module-scoped fixtures
  (a suite run all its tests read, a recorded golden) are made once, as serially.
- ``alone`` (``@pytest.mark.alone``): tests whose verdict rests on wall-clock time on a quiet CPU (LoadGen's
  Server latency bounds, a measured host gap, a timed sleep), and those that run a process on every core (its
  OpenMP threads and the other worker's wait on each other: a llama replay on 2 threads took 154 s in CI
  beside the other worker, 39 s alone). A group would still run beside the other
  worker's tests, so the two workers share a lock: every other test holds it shared, these hold it
  exclusively, and the other worker waits for its current test to end. Two in a row keep the lock.

- threads: each worker, and every process it starts, gets its share of the cores as its intra-op threads
  (``OMP_NUM_THREADS``: 1 each for 2 workers on 2 cores). Two torch processes each spinning 2 OpenMP threads on
  2 cores wait on each other's threads: GPT-2's zoo step took 560-760 ms side by side that way, 13 ms with one
  thread each. A variable already set is kept.

Run serially (`pytest -n 0`, `-p no:xdist`, or no `-n`), none of this applies.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path
from typing import IO

import pytest

CLUSTER_FIXTURES = ("postgres_uri", "slurm_cluster")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: its verdict needs a quiet CPU, or it runs on every core; no other "
                                       "test runs beside it (tests/worker_groups.py)")
    config.addinivalue_line("markers", "xdist_group(name): tests that pytest-xdist's loadgroup runs on one worker")
    if hasattr(config, "workerinput"):  # an xdist worker: its share of the cores, for it and what it starts
        share = max(1, (os.cpu_count() or 1) // int(config.workerinput.get("workercount", 1)))
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test runs on the worker of its file (a module-scoped fixture, such as a suite run the file's tests
    all read, is made once), and a file with any test on the clusters runs wholly in the ``clusters`` group."""
    on_clusters = {item.path for item in items if any(name in item.fixturenames for name in CLUSTER_FIXTURES)}
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            group = "clusters" if item.path in on_clusters else item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(group))


_UNGROUPED = pytest.StashKey[bool]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """xdist tells its scheduler a test's group by a suffix on its node id; where that fails (pytest-xdist 3.8 on
    pytest 9.2: https://github.com/pytest-dev/pytest-xdist/issues/1386) the groups would be spread over both
    workers in silence. Their tests fail instead, saying why."""
    config = session.config
    if hasattr(config, "workerinput") and config.getvalue("loadgroup"):
        for item in session.items:
            item.stash[_UNGROUPED] = item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid


@pytest.hookimpl(tryfirst=True)  # before any fixture: a cluster must not start twice
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.stash.get(_UNGROUPED, False):
        pytest.fail("pytest-xdist did not put this test in its xdist_group, so --dist loadgroup cannot keep the "
                    "group on one worker: install the versions pyproject.toml's test extra asks for, or run the "
                    "tests serially (-n 0)", pytrace=False)


class QuietLock:
    """A readers-writer lock between the run's workers on two flock(2) files in the folder they share.
    ``gate``, taken by every test on its way in, is held by an ``alone`` test while it waits for the
    ``room``, so the other worker cannot keep the room busy test after test."""

    def __init__(self, folder: Path, run: str):
        self.gate: IO[str] = (folder / f"quiet-gate-{run}.lock").open("a")
        self.room: IO[str] = (folder / f"quiet-room-{run}.lock").open("a")
        self.exclusive = False

    def enter(self, alone: bool) -> None:
        if self.exclusive:  # the previous test was alone too: the room is still ours
            return
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        if alone:
            fcntl.flock(self.room, fcntl.LOCK_EX)
            self.exclusive = True
        else:
            fcntl.flock(self.room, fcntl.LOCK_SH)
            fcntl.flock(self.gate, fcntl.LOCK_UN)

    def leave(self) -> None:
        fcntl.flock(self.room, fcntl.LOCK_UN)
        if self.exclusive:
            fcntl.flock(self.gate, fcntl.LOCK_UN)
            self.exclusive = False


_QUIET_LOCK = pytest.StashKey[QuietLock]()


def _is_alone(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Setup, call and teardown (session fixtures' too) inside the lock, on an xdist worker only."""
    config = item.config
    if not hasattr(config, "workerinput"):
        return (yield)
    if _QUIET_LOCK not in config.stash:
        # xdist gives each worker the basetemp <run's basetemp>/popen-<worker>: the parent is the run's, shared
        basetemp = config.option.basetemp
        folder = Path(basetemp).parent if basetemp else Path(tempfile.gettempdir())
        config.stash[_QUIET_LOCK] = QuietLock(folder, config.workerinput["testrunuid"])
    lock = config.stash[_QUIET_LOCK]
    lock.enter(_is_alone(item))
    try:
        return (yield)
    finally:
        if not (_is_alone(item) and _is_alone(nextitem)):
            lock.leave()
