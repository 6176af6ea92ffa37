"""One truth when something dies: the MLflow store, the run folder and the message agree.

A rank killed mid-run leaves a FAILED run naming it (not RUNNING forever); a signal while a run is
being closed waits until it is closed; an interrupt before any run exists says so; a run left
RUNNING by a process that is gone is closed FAILED by the next connection and by `cobench reap`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import clean_env, mlflow_runs

from harness.config import TrackingConfig
from harness.distributed import PeerWatch, lost_ranks_settled, process_started, record_rank
from harness.recording.tracking import HOST_TAG, PID_STARTED_TAG, PID_TAG, Tracker
from harness.running.interrupts import deferred_interrupts, sigterm_as_interrupt


@pytest.mark.parametrize("how", ["kill_rank1", "kill_rank1_then_sigterm_rank0", "sigterm_both"])
def test_a_rank_killed_mid_run_leaves_a_failed_run_that_names_it(tmp_path, calibration_cache, how):
    """rank 1 SIGKILLed: rank 0 either sees its collective fail or is stopped by torchrun's SIGTERM
    first; FAILED, naming rank 1, both ways. Both ranks stopped by a scheduler's SIGTERM: KILLED."""
    results = tmp_path / "results"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        "-m", "suite.cli", "run", f"results_dir={results}", f"platform.calibration_cache={calibration_cache}",
        "runner.warmup_steps=1", "runner.steps=100000", "runner.progress=false", "workload.train_batches=2",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                            cwd=tmp_path)
    try:
        deadline, victim = time.monotonic() + 240, None
        while time.monotonic() < deadline and proc.poll() is None:
            runs = list((results / "runs").glob("*")) if (results / "runs").exists() else []
            log = runs[0] / "mllog_rep0.txt" if runs else None
            if log is not None and log.exists() and "block_start" in log.read_text():
                victim = json.loads((runs[0] / "ranks" / "rank1.json").read_text())["pid"]
                survivor = json.loads((runs[0] / "ranks" / "rank0.json").read_text())["pid"]
                break
            time.sleep(0.2)
        assert victim is not None, "the run never reached its timed steps"
        time.sleep(1.0)
        if how == "sigterm_both":
            os.kill(victim, signal.SIGTERM)
            os.kill(survivor, signal.SIGTERM)
        else:
            os.kill(victim, signal.SIGKILL)
            if how == "kill_rank1_then_sigterm_rank0":
                os.kill(survivor, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    (run,) = mlflow_runs(results)
    if how == "sigterm_both":
        assert run.info.status == "KILLED" and run.data.tags["error"] == "interrupted by SIGTERM", stderr[-8000:]
        return
    assert run.info.status == "FAILED", stderr[-8000:]  # the ranks' words before torchrun's report
    assert f"rank 1 (pid {victim}" in run.data.tags["error"] and "died" in run.data.tags["error"]
    assert run.info.end_time is not None
    folder = json.loads(next((results / "runs").glob("*/metrics.json")).read_text())
    assert folder["status"] == "FAILED" and folder["error"] == run.data.tags["error"]


def _a_peer_that_dies(work_dir):
    """A real process recorded as rank 1 of a run in ``work_dir``, this process as rank 0; kill() ends it."""
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    record_rank(work_dir, 0)
    time.sleep(0.2)  # the peer's start time is readable
    record = json.loads((work_dir / "ranks" / "rank0.json").read_text())
    record.update(rank=1, pid=peer.pid, started=process_started(peer.pid))
    (work_dir / "ranks" / "rank1.json").write_text(json.dumps(record))
    return peer


def test_a_main_rank_stuck_when_its_peer_dies_closes_the_run_from_its_watch(tmp_path):
    """The main thread stays inside its step (as in a collective that never hears of the death): the watch
    closes the run FAILED naming the dead rank, writes every thread's stack, ends the process; the main thread
    coming back later does not close it again."""
    peer = _a_peer_that_dies(tmp_path)
    closed, exits = [], []
    watch = PeerWatch(tmp_path, closed.append, grace_s=1.0, interval_s=0.1, exit=exits.append).start()
    try:
        time.sleep(0.5)
        assert not closed  # a live peer: nothing to do
        peer.kill()
        peer.wait()
        deadline = time.monotonic() + 30
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)  # the main thread, stuck
    finally:
        watch.stop()
        peer.kill()
    assert exits == [1] and len(closed) == 1
    assert f"rank 1 (pid {peer.pid}" in closed[0] and "died" in closed[0] and "still inside a step" in closed[0]
    error = (tmp_path / "error.txt").read_text()
    assert error.startswith(closed[0]) and "thread MainThread" in error and "time.sleep(0.05)" in error
    assert not watch.claim()


