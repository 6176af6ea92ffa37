"""The run's batch schedule: which histories of every global batch each rank trains on.

Every rank draws the same global batches and splits each alike (:class:`RankSplit`): evenly (what a plain
distributed sampler gives), by the balancer's partition on the fitted cost model
(:mod:`workloads.seqrec.balance`), or both in a row (``compare_even``), so all ranks know every partition.
:class:`MovieLensSchedule` plans MovieLens's global batches and builds this rank's share of each, epoch after
epoch; :func:`synthetic_schedule` and :func:`synthetic_rank_batch` do the same for the synthetic pool.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from workloads.seqrec.balance import CostModel, partition
from workloads.seqrec.batch import SeqBatch, build_batch
from workloads.seqrec.config import SeqRecShape
from workloads.seqrec.data import Histories
from workloads.seqrec.movielens import MovieLensSource


@dataclass(frozen=True)
class ScheduledBatch:
    """One entry of the run's batch schedule: a global batch and how it was split."""

    global_index: int
    split: str
    lengths: np.ndarray  # the global batch's history lengths
    parts: list[np.ndarray]
    num_targets: int


@dataclass(frozen=True)
class RankSplit:
    """How a global batch is split across ``world_size`` ranks: evenly when ``balancer`` is None, else by the
    balancer within ``token_budget`` tokens a rank, and with ``compare_even`` evenly too, just before."""

    cost_model: CostModel
    world_size: int
    balancer: str | None
    compare_even: bool
    token_budget: int

    def __call__(self, index: int, lengths: np.ndarray) -> list[ScheduledBatch]:
        """Global batch ``index``, of histories ``lengths`` long, in each of its splits."""
        targets = int(lengths.sum()) - lengths.size
        splits = []
        if self.balancer is None or self.compare_even:
            splits.append(("even", partition(lengths, self.cost_model, self.world_size, "even")))
        if self.balancer is not None:
            splits.append((self.balancer, partition(lengths, self.cost_model, self.world_size, self.balancer,
                                                    self.token_budget)))
        return [ScheduledBatch(index, split, lengths, parts, targets) for split, parts in splits]


class MovieLensSchedule:
    """MovieLens's global batches of ``batch_size`` users (every rank plans the same) and this rank's share."""

    def __init__(self, source: MovieLensSource, split: RankSplit, seed: int, rank: int, batch_size: int,
                 shape: SeqRecShape) -> None:
        self.source, self.split, self.seed, self.rank, self.batch_size = source, split, seed, rank, batch_size
        self.shape = shape

    def plan(self, index: int) -> list[ScheduledBatch]:
        """Global batch ``index``, split as :class:`RankSplit` does."""
        users = self.source.batch_users(self.seed, index, self.batch_size)
        return self.split(index, self.source.train_lengths[users])

    def rank_batch(self, entry: ScheduledBatch, position: int) -> SeqBatch:
        """This rank's share of a global batch: its users' histories and their negatives."""
        seed, source, batch_size = self.seed, self.source, self.batch_size
        mine = entry.parts[self.rank]
        users = source.batch_users(seed, entry.global_index, batch_size)[mine]
        negatives = source.negatives(seed, entry.global_index, batch_size, self.shape.num_negatives)[mine]
        return build_batch(source.train_histories(users), negatives, entry.num_targets, entry.split, position,
                           self.shape.max_len)

    def stream(self) -> Iterator[tuple[ScheduledBatch, SeqBatch]]:
        """The rank's batches, epoch after epoch (runs on the prefetch thread); ``position`` counts them."""
        position = 0
        for index in itertools.count():
            for entry in self.plan(index):
                yield entry, self.rank_batch(entry, position)
                position += 1


def synthetic_schedule(train_set: list[tuple[Histories, np.ndarray]], split: RankSplit) -> list[ScheduledBatch]:
    """The synthetic pool's global batches (histories, negatives), each in its splits."""
    return [entry for index, (histories, _) in enumerate(train_set) for entry in split(index, histories.lengths)]


def synthetic_rank_batch(train_set: list[tuple[Histories, np.ndarray]], entry: ScheduledBatch, rank: int,
                         position: int, max_len: int, device: torch.device) -> SeqBatch:
    """This rank's share of a synthetic global batch, on the device."""
    histories, negatives = train_set[entry.global_index]
    mine = entry.parts[rank]
    return build_batch(histories.select(mine), negatives[mine], entry.num_targets, entry.split, position,
                       max_len).to(device)
