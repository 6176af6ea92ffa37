"""DLRM-DCNv2 (MLPerf) training benchmark on TorchRec, with a measured, compressible all-to-all."""

from workloads.base import declare, declare_preparer, lazy_attributes

declare("dlrm", "workloads.dlrm.workload",
        "DLRM-DCNv2 (MLPerf) from TorchRec, on planted Criteo-like click data or MLPerf's Criteo 1TB files",
        config="workloads.dlrm.config:DLRMConfig")
declare_preparer("criteo", "workloads.dlrm.prepare",
                 "Criteo 1TB raw TSV days -> MLPerf's preprocessed numpy layout (+ the multi-hot .npz) for "
                 "workload=dlrm workload.data=criteo_1tb")

# the public names, imported on first use: the package itself stays cheap to import
EXPORTS = {
    "workloads.dlrm.config": ["DLRMConfig"],
    "workloads.dlrm.error_bounded.codec": ["CUSTOM_CODECS"],  # with comm_codec=eb registered
    "workloads.dlrm.codec_registry": ["build_qcomm_registry"],
    "workloads.dlrm.a2a": ["PooledA2AMeter", "TimedCodec"],
    "workloads.dlrm.data": ["ClickBatch", "PlantedClickModel", "SyntheticCriteo"],
    "workloads.dlrm.criteo": ["CriteoSource", "MLPERF_AUC_TARGET"],
    "workloads.dlrm.model": ["PRESETS", "DLRMShape", "build_dlrm"],
    "workloads.dlrm.workload": ["DLRMWorkload", "roc_auc"],
}
__getattr__ = lazy_attributes(__name__, EXPORTS)
__all__ = sorted(name for names in EXPORTS.values() for name in names)
