"""The batches Llama's training steps take, and its evaluation set, on this rank's device.

:class:`TrainingFeed` is one of two: the synthetic pool (``workload.data=synthetic``: global batches drawn from
the planted Markov chain at set-up, this rank's data-parallel slice of each kept on the device and cycled like
epochs) or real text read, tokenized and packed on a background thread and handed over a few batches at a
time. Either way a step learns how long it waited for its batch.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator

import torch

from workloads.base import RunContext
from workloads.data_source import Prefetcher
from workloads.device import pin, pins_host_memory
from workloads.llama.config import LlamaConfig
from workloads.llama.data import MarkovTokenSource
from workloads.llama.sources import TextSource

HANDOVER = 8  # real data: batches taken from the prefetch thread at a time

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs_bs, targets_bs)


class TrainingFeed:
    """This rank's training batches and evaluation batches: from ``text`` when given, else synthetic."""

    def __init__(self, config: LlamaConfig, ctx: RunContext, text: TextSource | None, vocab_size: int,
                 local_batch: int, data_rank: int) -> None:
        self.config, self.ctx, self.local_batch, self.data_rank = config, ctx, local_batch, data_rank
        self.prefetcher: Prefetcher | None = None
        self.entropy_rate: float | None = None  # synthetic data: the best achievable loss, in nats per token
        if text is not None:
            windows = torch.from_numpy(text.eval_windows.astype("int64")).to(ctx.device)
            self.eval_set = [(w[:, :-1], w[:, 1:]) for w in windows.split(local_batch)]
            # handed over HANDOVER batches at a time: taking an item from the thread can wait for the interpreter
            # to switch threads even when it is ready, so that wait is paid once per HANDOVER steps
            # bound for a GPU, batches are pinned on the reading thread: the step's copy is then asynchronous
            pinned = pins_host_memory(ctx.device)
            self.prefetcher = Prefetcher(lambda: _groups(text.make_batches(), HANDOVER),
                                         depth=max(1, config.prefetch_batches // HANDOVER), name="llama",
                                         transfer=lambda group: [tuple(t.to(ctx.device, non_blocking=True)
                                                                       for t in batch) for batch in group],
                                         prepare=(lambda group: [tuple(pin(t) for t in batch) for batch in group])
                                         if pinned else None)
            self._ready: deque = deque()
            return
        self.source = MarkovTokenSource(vocab_size, seed=config.data_seed, branching=config.data_branching)
        self.entropy_rate = self.source.entropy_rate()
        # replica groups of a fault-tolerant job each train on their own data (their gradients are averaged)
        replica = ctx.fault_tolerance.replica if ctx.fault_tolerance is not None else None
        self.train_set = self._make_batches(config.train_batches, stream=0 if replica is None else 2 + replica)
        self.eval_set = self._make_batches(config.eval_batches, stream=1)

    def _make_batches(self, count: int, stream: int) -> list[Batch]:
        """This rank's slices of the global batches; ``stream`` 1 is held out (never seen in
        training). Every rank draws the same global batches, so N ranks train on exactly the
        data one rank would, and their losses can be compared."""
        generator = torch.Generator().manual_seed(((self.ctx.seed * 1_000_003 + stream) * 1009) % 2**63)
        mine = slice(self.data_rank * self.local_batch, (self.data_rank + 1) * self.local_batch)
        batches = []
        for _ in range(count):
            inputs, targets = self.source.batch(self.config.batch_size, self.config.seq_len, generator)
            batches.append((inputs[mine].to(self.ctx.device), targets[mine].to(self.ctx.device)))
        return batches

    def next(self, cursor: int) -> tuple[Batch, float]:
        """The batch of step ``cursor`` and the seconds it waited for it (for the synthetic pool: the lookup)."""
        if self.prefetcher is not None:
            start = time.perf_counter()
            if not self._ready:  # a reader's error (a file gone bad) ends the run here, with its reason
                self._ready.extend(self.prefetcher.next()[0])
            return self._ready.popleft(), time.perf_counter() - start
        start = time.perf_counter()
        batch = self.train_set[cursor % len(self.train_set)]
        return batch, time.perf_counter() - start

    def close(self) -> None:
        """Stop the background reader, if any."""
        if self.prefetcher is not None:
            self.prefetcher.close()


def _groups(items: Iterator, size: int) -> Iterator[list]:
    """``items`` in lists of ``size`` (the last may be shorter)."""
    while group := list(itertools.islice(items, size)):
        yield group
