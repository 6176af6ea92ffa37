"""Sequence recommender with FreeScale-style load balancing across ranks (``workload=seqrec``)."""

from __future__ import annotations

import importlib
from typing import Any

from workloads.base import declare

declare("seqrec", "workloads.seqrec.workload",
        "Sequence recommender on jagged histories with FreeScale-style load balancing")

# the public names, imported on first use (the package itself stays cheap to import)
_EXPORTS = {
    "CostModel": "workloads.seqrec.balance",
    "bubble_fraction": "workloads.seqrec.balance",
    "fit_cost_model": "workloads.seqrec.balance",
    "partition": "workloads.seqrec.balance",
    "LengthDistribution": "workloads.seqrec.data",
    "PlantedPreferences": "workloads.seqrec.data",
    "SeqBatch": "workloads.seqrec.data",
    "PRESETS": "workloads.seqrec.model",
    "SeqRecModel": "workloads.seqrec.model",
    "SeqRecShape": "workloads.seqrec.model",
    "ScalePrediction": "workloads.seqrec.simulate",
    "simulate_scaling": "workloads.seqrec.simulate",
    "SeqRecConfig": "workloads.seqrec.workload",
    "SeqRecWorkload": "workloads.seqrec.workload",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
