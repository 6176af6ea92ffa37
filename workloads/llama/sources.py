"""The real-text sources of ``workload=llama`` (``workload.data=c4|megatron``), opened and checked in one place.

:func:`open_text_source` runs while the workload is built (before any MLflow run exists): every path, file,
tokenizer and size the run depends on is checked there, and the evaluation windows are read, so a bad input
exits 2. Training windows are then made on a background thread (:class:`workloads.data_source.Prefetcher`).

The MLPerf recipes (``workload.data_recipe``) hold what MLPerf's Llama 3.1 reference sets for its data; a
config value left null takes the recipe's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from workloads.base import RunContext
from workloads.base import invalid_config as _invalid
from workloads.data_source import DataError, rank_shard, require_path
from workloads.llama import c4
from workloads.llama.config import LlamaConfig
from workloads.llama.recipes import Recipe, recipe_of
from workloads.llama.text_data import (
    C4Stream,
    IndexedStream,
    IndexedTokens,
    batches,
    first_windows,
    unigram_entropy,
)
from workloads.llama.tokenizer import TextTokenizer, load_tokenizer


@dataclass
class TextSource:
    """What the workload uses of an opened real source."""

    kind: str
    make_batches: Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]]  # this rank's, endless
    eval_windows: np.ndarray  # this rank's share of the evaluation windows, (n, seq_len + 1)
    eval_sequences: int  # all ranks' evaluation windows
    train_sequences: int  # windows in one pass over the training data; 0 when unknown (a C4 stream)
    target: float
    target_from: str  # where the target comes from: "config", the recipe, or "unigram entropy"
    recipe: Recipe | None
    details: dict[str, str]


def _eval_share(windows: np.ndarray, ctx: RunContext) -> np.ndarray:
    return windows[np.asarray(rank_shard(len(windows), ctx.rank, ctx.world_size), dtype=np.int64)]


def _too_few(what: str, have: int, want: int, seq_len: int) -> DataError:
    return DataError(f"{what} gives {have} evaluation sequences of {seq_len} tokens, the run evaluates {want}: "
                     f"set workload.eval_sequences={have} or less, or give more validation data")


C4_FOLDER = "the C4 folder (c4-train.XXXXX-of-01024.json.gz, c4-validation.XXXXX-of-00008.json.gz)"


def open_text_source(cfg: LlamaConfig, ctx: RunContext, local_batch: int, vocab_size: int) -> TextSource:
    """Open and check ``workload.data`` (c4 or megatron) for this rank; a :class:`DataError` names what is wrong."""
    recipe = recipe_of(cfg.data_recipe)
    eval_sequences = cfg.eval_sequences or (recipe.eval_sequences if recipe else cfg.eval_batches * cfg.batch_size)
    if eval_sequences < ctx.world_size:
        raise _invalid("eval_sequences", f"{eval_sequences} cannot be shared by {ctx.world_size} ranks")
    if cfg.data == "c4":  # the data before the tokenizer: a missing folder is the first thing to say
        require_path("data_path", cfg.data_path, C4_FOLDER, c4.WHERE_FROM)
    elif not cfg.data_path:
        IndexedTokens(cfg.data_path, 0, vocab_size)  # says what workload.data_path should be
    tokenizer = load_tokenizer(cfg.tokenizer, vocab_size)
    # replica groups of a fault-tolerant job each train on their own order of the data
    seed = ctx.seed if ctx.fault_tolerance is None else ctx.seed + 7919 * (1 + ctx.fault_tolerance.replica)
    opened = _open_c4 if cfg.data == "c4" else _open_megatron
    make, windows, train_sequences, details = opened(cfg, ctx, recipe, tokenizer, eval_sequences, local_batch,
                                                     seed, vocab_size)
    if cfg.eval_loss_target is not None:
        target, target_from = cfg.eval_loss_target, "config"
    elif recipe is not None:
        target, target_from = recipe.eval_loss_target, f"recipe {cfg.data_recipe}"
    else:
        target, target_from = unigram_entropy(windows), "unigram entropy of the evaluation tokens"
    return TextSource(cfg.data, make, _eval_share(windows, ctx), eval_sequences, train_sequences, target,
                      target_from, recipe, {"data": cfg.data, "tokenizer": str(tokenizer.path), **details})


def _open_c4(cfg: LlamaConfig, ctx: RunContext, recipe: Recipe | None, tokenizer: TextTokenizer, eval_sequences: int,
             local_batch: int, seed: int, vocab_size: int) -> tuple:
    """This rank's training files, checked; the evaluation windows: the first of the validation documents."""
    folder = require_path("data_path", cfg.data_path, C4_FOLDER, c4.WHERE_FROM)
    shards = cfg.train_shards or (recipe.train_shards if recipe else None)
    train_files = c4.find_shards(folder, "train", c4.parse_shards(shards) if shards else None)
    val_folder = require_path("val_data_path", cfg.val_data_path, "a folder of C4 validation files",
                              c4.WHERE_FROM) if cfg.val_data_path else folder
    val_files = c4.find_shards(val_folder, "validation", None,
                               key="val_data_path" if cfg.val_data_path else "data_path")
    stream = C4Stream(train_files, tokenizer, cfg.seq_len, ctx.rank, ctx.world_size, seed, cfg.shuffle_sequences,
                      cfg.c4_reader)
    budget = {"auto": c4.FULL_CHECK_BYTES, "full": float("inf"), "head": -1}[cfg.data_check]
    checked = c4.check_files(stream.files + val_files, budget)
    val_documents = cfg.val_documents or (recipe.val_documents if recipe else None)
    texts = (text for f in val_files for text in c4.read_texts(f, cfg.c4_reader))
    windows = first_windows(itertools.islice(texts, val_documents), tokenizer, cfg.seq_len, eval_sequences)
    if len(windows) < eval_sequences:
        raise _too_few(f"{val_folder}: the validation files' first {val_documents or 'all'} documents",
                       len(windows), eval_sequences, cfg.seq_len)
    details = {"checked": checked, "train_files": str(len(train_files)), "rank_files": str(len(stream.files))}
    return (lambda: batches(stream.windows(), local_batch)), windows, 0, details


