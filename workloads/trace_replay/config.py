"""``workload=generated``'s config: the schema of ``conf/workload/generated.yaml``, which spec to replay and
how. Light: importing it imports neither torch nor the replay's code, so composing configs stays cheap."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GeneratedConfig:
    """``workload=generated``: which spec to replay, and what to judge it against."""

    name: str = "generated"
    spec: str = ""  # the spec file `cobench trace generate` wrote (required)
    # A bundle captured from the *original* program on the replay's platform: its plain step times
    # become the reference (portability: captured on A, replayed on B, judged against the original on B).
    reference_bundle: str = ""
    op_timing: bool = True  # after the timed steps, time each op alone (per-op / per-category fidelity)
    # Single process: first dry-run in a child process and skip ops that crash it (see probe.py).
    probe: bool = True
    # Spend the program's own host time between ops (measured at capture, under Kineto alone) as it
    # did; off: ops back to back (the device work alone). Only for whole-step specs.
    host_gaps: bool = True
    # Run ops the safety policy refuses (files, raw storages, process-wide state, unknown namespaces:
    # see workloads/trace_replay/safety.py). Only for a spec you trust; logged loudly and tagged.
    trust_spec: bool = False
    # Refuse a spec whose tensors need more than this at their peak; 0: what the device has available.
    memory_limit_mb: float = 0.0
    # Seconds each of the replay's own calibrations (its cost per op call, the autograd bookkeeping it spends)
    # may take in all to add rounds past 24 while its figure moves the step more than ±1 %; 0: 24 rounds.
    calibration_s: float = 0.0
    # Run the ops the program recorded autograd history through with grad mode on, recording that history as
    # the program did (torn down where its backward began); off: run them without grad and spend the
    # bookkeeping, as measured, as host time. Only with host_gaps.
    record_history: bool = True


__all__ = ["GeneratedConfig"]
