"""DLRM-DCNv2 as MLPerf trains it, assembled from TorchRec's own modules.

The network is ``torchrec.models.dlrm.DLRM_DCN``: a bottom MLP over the dense features, one
pooled embedding bag per sparse feature (``EmbeddingBagCollection``), a low-rank DCNv2 cross
network over [bottom output, pooled embeddings] and a top MLP to one logit. This file only
describes shapes (:class:`DLRMShape`, :data:`PRESETS`) and builds that model; it re-implements
nothing TorchRec has. TorchRec is imported where it is used: every ``cobench`` command imports
this package to register the workload, and that must stay cheap (and work without TorchRec).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

if TYPE_CHECKING:
    from torchrec.models.dlrm import DLRM_DCN
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

# The MLPerf DLRM-DCNv2 reference (Criteo 1TB, multi-hot variant): rows per table, already
# capped at 40M by MLPerf's preprocessing, and the fixed number of ids per sample per table.
# Both from mlcommons/training recommendation_v2/torchrec_dlrm/README.MD, "Running the MLPerf DLRM v2
# benchmark": --num_embeddings_per_feature and --multi_hot_sizes (the same lists its
# scripts/materialize_synthetic_multihot_dataset.py takes). Ids of a capped table are taken modulo its rows.
MLPERF_TABLE_ROWS = (
    40_000_000, 39_060, 17_295, 7_424, 20_265, 3, 7_122, 1_543, 63, 40_000_000, 3_067_956, 405_282, 10,
    2_209, 11_938, 155, 4, 976, 14, 40_000_000, 40_000_000, 40_000_000, 590_152, 12_973, 108, 36,
)
MLPERF_MULTI_HOT_SIZES = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)


@dataclass(frozen=True)
class DLRMShape:
    """Everything that fixes the network and its inputs' layout."""

    table_rows: tuple[int, ...]  # one table per sparse feature
    multi_hot_sizes: tuple[int, ...]  # ids per sample, per table
    embedding_dim: int
    num_dense: int  # dense (continuous) input features
    bottom_mlp: tuple[int, ...]  # the last size must equal embedding_dim
    top_mlp: tuple[int, ...]  # the last size is 1 (the click logit)
    dcn_num_layers: int
    dcn_low_rank_dim: int
    batch_size: int  # the preset's global batch

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    @property
    def interaction_dim(self) -> int:
        """Width of the DCN input and output: bottom output plus one pooled vector per table."""
        return (self.num_tables + 1) * self.embedding_dim

    def validate(self) -> None:
        """Raise ValueError naming the first field that cannot build a DLRM-DCN."""
        if not self.table_rows:
            raise ValueError("there must be at least one embedding table")
        if min(self.table_rows) < 1:
            raise ValueError(f"every table needs >= 1 row, got {min(self.table_rows)}")
        if len(self.multi_hot_sizes) != self.num_tables:
            raise ValueError(
                f"multi_hot_sizes has {len(self.multi_hot_sizes)} entries for {self.num_tables} tables"
            )
        if min(self.multi_hot_sizes) < 1:
            raise ValueError(f"every multi-hot size must be >= 1, got {min(self.multi_hot_sizes)}")
        if self.embedding_dim < 4 or self.embedding_dim % 4:
            raise ValueError(f"embedding_dim must be a positive multiple of 4 (FBGEMM), got {self.embedding_dim}")
        if not self.bottom_mlp or self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(f"bottom_mlp must end in embedding_dim={self.embedding_dim}, got {list(self.bottom_mlp)}")
        if len(self.top_mlp) < 2 or self.top_mlp[-1] != 1:
            raise ValueError(f"top_mlp needs >= 2 layers ending in 1, got {list(self.top_mlp)}")
        if min(self.bottom_mlp + self.top_mlp) < 1:
            raise ValueError("MLP layer sizes must be >= 1")
        if self.num_dense < 1 or self.dcn_num_layers < 1 or self.dcn_low_rank_dim < 1:
            raise ValueError("num_dense, dcn_num_layers and dcn_low_rank_dim must be >= 1")