def _open_megatron(cfg: LlamaConfig, ctx: RunContext, recipe: Recipe | None, tokenizer: TextTokenizer,
                   eval_sequences: int, local_batch: int, seed: int, vocab_size: int) -> tuple:
    """The training prefix, checked; the evaluation windows: the validation prefix's first, or the training
    set's last (then held out of training)."""
    train = IndexedTokens(cfg.data_path, tokenizer.eos_id, vocab_size)
    total = train.window_count(cfg.seq_len)
    if cfg.val_data_path:
        val = IndexedTokens(cfg.val_data_path, tokenizer.eos_id, vocab_size, key="val_data_path")
        if val.window_count(cfg.seq_len) < eval_sequences:
            raise _too_few(f"{val.prefix}", val.window_count(cfg.seq_len), eval_sequences, cfg.seq_len)
        windows, train_sequences = val.windows(np.arange(eval_sequences), cfg.seq_len), total
        validation = str(val.prefix)
    else:
        train_sequences = total - eval_sequences
        windows = train.windows(np.arange(max(0, train_sequences), total), cfg.seq_len)
        validation = f"held out: the last {eval_sequences} sequences of {train.prefix}"
    if train_sequences < cfg.batch_size:
        held = "" if cfg.val_data_path else f" once {eval_sequences} are held out for evaluation"
        raise DataError(f"'workload.data_path': {train.prefix} gives {train_sequences} sequences of {cfg.seq_len} "
                        f"tokens{held}, fewer than one batch of {cfg.batch_size}; give more data, name a "
                        f"validation set (workload.val_data_path) or lower workload.eval_sequences")
    stream = IndexedStream(train, cfg.seq_len, train_sequences, ctx.rank, ctx.world_size, seed,
                           block=max(local_batch, 256))
    details = {"validation": validation, "appends_eos": str(train.appends_eos), "train_prefix": str(train.prefix)}
    return (lambda: batches(stream.windows(), local_batch)), windows, train_sequences, details


__all__ = ["TextSource", "open_text_source"]
