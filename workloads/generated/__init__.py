"""Generated trace benchmarks: bundle (capture output) → spec → replay, with measured fidelity."""

from workloads.generated.workload import GeneratedConfig, GeneratedWorkload

__all__ = ["GeneratedConfig", "GeneratedWorkload"]
