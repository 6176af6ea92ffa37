"""Real text for Llama training: C4 tokenized on the fly, or Megatron indexed datasets, packed into sequences.

Both sources give windows of ``seq_len + 1`` tokens cut from one stream of documents joined with EOS; a
window's first ``seq_len`` tokens are the inputs, its last ``seq_len`` the targets. Consecutive windows
overlap by one token, as Megatron's ``GPTDataset`` cuts them (every token is a target exactly once).

- :class:`C4Stream`: this rank's C4 files (every ``world_size``-th of the configured shards), in an order
  shuffled per epoch by the seed, read (:mod:`workloads.llama.c4`) and tokenized (the tokenizer's batch
  encoding, on its Rust threads), windows shuffled in blocks of ``shuffle_sequences``.
- :class:`IndexedTokens`: a ``PREFIX.bin``/``PREFIX.idx`` pair read through megatron-core's ``IndexedDataset``
  (memory-mapped); windows are addressed directly, so the whole set is shuffled per epoch by the seed and
  rank ``r`` of ``W`` takes every ``W``-th window of that order.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from workloads.data_source import DataError, rank_shard, require_path
from workloads.llama.c4 import read_texts
from workloads.llama.tokenizer import TextTokenizer

WHERE_MEGATRON = ("a Megatron-LM/NeMo indexed dataset is made from C4 by `cobench data prepare c4 --input DIR "
                  "--tokenizer T --out PREFIX`, or is MLCommons' preprocessed C4 for Llama 3.1 8B "
                  "(c4-train.en_6_text_document.{bin,idx}; github.com/mlcommons/training, "
                  "small_llm_pretraining/nemo/README.md)")
DOCS_PER_ENCODE = 128  # texts per tokenizer call: enough for its threads, small enough to keep blocks coming


class Packer:
    """Token ids of consecutive documents, each followed by EOS, cut into ``(n, seq_len + 1)`` windows."""

    def __init__(self, seq_len: int, eos_id: int):
        self.seq_len, self.eos_id = seq_len, eos_id
        self._pending: list[int] = []

    def add(self, documents: list[list[int]]) -> np.ndarray:
        """The windows completed by these documents (possibly none), int32."""
        pending = self._pending
        for ids in documents:
            pending.extend(ids)
            pending.append(self.eos_id)
        count = (len(pending) - 1) // self.seq_len
        if count <= 0:
            return np.empty((0, self.seq_len + 1), dtype=np.int32)
        stream = np.asarray(pending[:count * self.seq_len + 1], dtype=np.int32)
        self._pending = pending[count * self.seq_len:]  # the last target is the next window's first input
        windows = np.lib.stride_tricks.sliding_window_view(stream, self.seq_len + 1)[::self.seq_len]
        return np.ascontiguousarray(windows)


def pack_texts(texts: Iterator[str], tokenizer: TextTokenizer, seq_len: int) -> Iterator[np.ndarray]:
    """Blocks of windows from documents in order (the tokenizer encodes ``DOCS_PER_ENCODE`` at a time)."""
    packer = Packer(seq_len, tokenizer.eos_id)
    while chunk := list(itertools.islice(texts, DOCS_PER_ENCODE)):
        windows = packer.add(tokenizer.encode_batch(chunk))
        if len(windows):
            yield windows


def first_windows(texts: Iterator[str], tokenizer: TextTokenizer, seq_len: int, count: int) -> np.ndarray:
    """The first ``count`` windows of these documents (fewer when they run out), ``(n, seq_len + 1)``."""
    blocks, have = [], 0
    for block in pack_texts(texts, tokenizer, seq_len):
        blocks.append(block)
        have += len(block)
        if have >= count:
            break
    if not blocks:
        return np.empty((0, seq_len + 1), dtype=np.int32)
    return np.concatenate(blocks)[:count]


def epoch_rng(seed: int, epoch: int, stream: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, stream])


class C4Stream:
    """Endless packed windows from this rank's C4 training files (epoch after epoch)."""

    def __init__(self, files: list[Path], tokenizer: TextTokenizer, seq_len: int, rank: int, world_size: int,
                 seed: int, shuffle_sequences: int, reader: str = "json"):
        self.files = [files[i] for i in rank_shard(len(files), rank, world_size)]
        if not self.files:
            raise DataError(f"{len(files)} C4 training file(s) cannot feed {world_size} ranks: each rank reads whole "
                            f"files; give at least {world_size} (workload.train_shards)")
        self.tokenizer, self.seq_len, self.seed = tokenizer, seq_len, seed
        self.shuffle_sequences, self.reader = shuffle_sequences, reader

    def file_order(self, epoch: int) -> list[Path]:
        return [self.files[i] for i in epoch_rng(self.seed, epoch).permutation(len(self.files))]

    def windows(self) -> Iterator[np.ndarray]:
        """Blocks of windows: read, tokenized and packed, then through a shuffle buffer of ``shuffle_sequences``
        windows (each new window takes a random slot's place, the one it displaces goes out). Blocks leave as
        each tokenizer call packs them, so the reader never stalls the trainer for a whole buffer."""
        for epoch in itertools.count():
            texts = itertools.chain.from_iterable(read_texts(f, self.reader) for f in self.file_order(epoch))
            rng = epoch_rng(self.seed, epoch, stream=1)
            held = np.empty((0, self.seq_len + 1), dtype=np.int32)
            for block in pack_texts(texts, self.tokenizer, self.seq_len):
                room = self.shuffle_sequences - len(held)
                if room > 0:  # filling the buffer
                    held, block = np.concatenate([held, block[:room]]), block[room:]
                if not len(block):
                    continue
                slots = rng.choice(len(held), size=min(len(block), len(held)), replace=False)
                out = np.concatenate([held[slots], block[len(slots):]])
                held[slots] = block[:len(slots)]
                yield out[rng.permutation(len(out))]
            if len(held):
                yield held[rng.permutation(len(held))]


