"""The failure scenario's checks: bad input becomes a ValueError naming the key and the fix, before any
process starts."""

from __future__ import annotations

import os

from harness.config import CobenchConfig
from harness.distribution.ft.processes import lighthouse_binary, port_is_free

MIN_STEPS_AFTER_KILL = 5  # the restarted replica needs steps to heal and commit before the run ends
SUPPORTING_WORKLOADS = ("llama",)  # workloads whose setup() calls RunContext.fault_tolerance.attach


def total_steps(cfg: CobenchConfig) -> int:
    """The run's steps, warm-up included: the step after which a replica group may stop."""
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
    if ft.lighthouse_port and not port_is_free(ft.lighthouse_port):
        raise ValueError(f"invalid config 'ft.lighthouse_port': port {ft.lighthouse_port} is in use (another "
                         f"lighthouse or service?); pass a free one or 0 (the lighthouse takes a free one)")
