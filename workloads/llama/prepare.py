"""``cobench data prepare c4``: C4 JSON shards → a Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

Tokenizing once here means a training run (``workload.data=megatron``) only memory-maps token ids. Documents
are read in file order (:mod:`workloads.llama.c4`) on a background thread while the tokenizer encodes the
previous block on its own threads (its batch encoding runs in Rust, outside the GIL); each document is
written with EOS appended (Megatron's ``--append-eod``) by megatron-core's ``IndexedDatasetBuilder``. The
pair is written under temporary names and renamed at the end, so a failed run leaves no half-written prefix.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from workloads.base import Progress
from workloads.data_source import DataError, require_path
from workloads.llama import c4
from workloads.llama.tokenizer import load_tokenizer

DOCS_PER_BLOCK = 1024


@dataclass
class Options:
    """``cobench data prepare c4`` options."""

    input: list[Path] = field(metadata={"help": "C4 folder(s) or .json.gz file(s)"})
    tokenizer: Path = field(metadata={"help": "tokenizer.json, or a model folder holding one (e.g. Llama 3.1 8B's)"})
    out: Path = field(metadata={"help": "output prefix: writes OUT.bin and OUT.idx"})
    split: str = field(default="train", metadata={"help": "train or validation (for input folders)"})
    shards: str | None = field(default=None, metadata={
        "help": "shards of a folder, FIRST-LAST inclusive (e.g. 768-1023); default: all present"})
    max_documents: int | None = field(default=None, metadata={
        "help": "stop after this many documents (e.g. 91205: MLPerf's validation set)"})
    reader: str = field(default="json", metadata={"help": "json (gzip + json, the faster) or datasets (Hugging Face)"})


def input_files(options: Options) -> list[Path]:
    """The files to read, in order: each folder's ``split`` shards (or ``shards``), each file as given."""
    if options.split not in c4.SPLIT_FILES:
        raise DataError(f"--split: got {options.split!r}, expected train or validation")
    if options.reader not in ("datasets", "json"):
        raise DataError(f"--reader: got {options.reader!r}, expected datasets or json")
    if options.max_documents is not None and options.max_documents < 1:
        raise DataError(f"--max-documents: got {options.max_documents}, must be >= 1")
    shards = c4.parse_shards(options.shards, options.split) if options.shards else None
    files: list[Path] = []
    for given in options.input:
        path = require_path("input", given, "a C4 folder or .json.gz file", c4.WHERE_FROM)
        files += c4.find_shards(path, options.split, shards, key="input") if path.is_dir() else [path]
    return files


def _blocks(files: list[Path], reader: str, limit: int | None) -> Iterator[list[str]]:
    texts: Iterator[str] = itertools.chain.from_iterable(c4.read_texts(f, reader) for f in files)
    if limit is not None:
        texts = itertools.islice(texts, limit)
    while block := list(itertools.islice(texts, DOCS_PER_BLOCK)):
        yield block


def _read_ahead(blocks: Iterator[list[str]], depth: int = 4) -> Iterator[list[str]]:
    """``blocks`` read on a background thread; its error is raised here."""
    ahead: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for block in blocks:
                while not stop.is_set():
                    try:
                        ahead.put(block, timeout=0.1)
                        break
                    except queue.Full:
                        continue
            ahead.put(None)
        except BaseException as err:  # noqa: BLE001 - handed over: the command fails with the reader's message
            ahead.put(err)

    thread = threading.Thread(target=produce, name="cobench-c4-read", daemon=True)
    thread.start()
    try:
        while (item := ahead.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def prepare(options: Options, progress: Progress) -> dict:
    """Tokenize the C4 files into ``options.out``.bin/.idx; returns what was written."""
    files = input_files(options)
    tokenizer = load_tokenizer(options.tokenizer, None, key="tokenizer")
    for path in files:
        c4.check_head(path)
    with warnings.catch_warnings():  # megatron-core says Transformer Engine and Apex are absent
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    out = Path(options.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    builder = IndexedDatasetBuilder(f"{partial}.bin", dtype=dtype)
    advance_docs = progress.task(f"tokenizing {len(files)} C4 file(s)", total=options.max_documents,
                                 unit="documents")
    documents = tokens = 0
    start = time.perf_counter()
    try:
        for block in _read_ahead(_blocks(files, options.reader, options.max_documents)):
            for ids in tokenizer.encode_batch(block):
                ids.append(tokenizer.eos_id)
                builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
                tokens += len(ids)
            documents += len(block)
            advance_docs(len(block))
        if not documents:
            raise DataError(f"{', '.join(map(str, options.input))}: no documents read")
        builder.finalize(f"{partial}.idx")
    except BaseException:
        builder.data_file.close()
        for suffix in (".bin", ".idx"):
            Path(f"{partial}{suffix}").unlink(missing_ok=True)
        raise
    for suffix in (".bin", ".idx"):
        os.replace(f"{partial}{suffix}", f"{out}{suffix}")
    seconds = time.perf_counter() - start
    return {"prefix": str(out), "files": len(files), "documents": documents, "tokens": tokens,
            "dtype": np.dtype(dtype).name, "eos_appended": True, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds) if seconds else None,
            "train_with": f"cobench run workload=llama workload.data=megatron workload.data_path={out} "
                          f"workload.tokenizer={options.tokenizer}"}


__all__ = ["Options", "input_files", "prepare"]
