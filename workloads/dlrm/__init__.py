"""DLRM-DCNv2 (MLPerf) training benchmark on TorchRec, with a measured, compressible all-to-all."""

from workloads.dlrm import compression  # noqa: F401 - registers comm_codec=eb in CUSTOM_CODECS
from workloads.dlrm.comm import CUSTOM_CODECS, PooledA2AMeter, build_qcomm_registry
from workloads.dlrm.data import ClickBatch, PlantedClickModel, SyntheticCriteo
from workloads.dlrm.model import PRESETS, DLRMShape, build_dlrm
from workloads.dlrm.workload import DLRMConfig, DLRMWorkload, roc_auc

__all__ = [
    "CUSTOM_CODECS",
    "PRESETS",
    "ClickBatch",
    "DLRMConfig",
    "DLRMShape",
    "DLRMWorkload",
    "PlantedClickModel",
    "PooledA2AMeter",
    "SyntheticCriteo",
    "build_dlrm",
    "build_qcomm_registry",
    "roc_auc",
]
