"""Generated trace benchmarks: bundle (capture output) → spec → replay, with measured fidelity."""

from workloads.trace_replay.workload import GeneratedConfig, GeneratedWorkload

__all__ = ["GeneratedConfig", "GeneratedWorkload"]
