"""ft=torchft: the failure scenario's checks, its metric definitions, and the real thing (lighthouse, two
replica groups under torchrun, a SIGKILL, a restart that heals from its peer, the baseline beside it)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from conftest import clean_env, mlflow_runs

from harness.config import compose_config, to_run_config
from harness.distribution.ft.checks import check_scenario
from harness.distribution.ft.metrics import FailureRun, scenario_metrics
from harness.distribution.ft.processes import port_is_free


def _cfg(*overrides: str):
    return to_run_config(compose_config(["workload=llama", "ft=torchft", *overrides]))


def test_bad_scenarios_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match=r"3 replica groups × 1 process\(es\) = 3 processes, but only 2 are available"):
        check_scenario(_cfg("ft.replicas=3", "ft.max_processes=2"))
    with pytest.raises(ValueError, match=r"'ft.kill_at_step': 700 is beyond the run: it has 603 steps"):
        check_scenario(_cfg("ft.kill_at_step=700"))
    with pytest.raises(ValueError, match="'ft.checkpoint_interval': 30 >= ft.kill_at_step"):
        check_scenario(_cfg("ft.checkpoint_interval=30"))
    with pytest.raises(ValueError, match="ft.replicas.*must be >= 2"):
        _cfg("ft.replicas=1")
    with socket.socket(socket.AF_INET6) as busy:
        busy.bind(("::", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} is in use.*pass a free one"):
            check_scenario(_cfg(f"ft.lighthouse_port={port}"))


def test_a_bad_scenario_exits_2_and_leaves_no_run(cobench, tmp_path):
    proc = cobench("run", "workload=llama", "ft=torchft", "ft.kill_at_step=5000", "runner.progress=false")
    assert proc.returncode == 2
    assert "ft.kill_at_step" in proc.stderr and "beyond the run" in proc.stderr
    assert mlflow_runs(tmp_path / "results") == []


def _attempt(step, start, seconds, committed=True, participants=2, incarnation=0, samples=8):
    return {"step": step, "start": start, "end": start + seconds, "committed": committed,
            "participants": participants, "incarnation": incarnation, "samples": samples}


def test_metric_definitions_on_a_known_timeline():
    """Replica 1 dies at t=10 after step 10; replica 0 waits 1 s for the quorum, trains alone, and replica 1
    is back (healed) at step 30, t=14.1."""
    survivor = [_attempt(s, 0.1 * (s - 1), 0.1) for s in range(1, 11)]  # steps 1-10, t 0-1
    survivor += [_attempt(10, 10.0, 1.0, committed=False, participants=1)]  # the failed step + quorum wait
    survivor += [_attempt(s, 11.0 + 0.1 * (s - 11), 0.1, participants=1) for s in range(11, 31)]
    survivor += [_attempt(s, 13.0 + 0.1 * (s - 31), 0.1) for s in range(31, 41)]
    for entry in survivor[:10]:
        entry["start"] += 9.0  # steps 1-10 run from t=9 to t=10
        entry["end"] += 9.0
    victim = [dict(e) for e in survivor[:10]]
    victim += [_attempt(s, 13.0 + 0.1 * (s - 31), 0.1, incarnation=1) for s in range(31, 41)]
    side = FailureRun("torchft", kill_time=10.0, logs={(0, 0): survivor, (1, 0): victim},
                      hashes={(0, 0): "abc", (1, 0): "abc"})
    m = scenario_metrics(side)
    assert m["stall_s"] == pytest.approx(0.9)  # the longest step (1 s) beyond the median (0.1 s)
    assert m["recovery_s"] == pytest.approx(3.1)  # kill → the restarted group's first committed step ends
    assert m["steps_lost"] == 0 and m["steps_retried"] == 1 and m["steps"] == 40
    assert m["wall_s"] == pytest.approx(5.0)  # t 9 → 14
    assert m["effective_training_time_pct"] == pytest.approx(100 * 4.0 / 5.0)  # 1 s of 5 lost
    # each group's time in committed steps over the 5 s, weighted by its 8 samples a step: the survivor's 4 s,
    # the restarted group's 2 s (its 3 s away are lost)
    assert m["goodput"] == pytest.approx((8 * 4.0 + 8 * 2.0) / (16 * 5.0))
    assert m["goodput"] < m["effective_training_time_pct"] / 100  # the survivors' view misses the absent group
    assert m["weights_identical"] == 1.0
    side.hashes[(1, 0)] = "abd"
    assert scenario_metrics(side)["weights_identical"] == 0.0


def test_goodput_stays_below_1_when_the_survivor_steps_faster_alone():
    """On a shared CPU the survivor, its peer's cores free, trains 5x faster alone (0.02 s steps) while the
    other group is away: 100 steps from t=11 to 13 where the failure-free job would have made 20. Committed
    samples per second would read 1.4 of the failure-free rate; the time share stays what was kept."""
    survivor = [_attempt(s, 9.0 + 0.1 * (s - 1), 0.1) for s in range(1, 11)]
    survivor += [_attempt(10, 10.0, 1.0, committed=False, participants=1)]
    survivor += [_attempt(s, 11.0 + 0.02 * (s - 11), 0.02, participants=1) for s in range(11, 111)]
    survivor += [_attempt(s, 13.0 + 0.1 * (s - 111), 0.1) for s in range(111, 121)]
    victim = [dict(e) for e in survivor[:10]]
    victim += [_attempt(s, 13.0 + 0.1 * (s - 111), 0.1, incarnation=1) for s in range(111, 121)]
    m = scenario_metrics(FailureRun("torchft", kill_time=10.0, logs={(0, 0): survivor, (1, 0): victim},
                                    hashes={(0, 0): "abc", (1, 0): "abc"}))
    rate_based = sum(e["samples"] for e in survivor + victim if e["committed"]) / 5.0 / (2 * 8 / 0.1)
    assert rate_based == pytest.approx(1.4)
    assert m["goodput"] == pytest.approx((8 * 4.0 + 8 * 2.0) / (16 * 5.0))
    assert m["step_time_s_failure_free"] == pytest.approx(0.1)  # the steps with both groups


@pytest.mark.slow
def test_replica_killed_restarted_and_healed_beside_a_whole_job_restart(tmp_path, calibration_cache):
    pytest.importorskip("torchft")
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "suite.cli", "run", "workload=llama", "ft=torchft", "ft.replicas=2",
           "ft.kill_at_step=20", "runner.steps=300", "runner.progress=false",
           "ft.restart_delay_s=1", f"results_dir={results}", f"platform.calibration_cache={calibration_cache}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = mlflow_runs(results)
    assert run.info.status == "FINISHED" and run.data.tags["ft"] == "torchft"
    m = run.data.metrics
    assert m["weights_identical"] == 1.0  # healed from its peer: the same weights, bit for bit
    assert m["steps_lost"] == 0 and m["steps"] >= 303
    assert 0.5 < m["stall_s"] < 10  # the survivor waits ~ the 1 s heartbeat timeout, once
    assert m["recovery_s"] > 1.0  # the restart delay, then a process start and the heal
    assert 0 < m["goodput"] < 1 and 0 < m["effective_training_time_pct"] <= 100
    assert m["baseline_steps_lost"] == 4  # killed after step 20, restarted from the checkpoint of step 16
    assert m["baseline_recovery_s"] >= m["baseline_restart_s"] > 1.0
    assert m["effective_training_time_pct"] > m["baseline_effective_training_time_pct"]
    run_dir = next((results / "runs").iterdir())
    assert (run_dir / "ft_lighthouse.log").stat().st_size > 0
    assert not list(run_dir.glob("*.pt"))  # the baseline's checkpoints are not results

    from suite.ft_scale import ScaleInputs, measured_inputs  # the scale model reads what was measured here

    inputs = measured_inputs(ScaleInputs(), [run_dir / "metrics.json"])
    recorded = json.loads((run_dir / "metrics.json").read_text())["metrics"]
    assert inputs.stall_ft_s == recorded["stall_s"] and inputs.stall_sync_s == recorded["baseline_restart_s"]


@pytest.mark.slow
def test_fsdp2_inside_each_group_heals_every_shard(tmp_path, calibration_cache):
    """Two groups of two ranks (FSDP2 inside a group, torchft across): the restarted group's ranks each heal
    their own shard from their counterpart, and every shard ends equal to its counterpart's."""
    pytest.importorskip("torchft")
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "suite.cli", "run", "workload=llama", "ft=torchft", "ft.replicas=2",
           "ft.procs_per_replica=2", "ft.max_processes=4", "ft.kill_at_step=20", "runner.steps=200",
           "ft.baseline=false", "ft.restart_delay_s=1", "runner.progress=false",
           f"results_dir={results}", f"platform.calibration_cache={calibration_cache}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = mlflow_runs(results)
    m = run.data.metrics
    assert m["weights_identical"] == 1.0 and m["steps_lost"] == 0
    run_dir = next((results / "runs").iterdir())
    finals = sorted(p.name for p in run_dir.glob("ft_torchft_replica*_rank*.final.json"))
    assert len(finals) == 4  # both groups' two ranks reached the end


