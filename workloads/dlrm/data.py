"""Synthetic Criteo-like click data with a planted click model, so AUC is a meaningful target.

Each sample has ``num_dense`` skewed non-negative dense features (like Criteo's log-transformed
counts), one multi-hot bag of ids per table with Zipf-distributed popularity, and a click label
drawn from a hidden logistic model (:class:`PlantedClickModel`): a linear term in the dense
features plus, for every table, the mean of hidden per-id weights over the sample's bag. A model
that learns the embeddings of popular ids recovers much of that signal, so AUC climbs from 0.5
towards the planted model's own AUC (the best any model can do on this data).

Everything is deterministic: the planted model depends only on ``data_seed``; each batch stream
on a generator seeded by the caller (by run seed, stream and rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

_MASK32 = 0xFFFFFFFF


@dataclass
class ClickBatch:
    """One batch: dense ``[B, num_dense]``, sparse KJT (one key per table), labels ``[B]`` in {0, 1}."""

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    # the hidden model's logits (the oracle's scores); None for real data, which has no hidden model
    planted_logits: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.labels.numel()

    def to(self, device: torch.device, non_blocking: bool = False) -> ClickBatch:
        """On ``device``; ``non_blocking`` copies from pinned memory (:meth:`pin_memory`) asynchronously."""
        planted = self.planted_logits.to(device, non_blocking=non_blocking) if self.planted_logits is not None \
            else None
        return ClickBatch(self.dense.to(device, non_blocking=non_blocking),
                          self.sparse.to(device, non_blocking=non_blocking),
                          self.labels.to(device, non_blocking=non_blocking), planted)

    def pin_memory(self) -> ClickBatch:
        """In pinned host memory, so that :meth:`to` with ``non_blocking`` overlaps the device's work."""
        planted = self.planted_logits.pin_memory() if self.planted_logits is not None else None
        return ClickBatch(self.dense.pin_memory(), self.sparse.pin_memory(), self.labels.pin_memory(), planted)


