"""The failure scenario's figures, from one side's step logs: stall, recovery, steps lost, effective
training time, goodput and whether the replica groups ended with the same weights."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class FailureRun:
    """One side of the scenario (``torchft``, or the checkpointed ``baseline``) as it ran: its processes'
    step logs, the kill and restart times, and the hashes of the training states they ended with."""

    name: str
    kill_time: float = 0.0
    restart_time: float = 0.0
    logs: dict[tuple[int, int], list[dict]] = field(default_factory=dict)  # (replica, rank) → step attempts
    hashes: dict[tuple[int, int], str] = field(default_factory=dict)


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


def _busy_s(log: list[dict]) -> float:
    """The time a process spent in these steps."""
    return sum(e["end"] - e["start"] for e in log)


def scenario_metrics(side: FailureRun, prefix: str = "", skip: int = 0) -> dict[str, float]:
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
    - ``goodput``: the share of the job's capacity that made progress: each replica group's time in steps
      that count (as above; the restarted group's absence counts as lost) ÷ the wall time, weighted by
      the samples the group trains a step. Time, not samples per second: on a shared CPU a group
      training alone steps faster than beside its peers (its peers' cores are free), which no failure-free
      job does, so a rate-based figure would pass 1 there; this one cannot;
    - ``weights_identical``: 1 when every replica group ends with the same training state (torchft).
    """
    rank0 = {r: log for (r, k), log in side.logs.items() if k == 0}
    victims = {r for r, log in rank0.items() if any(e["incarnation"] == 1 for e in log)}
    kept_on = [r for r in rank0 if r not in victims] or list(rank0)  # the surviving groups
    survivors = [rank0[r] for r in kept_on]
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
        kept = {r: [e for e in log if e["incarnation"] == 1 or e["step"] <= resumed_from] for r, log in rank0.items()}
        useful_s = statistics.fmean(_busy_s(log) for log in kept.values())
    else:
        durations = [e["end"] - e["start"] for log in survivors for e in log]
        m["stall_s"] = max(durations) - statistics.median(durations)
        m["recovery_s"] = first_back
        committed = [e["step"] for log in survivors for e in log if e["committed"]]
        m["steps_lost"] = float(len(committed) - len(set(committed)))
        m["steps_retried"] = float(sum(not e["committed"] for log in survivors for e in log))
        kept = {r: [e for e in log if e["committed"]] for r, log in rank0.items()}
        useful_s = statistics.fmean(_busy_s(kept[r]) for r in kept_on)
        by_rank: dict[int, set[str]] = {}  # a group's ranks hold different shards: compare rank k with rank k
        for (_, rank), digest in side.hashes.items():
            by_rank.setdefault(rank, set()).add(digest)
        every_one = len(side.hashes) == len(side.logs)  # every process reached the end and said what it holds
        m["weights_identical"] = float(every_one and all(len(h) == 1 for h in by_rank.values()))
    batch = {r: sum(log[0]["samples"] for (g, _), log in side.logs.items() if g == r) for r in rank0}
    m["steps"] = float(steps)
    m["step_time_s_failure_free"] = clean_step_s
    m["wall_s"] = wall
    m["effective_training_time_pct"] = 100 * useful_s / wall
    m["goodput"] = sum(batch[r] * _busy_s(kept[r]) for r in rank0) / (sum(batch.values()) * wall)
    return {f"{prefix}{k}": v for k, v in m.items()}