def test_a_failed_groups_error_carries_its_ranks_exception_not_torchruns_report(tmp_path):
    from harness.distribution.ft.supervisor import log_excerpt

    rank = ("Traceback (most recent call last):\n" + '  File "replica.py", line 9, in train\n    step()\n' * 20
            + "TimeoutError: quorum timed out\n")
    torchrun = ("E1130 failed (exitcode: 1) local_rank: 0\nTraceback (most recent call last):\n"
                '  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032\n'
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n" + "=" * 60 + "\n"
                + "  traceback : To enable traceback see: ...\n" * 20)
    log = tmp_path / "ft_torchft_replica1.log"
    log.write_text("[INFO] quorum\n" * 50 + rank + "[INFO] should_commit\n" * 5 + torchrun)
    excerpt = log_excerpt(log).splitlines()
    assert excerpt[-1] == "TimeoutError: quorum timed out" and len(excerpt) == 30  # the innermost frames
    assert log_excerpt(log, lines=100).splitlines()[0] == "Traceback (most recent call last):"
    log.write_text("".join(f"line {i}\n" for i in range(100)))  # no traceback: its last lines
    assert log_excerpt(log).splitlines() == [f"line {i}" for i in range(70, 100)]
    assert log_excerpt(tmp_path / "absent.log") == ""


def test_a_lighthouse_that_cannot_bind_its_port_is_a_clear_error_at_once(tmp_path):
    pytest.importorskip("torchft")
    from harness.distribution.ft.processes import start_lighthouse

    ft = _cfg().ft
    lighthouse, port = start_lighthouse(ft, tmp_path / "free.log")  # ft.lighthouse_port 0: one it picks
    try:
        assert port > 0 and not port_is_free(port)  # it listens there
        ft.lighthouse_port = port  # taken since the checks: what a second run on this machine would meet
        with pytest.raises(RuntimeError, match=rf"did not start on port {port} .*Address already in use.*"
                                               r"pass a free ft.lighthouse_port, or 0"):
            start_lighthouse(ft, tmp_path / "taken.log", wait_s=30)
    finally:
        lighthouse.kill()
        lighthouse.wait()