PRESETS: dict[str, DLRMShape] = {
    # CPU-sized: 8 tables of Criteo-like, uneven sizes; trains to a clear AUC in ~100 steps.
    "tiny": DLRMShape(
        table_rows=(5_000, 4_000, 3_000, 2_000, 1_000, 500, 200, 50),
        multi_hot_sizes=(3, 2, 1, 2, 4, 1, 1, 2),
        embedding_dim=16,
        num_dense=13,
        bottom_mlp=(64, 32, 16),
        top_mlp=(64, 32, 1),
        dcn_num_layers=3,
        dcn_low_rank_dim=32,
        batch_size=512,
    ),
    # Where the embedding all-to-all is a real share of the step on this class of machine: MLPerf's 26
    # tables and multi-hot sizes (215 ids per sample), rows capped at 50K (~0.6M rows, ~150 MB at dim 64),
    # a small dense part, a large batch. For codec comparisons (conf/suite/dlrm_codecs.yaml); 2+ ranks.
    "a2a": DLRMShape(
        table_rows=tuple(min(rows, 50_000) for rows in MLPERF_TABLE_ROWS),
        multi_hot_sizes=MLPERF_MULTI_HOT_SIZES,
        embedding_dim=64,
        num_dense=13,
        bottom_mlp=(64, 64),
        top_mlp=(64, 1),
        dcn_num_layers=1,
        dcn_low_rank_dim=16,
        batch_size=4096,
    ),
    # The MLPerf Training reference: 26 tables (~204M rows at the 40M cap), dim 128. Accelerators. Every
    # number is the reference's run command (recommendation_v2/torchrec_dlrm/README.MD): --embedding_dim 128,
    # --dense_arch_layer_sizes 512,256,128, --over_arch_layer_sizes 1024,1024,512,256,1, --dcn_num_layers=3,
    # --dcn_low_rank_dim=512, GLOBAL_BATCH_SIZE=65536; its --adagrad --learning_rate 0.005 is DLRMConfig's
    # default lr, and its target (validation AUROC 0.80275) is workloads/dlrm/criteo.py's MLPERF_AUC_TARGET.
    "mlperf_dcnv2": DLRMShape(
        table_rows=MLPERF_TABLE_ROWS,
        multi_hot_sizes=MLPERF_MULTI_HOT_SIZES,
        embedding_dim=128,
        num_dense=13,
        bottom_mlp=(512, 256, 128),
        top_mlp=(1024, 1024, 512, 256, 1),
        dcn_num_layers=3,
        dcn_low_rank_dim=512,
        batch_size=65_536,
    ),
}


def table_name(index: int) -> str:
    return f"t_cat_{index}"


def feature_name(index: int) -> str:
    return f"cat_{index}"  # torchrec.datasets.criteo's names for the 26 categorical columns


def table_configs(shape: DLRMShape) -> list[EmbeddingBagConfig]:
    """One sum-pooled table per sparse feature, TorchRec's default uniform init."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(
            name=table_name(i), embedding_dim=shape.embedding_dim, num_embeddings=rows, feature_names=[feature_name(i)]
        )
        for i, rows in enumerate(shape.table_rows)
    ]


def build_dlrm(shape: DLRMShape, dense_device: torch.device, embedding_device: torch.device) -> DLRM_DCN:
    """The model, its dense part on ``dense_device``, its tables on ``embedding_device``.

    Put the tables on ``meta`` when ``DistributedModelParallel`` will shard them: each rank then
    allocates only its own shards. The dense part is never built on ``meta`` for training, because
    ``LowRankCrossNet`` has no ``reset_parameters`` and DMP would leave it uninitialised.
    """
    from torchrec.models.dlrm import DLRM_DCN
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    ebc = EmbeddingBagCollection(tables=table_configs(shape), device=embedding_device)
    with torch.device(dense_device):  # LowRankCrossNet takes no device argument
        return DLRM_DCN(
            embedding_bag_collection=ebc,
            dense_in_features=shape.num_dense,
            dense_arch_layer_sizes=list(shape.bottom_mlp),
            over_arch_layer_sizes=list(shape.top_mlp),
            dcn_num_layers=shape.dcn_num_layers,
            dcn_low_rank_dim=shape.dcn_low_rank_dim,
            dense_device=dense_device,
        )


def count_params(shape: DLRMShape) -> tuple[int, int]:
    """(embedding parameters, dense parameters), from a model on ``meta``."""
    model = build_dlrm(shape, torch.device("meta"), torch.device("meta"))
    sparse = sum(p.numel() for p in model.sparse_arch.parameters())
    return sparse, sum(p.numel() for p in model.parameters()) - sparse


def dense_training_flops(shape: DLRMShape, batch_size: int) -> float:
    """FLOPs of one training step's dense part, counted by ``FlopCounterMode`` on ``meta``.

    Runs the real modules (bottom MLP, DCN interaction, top MLP, BCE loss) forward and backward
    on meta tensors, so the count covers exactly the matmuls autograd issues: the first layer
    gets no input gradient (the dense features need none) while the pooled embeddings do (their
    gradient flows back to the tables). Embedding pooling and optimiser updates are memory-bound
    element-wise work and are not counted, as in MLPerf's own DLRM FLOP figures.
    """
    meta = torch.device("meta")
    model = build_dlrm(shape, meta, meta)
    dense_x = torch.empty(batch_size, shape.num_dense, device=meta)
    pooled = torch.empty(batch_size, shape.num_tables, shape.embedding_dim, device=meta, requires_grad=True)
    labels = torch.empty(batch_size, device=meta)
    with FlopCounterMode(display=False) as counter:
        bottom = model.dense_arch(dense_x)
        logits = model.over_arch(model.inter_arch(dense_features=bottom, sparse_features=pooled)).squeeze(-1)
        F.binary_cross_entropy_with_logits(logits, labels).backward()
    return float(counter.get_total_flops())
