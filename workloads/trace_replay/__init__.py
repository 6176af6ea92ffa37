"""Generated trace benchmarks: bundle (capture output) → spec → replay, with measured fidelity."""

from workloads.base import declare, lazy_attributes

declare("generated", "workloads.trace_replay.workload",
        "Replay of a generated trace benchmark (cobench trace generate)",
        config="workloads.trace_replay.config:GeneratedConfig", replays_bundle=True)

# the public names, imported on first use: the package itself stays cheap to import
EXPORTS = {
    "workloads.trace_replay.config": ["GeneratedConfig"],
    "workloads.trace_replay.workload": ["GeneratedWorkload"],
}
__getattr__ = lazy_attributes(__name__, EXPORTS)
__all__ = sorted(name for names in EXPORTS.values() for name in names)