def test_a_main_rank_that_closes_its_run_first_is_left_to_close_it_and_told_where_it_stalls(tmp_path, caplog):
    """The main thread began closing before the watch acted: the watch does not close the run, only writes
    where each thread is should the closing stall."""
    peer = _a_peer_that_dies(tmp_path)
    closed, exits = [], []
    watch = PeerWatch(tmp_path, closed.append, grace_s=0.2, interval_s=0.05, exit=exits.append).start()
    try:
        assert watch.claim()
        peer.kill()
        peer.wait()
        time.sleep(1.0)  # the closing, stalled
    finally:
        watch.stop()
        peer.kill()
    assert closed == [] and exits == []
    assert "closing the run has taken 0.4 s; where each thread is" in caplog.text and "thread MainThread" in caplog.text


def test_a_peer_still_dying_when_this_rank_sees_its_collective_fail_is_named(tmp_path):
    """A killed peer's sockets close before the kernel has finished ending it: the failed collective is seen
    while the peer still looks alive, and the look at the peers waits for it (not for a live, healthy peer)."""
    peer = _a_peer_that_dies(tmp_path)
    try:
        threading.Timer(0.5, peer.kill).start()
        started = time.monotonic()
        lost = lost_ranks_settled(tmp_path, grace_s=10.0)
        waited = time.monotonic() - started
    finally:
        peer.kill()
        peer.wait()
    assert lost == [f"rank 1 (pid {peer.pid} on {socket.gethostname()})"] and 0.4 < waited < 5.0
    second = _a_peer_that_dies(tmp_path / "healthy")
    try:
        started = time.monotonic()
        assert lost_ranks_settled(tmp_path / "healthy", grace_s=0.5) == []  # alive throughout: nobody named
        assert time.monotonic() - started >= 0.5
    finally:
        second.kill()
        second.wait()


def test_a_signal_while_closing_waits_until_the_records_are_closed():
    previous = signal.getsignal(signal.SIGTERM)
    sigterm_as_interrupt()
    done = []
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            with deferred_interrupts():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                done.append("closed")  # not cut short by the signal
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert done == ["closed"]


def _store(tmp_path) -> Tracker:
    return Tracker.connect(TrackingConfig(), tmp_path)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_run_left_running_by_a_dead_process_is_closed_failed(tmp_path):
    tracker = _store(tmp_path)
    stale = tracker.start_run("orphan", {})
    tracker.set_tags(stale, {PID_TAG: str(_dead_pid()), PID_STARTED_TAG: "1"})
    alive = tracker.start_run("mine", {})  # this process: alive, left alone
    elsewhere = tracker.start_run("remote", {})
    tracker.set_tags(elsewhere, {HOST_TAG: "another-host", PID_TAG: "1"})

    _store(tmp_path)  # the next cobench connection to the store reaps
    runs = {r.info.run_name: r for r in mlflow_runs(tmp_path)}
    assert runs["orphan"].info.status == "FAILED"
    assert "ended without closing this run" in runs["orphan"].data.tags["error"]
    assert runs["mine"].info.status == "RUNNING" and runs["remote"].info.status == "RUNNING"

    proc = subprocess.run([sys.executable, "-m", "suite.cli", "reap", f"results_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    assert f"still RUNNING: remote ({elsewhere}) on another-host, pid 1" in proc.stdout
    assert "mine" in proc.stdout  # this test's process is alive: listed, not closed
    tracker.end_run(alive, "FINISHED")
    tracker.end_run(elsewhere, "FINISHED")


def test_an_interrupt_says_which_runs_it_closed_and_when_there_were_none(tmp_path, capsys):
    from suite.cli import guarded

    def interrupted_before_any_run(_args):
        raise KeyboardInterrupt

    assert guarded("run", interrupted_before_any_run, []) == 130
    assert "interrupted by Ctrl-C (SIGINT); no MLflow run had been started" in capsys.readouterr().err

    def interrupted_while_starting(_args):
        tracker = _store(tmp_path)
        tracker.start_run("starting", {})
        raise KeyboardInterrupt("SIGTERM")  # e.g. between creating the run and logging its params

    assert guarded("run", interrupted_while_starting, []) == 130
    assert "interrupted by SIGTERM; MLflow runs: starting KILLED" in capsys.readouterr().err
    (run,) = [r for r in mlflow_runs(tmp_path) if r.info.run_name == "starting"]
    assert run.info.status == "KILLED" and run.data.tags["error"] == "interrupted by SIGTERM"


def test_processes_racing_to_create_the_experiment_all_get_it(tmp_path):
    """Eight runs starting at once against one server: the losers of the race to create the
    experiment take the winner's instead of failing with RESOURCE_ALREADY_EXISTS."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    winner = MlflowClient(tracking_uri=uri).create_experiment("fleet")

    class LateClient(MlflowClient):  # looked before the winner created it, creates after
        looked = False

        def get_experiment_by_name(self, name):
            if not self.looked:
                self.looked = True
                return None
            return super().get_experiment_by_name(name)

    assert Tracker._experiment_id(LateClient(tracking_uri=uri), "fleet", None) == winner
