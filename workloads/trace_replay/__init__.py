"""Generated trace benchmarks: bundle (capture output) → spec → replay, with measured fidelity."""

from __future__ import annotations

import importlib
from typing import Any

from workloads.base import declare

declare("generated", "workloads.trace_replay.workload",
        "Replay of a generated trace benchmark (cobench trace generate)", replays_bundle=True)

# the public names, imported on first use (the package itself stays cheap to import)
_EXPORTS = {
    "GeneratedConfig": "workloads.trace_replay.workload",
    "GeneratedWorkload": "workloads.trace_replay.workload",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
