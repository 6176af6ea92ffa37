"""How batches reach the train pipeline and what evaluation ranks: a pool, a prefetched stream, eval sets.

TorchRec's train pipelines pull batches with ``next()`` (``TrainPipelineSparseDist`` one step ahead);
both feeds time those calls, so a step can say how long it waited for its batch (``data_wait_s``):

- :class:`BatchPool`: the synthetic source's pre-built rank batches in a cycle; the wait is the lookup.
- :class:`BatchStream`: batches built on a background thread (:class:`~workloads.data_source.Prefetcher`)
  from an unbounded schedule; the wait is what the step spent on a batch that was not ready yet.

While ``held`` (a trace capture's op-by-op steps), either hands out its last batch again and again.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from workloads.data_source import Prefetcher
from workloads.seqrec.batch import SeqBatch
from workloads.seqrec.data import Histories, ranking_quality

KEEP_ENTRIES = 64  # schedule entries a stream remembers: far more than the pipelines run ahead


class BatchPool:
    """The rank's pre-built batches in a cycle."""

    def __init__(self, batches: list[Any]):
        self._cycle = itertools.cycle(batches)
        self._last: Any = None
        self.held = False
        self.waited_s = 0.0  # summed over next() calls; the step resets it

    def __iter__(self) -> BatchPool:
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        if not self.held or self._last is None:
            self._last = next(self._cycle)
        self.waited_s += time.perf_counter() - start
        return self._last


class BatchStream:
    """Rank batches made ahead on a thread from ``make()``'s ``(entry, batch)`` pairs; ``entry(batch.index)``
    is the schedule entry a batch came from (the step needs its lengths and partition).

    The thread hands batches over ``chunk`` at a time. Handed over one by one, the producer wakes after
    every step's ``next()`` and, holding the GIL while it builds, makes the following ``next()`` wait for
    the interpreter's thread switch (up to 5 ms) though a batch is ready; in chunks it wakes once every
    ``chunk`` steps, and the steps between take a batch the consumer already holds.
    """

    def __init__(self, make: Callable[[], Iterator[tuple[Any, SeqBatch]]], device: torch.device, depth: int = 2,
                 chunk: int = 8):
        def chunks() -> Iterator[list[tuple[Any, SeqBatch]]]:
            pairs = make()
            while chunk_ := list(itertools.islice(pairs, chunk)):
                yield chunk_

        def transfer(pairs: list[tuple[Any, SeqBatch]]) -> list[tuple[Any, SeqBatch]]:
            return [(entry, batch.to(device)) for entry, batch in pairs]

        self._prefetcher: Prefetcher[list[tuple[Any, SeqBatch]]] = Prefetcher(
            chunks, depth=depth, name="seqrec", transfer=None if device.type == "cpu" else transfer)
        self._ready: collections.deque[tuple[Any, SeqBatch]] = collections.deque()
        self._entries: dict[int, Any] = {}
        self._last: SeqBatch | None = None
        self.held = False
        self.waited_s = 0.0

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> SeqBatch:
        if self.held and self._last is not None:
            return self._last
        start = time.perf_counter()
        if not self._ready:
            self._ready.extend(self._prefetcher.next()[0])
        entry, batch = self._ready.popleft()
        self.waited_s += time.perf_counter() - start
        self._entries[batch.index] = entry
        self._entries.pop(batch.index - KEEP_ENTRIES, None)
        self._last = batch
        return batch

    def entry(self, index: int) -> Any:
        return self._entries[index]

    def close(self) -> None:
        self._prefetcher.close()


@dataclass(frozen=True)
class EvalSet:
    """One rank's share of held-out prefixes and their next items, on the device; ``count``: all ranks'."""

    items: torch.Tensor  # [Σ L]
    actions: torch.Tensor  # [Σ L]
    lengths: torch.Tensor  # [U]
    offsets: torch.Tensor  # [U + 1]
    targets: torch.Tensor  # [U]
    count: int

    @classmethod
    def of(cls, prefixes: Histories, targets: np.ndarray, count: int, device: torch.device) -> EvalSet:
        return cls(*(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in (
            prefixes.items, prefixes.actions, prefixes.lengths, prefixes.offsets, targets)), count=count)

    def ranked_sums(self, user_vectors: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                    catalogue_nd: torch.Tensor, k: int, chunk: int = 512) -> tuple[float, float]:
        """Summed hit@k and NDCG@k of each target against the whole catalogue, ``chunk`` users at a time (a
        score row per user and item: ML-20M's 27k items by every user at once would not fit)."""
        hits_sum = ndcg_sum = 0.0
        for first in range(0, self.lengths.numel(), chunk):
            last = min(first + chunk, self.lengths.numel())
            lo, hi = int(self.offsets[first]), int(self.offsets[last])
            users_bd = user_vectors(self.items[lo:hi], self.actions[lo:hi], self.lengths[first:last])
            scores_bn = users_bd @ catalogue_nd.T
            target_scores = scores_bn.gather(1, self.targets[first:last, None])
            greater = (scores_bn > target_scores).sum(dim=1).cpu().numpy()
            hits, ndcg = ranking_quality(greater, np.ones_like(greater), k)
            hits_sum, ndcg_sum = hits_sum + float(hits.sum()), ndcg_sum + float(ndcg.sum())
        return hits_sum, ndcg_sum
