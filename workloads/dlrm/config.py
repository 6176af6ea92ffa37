"""``workload=dlrm``'s config: the schema of ``conf/workload/dlrm.yaml``, a preset and its overrides.

Light: importing it imports neither torch nor TorchRec, so composing configs stays cheap; the
preset table (:mod:`workloads.dlrm.model`) and the all-to-all codecs (:mod:`workloads.dlrm.codec_registry`)
are imported when a config is checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from workloads.base import invalid_config as _invalid

if TYPE_CHECKING:
    from workloads.dlrm.model import DLRMShape

SHARDINGS = ("table_wise", "column_wise", "row_wise")
DATA_SOURCES = ("synthetic", "criteo_1tb")
SPARSE_KINDS = ("multi_hot", "one_hot")  # criteo_1tb's sparse files: day_{d}_sparse_multi_hot.npz | day_{d}_sparse.npy
ID_CHECKS = ("full", "batch")


@dataclass
class DLRMConfig:
    """``workload=dlrm``. Model fields left ``None`` take the preset's value."""

    name: str = "dlrm"
    preset: str = "tiny"
    num_tables: int | None = None  # None: the preset's; else its table lists are cycled to this length
    table_rows: list[int] | None = None  # rows per table
    max_table_rows: int = 40_000_000  # cap on every table (MLPerf's is 40M)
    multi_hot_sizes: list[int] | None = None  # ids per sample, per table
    embedding_dim: int | None = None
    bottom_mlp: list[int] | None = None
    top_mlp: list[int] | None = None
    dcn_num_layers: int | None = None
    dcn_low_rank_dim: int | None = None
    num_dense: int = 13
    batch_size: int | None = None  # global, across all ranks; None: the preset's
    lr: float = 0.005  # Adagrad, dense and sparse
    adagrad_eps: float = 1e-8
    sharding: str = "table_wise"  # with >1 rank: table_wise | column_wise | row_wise (CUDA only)
    comm_codec: str = "none"  # compression of the pooled-embedding all-to-all (see codec_registry.py)
    codec_options: dict[str, Any] = field(default_factory=dict)  # passed to a CUSTOM_CODECS factory
    data: str = "synthetic"  # synthetic (planted click model) | criteo_1tb (MLPerf's preprocessed files)
    data_path: str | None = None  # criteo_1tb: the folder of day_{d}_{dense,labels,sparse...} files
    criteo_sparse: str = "multi_hot"  # criteo_1tb: day_{d}_sparse_multi_hot.npz | one_hot: day_{d}_sparse.npy
    criteo_id_check: str = "full"  # full: every id checked before the run (cached) | batch: as each batch is read
    zipf_exponent: float = 1.1  # synthetic: id popularity ∝ rank ** -zipf_exponent; 0 is uniform
    data_seed: int = 0  # synthetic: the planted click model; fixed so every run learns the same task
    train_batches: int = 128  # synthetic: size of the training set, in global batches (cycled)
    eval_batches: int | None = 4  # held-out global batches; None (criteo_1tb): the whole validation half
    auc_target: float | None = None  # None: criteo_1tb MLPerf's 0.80275; synthetic 85% of the way to the oracle
    # link bandwidths (GB/s per rank) at which to project the all-to-all and step time from the bytes
    projection_bandwidths_gbps: list[float] = field(default_factory=lambda: [12.5, 25.0, 50.0])

    def __post_init__(self) -> None:
        # the model's, the reader's and the codecs' modules (torch): imported when a config is checked
        from workloads.dlrm import codec_registry
        from workloads.dlrm.error_bounded import codec  # noqa: F401 - registers comm_codec=eb
        from workloads.dlrm.model import PRESETS

        if self.preset not in PRESETS:
            raise _invalid("preset", f"got {self.preset!r}, allowed values: {', '.join(PRESETS)}")
        for key in ("num_tables", "embedding_dim", "dcn_num_layers", "dcn_low_rank_dim", "batch_size"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise _invalid(key, f"got {value}, must be >= 1")
        if any(not (math.isfinite(b) and b > 0) for b in self.projection_bandwidths_gbps):
            raise _invalid("projection_bandwidths_gbps", f"got {self.projection_bandwidths_gbps}, must be positive")
        for key in ("max_table_rows", "num_dense", "train_batches", "eval_batches"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise _invalid(key, f"got {getattr(self, key)}, must be >= 1")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise _invalid("lr", f"got {self.lr}, must be a positive number")
        if not (math.isfinite(self.adagrad_eps) and self.adagrad_eps > 0):
            raise _invalid("adagrad_eps", f"got {self.adagrad_eps}, must be a positive number")
        if not (math.isfinite(self.zipf_exponent) and self.zipf_exponent >= 0):
            raise _invalid("zipf_exponent", f"got {self.zipf_exponent}, must be >= 0")
        for key, allowed in (("data", DATA_SOURCES), ("criteo_sparse", SPARSE_KINDS),
                             ("criteo_id_check", ID_CHECKS)):
            if getattr(self, key) not in allowed:
                raise _invalid(key, f"got {getattr(self, key)!r}, allowed values: {', '.join(allowed)}")
        if self.data == "synthetic" and self.eval_batches is None:
            raise _invalid("eval_batches", "null (the whole validation set) is for workload.data=criteo_1tb; "
                                           "the synthetic source needs a number of batches")
        if self.sharding not in SHARDINGS:
            raise _invalid("sharding", f"got {self.sharding!r}, allowed values: {', '.join(SHARDINGS)}")
        codecs = codec_registry.codec_names()
        if self.comm_codec not in codecs:
            raise _invalid("comm_codec", f"got {self.comm_codec!r}, allowed values: {', '.join(codecs)}")
        if self.auc_target is not None and not 0.5 < self.auc_target <= 1:
            raise _invalid("auc_target", f"got {self.auc_target}, must be in (0.5, 1]")
        for key in ("table_rows", "multi_hot_sizes"):
            values = getattr(self, key)
            if values is not None and self.num_tables is not None and len(values) != self.num_tables:
                raise _invalid(key, f"has {len(values)} entries but num_tables is {self.num_tables}")
        try:
            self.shape().validate()
        except ValueError as err:
            raise ValueError(f"invalid config 'workload' (model from preset {self.preset!r}): {err}") from err

    def shape(self) -> DLRMShape:
        """The preset with this config's overrides applied."""
        from workloads.dlrm.model import PRESETS

        base = PRESETS[self.preset]
        rows = tuple(self.table_rows) if self.table_rows is not None else base.table_rows
        hot = tuple(self.multi_hot_sizes) if self.multi_hot_sizes is not None else base.multi_hot_sizes
        count = self.num_tables or (len(self.table_rows or self.multi_hot_sizes or ()) or base.num_tables)
        overrides = {
            "table_rows": tuple(min(rows[i % len(rows)], self.max_table_rows) for i in range(count)),
            "multi_hot_sizes": tuple(hot[i % len(hot)] for i in range(count)),
            "num_dense": self.num_dense,
            "embedding_dim": self.embedding_dim,
            "bottom_mlp": tuple(self.bottom_mlp) if self.bottom_mlp is not None else None,
            "top_mlp": tuple(self.top_mlp) if self.top_mlp is not None else None,
            "dcn_num_layers": self.dcn_num_layers,
            "dcn_low_rank_dim": self.dcn_low_rank_dim,
            "batch_size": self.batch_size,
        }
        shape = replace(base, **{k: v for k, v in overrides.items() if v is not None})
        if self.embedding_dim is not None and self.bottom_mlp is None:  # keep the bottom MLP's output = dim
            shape = replace(shape, bottom_mlp=(*shape.bottom_mlp[:-1], self.embedding_dim))
        return shape


__all__ = ["DATA_SOURCES", "ID_CHECKS", "SHARDINGS", "SPARSE_KINDS", "DLRMConfig"]