class IndexedTokens:
    """A Megatron indexed dataset as one stream of tokens: each document's sequences, then EOS unless the
    documents already end with it (NeMo's and Megatron's preprocessing add it only with ``--append-eod``;
    judged on the first 1,000 documents)."""

    def __init__(self, prefix: str | Path, eos_id: int, vocab_size: int, key: str = "data_path"):
        what = "the common prefix of an indexed dataset's PREFIX.bin and PREFIX.idx"
        prefix = Path(str(require_path(key, prefix, what, WHERE_MEGATRON) if prefix in (None, "") else prefix)
                      .removesuffix(".bin").removesuffix(".idx"))
        for suffix in (".idx", ".bin"):
            require_path(key, f"{prefix}{suffix}", f"{what} ({prefix}.bin + {prefix}.idx)", WHERE_MEGATRON)
        self.prefix = prefix
        try:
            with warnings.catch_warnings():  # megatron-core says Transformer Engine and Apex are absent
                warnings.simplefilter("ignore")
                from megatron.core.datasets.indexed_dataset import IndexedDataset
        except ImportError as err:
            raise DataError("reading Megatron indexed datasets needs megatron-core: pip install --no-deps "
                            "megatron-core (installed by `nox -s tests`)") from err
        try:
            self.dataset = IndexedDataset(str(prefix), mmap=True)
        except (AssertionError, ValueError, OSError, KeyError, IndexError) as err:
            raise DataError(f"'workload.{key}': {prefix}.idx is not a Megatron indexed-dataset index or does not "
                            f"match {prefix}.bin ({type(err).__name__}: {err}); write both again together "
                            f"({WHERE_MEGATRON})") from err
        index = self.dataset.index
        lengths = index.sequence_lengths  # views of the memory-mapped index: no copy of 45 M entries per rank
        if not len(lengths):
            raise DataError(f"'workload.{key}': {prefix} holds no documents")
        itemsize = np.dtype(index.dtype).itemsize
        expected = int(index.sequence_pointers[-1]) + int(lengths[-1]) * itemsize
        actual = Path(f"{prefix}.bin").stat().st_size
        data_tokens = int(lengths.sum(dtype=np.int64))
        if expected != actual or data_tokens * itemsize != actual:
            raise DataError(f"'workload.{key}': {prefix}.idx does not match {prefix}.bin: the index describes "
                            f"{data_tokens * itemsize:,} bytes of {np.dtype(index.dtype).name} tokens ending at byte "
                            f"{expected:,}, the .bin holds {actual:,}; the pair was written separately or the .bin "
                            f"is truncated: write both again together")
        documents = self.dataset.document_indices
        ends = documents[1:1001] - 1
        self.eos_id = eos_id
        self.appends_eos = not all(int(self.dataset.get(int(i), int(lengths[i]) - 1, 1)[0]) == eos_id
                                   for i in ends if lengths[i])
        self.lengths = lengths
        if self.appends_eos:  # the stream is the .bin with EOS after each document's last sequence
            self.eos_after = np.zeros(len(lengths), dtype=bool)
            self.eos_after[documents[1:] - 1] = True
            spans = lengths.astype(np.int64) + self.eos_after
            self.starts = np.concatenate([[0], np.cumsum(spans)[:-1]])
            self.total_tokens = int(spans.sum())
        else:  # the stream is the .bin itself
            self.total_tokens = data_tokens
        # every byte of the .bin belongs to one sequence, in order (checked above): a window's tokens are one
        # slice of it, with EOS inserted where a document ends
        self._flat = np.memmap(f"{prefix}.bin", dtype=index.dtype, mode="r")
        self._itemsize = itemsize
        self._check_ids(vocab_size, key)

    def _check_ids(self, vocab_size: int, key: str) -> None:
        """Every id below the model's vocabulary (first 16 M tokens of a larger set): a larger id would index
        past the embedding."""
        head = np.memmap(f"{self.prefix}.bin", dtype=self.dataset.index.dtype, mode="r")[:1 << 24]
        largest = int(head.max()) if len(head) else 0
        if largest >= vocab_size:
            raise DataError(f"'workload.{key}': {self.prefix}.bin holds token id {largest}, but the model's vocabulary "
                            f"has {vocab_size}; set workload.vocab_size={largest + 1} (or more), or use data "
                            f"tokenized for this model")

    def window_count(self, seq_len: int) -> int:
        return max(0, (self.total_tokens - 1) // seq_len)

    def windows(self, indices: np.ndarray, seq_len: int) -> np.ndarray:
        """Windows ``indices`` (window ``i``: stream tokens ``[i * seq_len, i * seq_len + seq_len + 1)``) as
        ``(len(indices), seq_len + 1)`` integers of the file's dtype, gathered at once from the ``.bin``'s memory
        map. Where EOS is inserted, short windows place every position in its sequence at once; long ones
        (>= 1,024 tokens: few documents each) take one slice of the ``.bin`` and insert EOS into it."""
        if self.appends_eos and seq_len >= 1024:
            return np.stack([self._sliced(int(i), seq_len) for i in indices])
        positions = np.asarray(indices, dtype=np.int64)[:, None] * seq_len + np.arange(seq_len + 1)
        if not self.appends_eos:
            return self._flat[positions]
        sequence = np.searchsorted(self.starts, positions, side="right") - 1
        offset = positions - self.starts[sequence]
        at_eos = offset >= self.lengths[sequence]  # the one position past a document's last sequence
        in_bin = self.dataset.index.sequence_pointers[sequence] // self._itemsize + offset
        tokens = self._flat[np.where(at_eos, 0, in_bin)]
        tokens[at_eos] = self.eos_id
        return tokens


    def _sliced(self, index: int, seq_len: int) -> np.ndarray:
        start, end = index * seq_len, index * seq_len + seq_len + 1
        first, last = np.searchsorted(self.starts, [start, end - 1], side="right") - 1
        spanned = slice(int(first), int(last) + 1)
        eos_at = (self.starts[spanned] + self.lengths[spanned])[self.eos_after[spanned]]
        eos_at = eos_at[(eos_at >= start) & (eos_at < end)] - start  # offsets in the window
        offset = min(start - int(self.starts[first]), int(self.lengths[first]))
        begin = int(self.dataset.index.sequence_pointers[first]) // self._itemsize + offset
        data = np.asarray(self._flat[begin:begin + seq_len + 1 - len(eos_at)])
        return np.insert(data, eos_at - np.arange(len(eos_at)), self.eos_id)


class IndexedStream:
    """Endless windows of an indexed dataset for one rank: the windows ``[0, count)`` shuffled per epoch by the
    seed, rank ``r`` taking every ``world_size``-th of that order (disjoint ranks, together every window)."""

    def __init__(self, tokens: IndexedTokens, seq_len: int, count: int, rank: int, world_size: int, seed: int,
                 block: int):
        self.tokens, self.seq_len, self.count = tokens, seq_len, count
        self.rank, self.world_size, self.seed, self.block = rank, world_size, seed, block

    def order(self, epoch: int) -> np.ndarray:
        return epoch_rng(self.seed, epoch).permutation(self.count)[self.rank::self.world_size]

    def windows(self) -> Iterator[np.ndarray]:
        for epoch in itertools.count():
            mine = self.order(epoch)
            for start in range(0, len(mine), self.block):
                yield self.tokens.windows(mine[start:start + self.block], self.seq_len)


def batches(blocks: Iterator[np.ndarray], batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(inputs, targets)`` int64 CPU tensors of ``batch`` windows each, from blocks of windows (converted
    once per block: the batches are views of it)."""
    held: np.ndarray | None = None
    for block in blocks:
        if held is not None and len(held):
            block = np.concatenate([held, block.astype(held.dtype, copy=False)])
        usable = len(block) // batch * batch
        tokens = torch.from_numpy(block[:usable].astype(np.int64))
        for start in range(0, usable, batch):
            tokens_bs = tokens[start:start + batch]
            yield tokens_bs[:, :-1], tokens_bs[:, 1:]
        held = block[usable:]


def unigram_entropy(windows: np.ndarray) -> float:
    """Entropy (nats) of the targets' token frequencies: the loss of a model that knows only how often each
    token occurs. A model below it predicts from context."""
    _, counts = np.unique(windows[:, 1:], return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


__all__ = ["C4Stream", "IndexedStream", "IndexedTokens", "Packer", "batches", "first_windows", "pack_texts",
           "unigram_entropy"]
