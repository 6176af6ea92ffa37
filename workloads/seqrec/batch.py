"""A rank's share of a global batch as TorchRec moves it: one ``KeyedJaggedTensor`` of the histories and their
sampled negatives. Apart from :mod:`workloads.seqrec.data` (which composing a config imports), so that TorchRec is
imported only when seqrec runs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from workloads.seqrec.data import FEATURES, Histories, validate_lengths


@dataclass
class SeqBatch(Pipelineable):
    """One rank's share of a global batch, as TorchRec's train pipelines move it.

    ``features`` keys: ``item_ids`` and ``actions`` (one jagged list per history, longest history
    first so the attention buckets are contiguous) and ``negatives`` (``num_negatives`` sampled
    items per history). ``num_targets`` counts next-item targets in the *global* batch: every rank
    divides its loss sum by it, so summed gradients equal the global mean whatever the partition.
    """

    features: KeyedJaggedTensor
    num_targets: int
    split: str  # which partition gave this share: "even" or the balancer's name
    index: int  # position in the run's batch schedule (the same on every rank)

    @property
    def samples(self) -> int:
        return self.features.stride()

    def to(self, device: torch.device, non_blocking: bool = False) -> SeqBatch:
        return SeqBatch(self.features.to(device, non_blocking=non_blocking), self.num_targets, self.split, self.index)

    def record_stream(self, stream: torch.Stream) -> None:
        self.features.record_stream(stream)


def build_batch(
    histories: Histories, negatives: np.ndarray, num_targets: int, split: str, index: int, max_len: int
) -> SeqBatch:
    """A :class:`SeqBatch` from histories (reordered longest first) and their ``[U, K]`` negatives."""
    validate_lengths(histories.lengths, max_len)
    order = np.argsort(-histories.lengths, kind="stable")
    ordered = histories.select(order)
    negatives = negatives[order]
    lengths = torch.from_numpy(ordered.lengths)
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=list(FEATURES),
        values=torch.from_numpy(np.concatenate([ordered.items, ordered.actions, negatives.reshape(-1)])),
        lengths=torch.cat([lengths, lengths, torch.full_like(lengths, negatives.shape[1])]),
    )
    return SeqBatch(features, num_targets, split, index)
