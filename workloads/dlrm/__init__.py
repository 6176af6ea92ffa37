"""DLRM-DCNv2 (MLPerf) training benchmark on TorchRec, with a measured, compressible all-to-all."""

from __future__ import annotations

import importlib
from typing import Any

from workloads.base import declare

declare("dlrm", "workloads.dlrm.workload",
        "DLRM-DCNv2 (MLPerf) from TorchRec, on planted Criteo-like click data")

# the public names, imported on first use (the package itself stays cheap to import)
_EXPORTS = {
    "CUSTOM_CODECS": "workloads.dlrm.comm",
    "PooledA2AMeter": "workloads.dlrm.comm",
    "build_qcomm_registry": "workloads.dlrm.comm",
    "ClickBatch": "workloads.dlrm.data",
    "PlantedClickModel": "workloads.dlrm.data",
    "SyntheticCriteo": "workloads.dlrm.data",
    "PRESETS": "workloads.dlrm.model",
    "DLRMShape": "workloads.dlrm.model",
    "build_dlrm": "workloads.dlrm.model",
    "DLRMConfig": "workloads.dlrm.workload",
    "DLRMWorkload": "workloads.dlrm.workload",
    "roc_auc": "workloads.dlrm.workload",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