def _hash32(x: torch.Tensor, salt: int) -> torch.Tensor:
    """A 32-bit integer mix (murmur3's finaliser) of int64 ``x``; int64 products wrap, low bits stay exact."""
    x = ((x + salt) * 0x9E3779B1) & _MASK32
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & _MASK32
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def zipf_ranks(rows: int, exponent: float, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` popularity ranks in ``[0, rows)``, P(rank k) ∝ (k + 1) ** -exponent (approximately).

    Inverse-CDF sampling of the continuous power law on [1, rows + 1), floored: O(count) time and
    no per-row table, so 40M-row tables cost nothing. ``exponent`` 0 is uniform.
    """
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    top = float(rows + 1)
    if abs(exponent - 1.0) < 1e-9:
        x = top**u
    else:
        a = 1.0 - exponent
        x = (1.0 + u * (top**a - 1.0)) ** (1.0 / a)
    return (x.floor().long() - 1).clamp_(0, rows - 1)


class PlantedClickModel:
    """The hidden truth labels are drawn from; fixed by ``seed`` alone (identical on every rank).

    ``logit = bias + dense_weight · dense + sparse_scale / sqrt(T) * Σ_t mean_{id ∈ bag_t} w_t(id)``
    where ``w_t(id)`` is a hashed, unit-variance pseudo-random weight: no table is stored, so the
    40M-row MLPerf tables are as cheap as tiny ones. Popularity ranks are mapped to ids by a
    per-table affine bijection, so hot ids are spread over each table as in real, hashed data.
    """

    def __init__(self, table_rows: tuple[int, ...], num_dense: int, seed: int,
                 dense_scale: float = 1.0, sparse_scale: float = 2.5, bias: float = -1.0):
        g = torch.Generator().manual_seed(seed)
        self.table_rows = table_rows
        self.dense_mean = torch.rand(num_dense, generator=g) * 2 + 0.5  # per-feature Exp() scale
        self.dense_weight = torch.randn(num_dense, generator=g) * dense_scale / math.sqrt(num_dense)
        self.dense_centre = torch.log1p(self.dense_mean * 10.0) - 0.5  # roughly each feature's mean
        self.sparse_scale = sparse_scale / math.sqrt(len(table_rows))
        self.bias = bias
        self.salts = [int(s) for s in torch.randint(1, 2**31 - 1, (len(table_rows),), generator=g)]
        self.strides, self.offsets = [], []
        for rows in table_rows:
            stride = int(torch.randint(1, 2**31 - 1, (), generator=g)) % rows or 1
            while math.gcd(stride, rows) != 1:  # an affine map mod rows is a bijection iff gcd == 1
                stride += 1
            self.strides.append(stride)
            self.offsets.append(int(torch.randint(0, rows, (), generator=g)))

    def ids_from_ranks(self, table: int, ranks: torch.Tensor) -> torch.Tensor:
        return (ranks * self.strides[table] + self.offsets[table]) % self.table_rows[table]

    def id_weight(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        """Hidden weight of each id: uniform on [-√3, √3] (mean 0, variance 1)."""
        u = _hash32(ids, self.salts[table]).double() / 2.0**32
        return ((u - 0.5) * math.sqrt(12.0)).float()

    def dense_features(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        counts = -torch.log1p(-torch.rand(batch, len(self.dense_mean), generator=generator)) * self.dense_mean
        return torch.log1p(counts * 10.0)  # Criteo-style log(1 + count) of an exponential count

    def logits(self, dense: torch.Tensor, bags: list[torch.Tensor]) -> torch.Tensor:
        """``bags[t]``: ``[B, hot_t]`` ids of table t."""
        logit = self.bias + (dense - self.dense_centre) @ self.dense_weight
        sparse = sum(self.id_weight(t, ids).mean(dim=1) for t, ids in enumerate(bags))
        return logit + self.sparse_scale * sparse


class SyntheticCriteo:
    """Batches of multi-hot click data labelled by a :class:`PlantedClickModel`."""

    def __init__(self, table_rows: tuple[int, ...], multi_hot_sizes: tuple[int, ...], num_dense: int,
                 zipf_exponent: float, seed: int):
        self.truth = PlantedClickModel(table_rows, num_dense, seed)
        self.table_rows = table_rows
        self.multi_hot_sizes = multi_hot_sizes
        self.zipf_exponent = zipf_exponent
        self.keys = [f"cat_{i}" for i in range(len(table_rows))]

    def batch(self, batch_size: int, generator: torch.Generator) -> ClickBatch:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        dense = self.truth.dense_features(batch_size, generator)
        bags = []
        for t, (rows, hot) in enumerate(zip(self.table_rows, self.multi_hot_sizes, strict=True)):
            ranks = zipf_ranks(rows, self.zipf_exponent, batch_size * hot, generator)
            bags.append(self.truth.ids_from_ranks(t, ranks).view(batch_size, hot))
        logits = self.truth.logits(dense, bags)
        labels = torch.bernoulli(torch.sigmoid(logits), generator=generator)
        # KJT layout is feature-major: all of table 0's bags, then table 1's, ...
        lengths = torch.cat([torch.full((batch_size,), hot, dtype=torch.int64) for hot in self.multi_hot_sizes])
        sparse = KeyedJaggedTensor(keys=self.keys, values=torch.cat([b.reshape(-1) for b in bags]), lengths=lengths)
        return ClickBatch(dense, sparse, labels, logits)


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC (Mann-Whitney U, ties counted half); NaN when one class is missing."""
    scores, labels = scores.double().flatten(), labels.double().flatten()
    positives = float(labels.sum())
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    sorted_scores, order = torch.sort(scores)
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    average_rank = ends - (counts.double() - 1) / 2  # 1-based mean rank of each group of equal scores
    ranks = torch.empty_like(scores)
    ranks[order] = average_rank[inverse]
    rank_sum = float(ranks[labels == 1].sum())
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)
