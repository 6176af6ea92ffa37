"""Tiny files in the real datasets' formats, written by the tests (no download, no shipped data).

Each writer makes files exactly as the dataset is distributed (names, layout, encoding), small enough
for a test; the sources under test read them as they would read the real thing.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the cat dog bird runs jumps sleeps eats over under quickly slowly red blue green big small house tree "
         "river stone light dark morning evening city field road book paper water fire wind cloud rain sun "
         "moon star garden window door table chair music song story writer reader").split()


def sentences(count: int, seed: int = 0, words: int = 12) -> list[str]:
    """Generated English-looking text: a first-order chain over a small vocabulary, so a model can learn it."""
    rng = random.Random(seed)
    successor = {w: rng.sample(WORDS, 3) for w in WORDS}
    out = []
    for _ in range(count):
        word = rng.choice(WORDS)
        text = [word]
        for _ in range(rng.randint(words // 2, words * 2)):
            word = rng.choice(successor[word])
            text.append(word)
        out.append(" ".join(text).capitalize() + ".")
    return out


def make_bpe_tokenizer(folder: Path, vocab_size: int = 256, seed: int = 0) -> Path:
    """Train a small byte-level BPE tokenizer with `tokenizers` on generated text; writes
    ``folder/tokenizer.json`` and a ``tokenizer_config.json`` naming its EOS (as a Hugging Face model
    folder does). Returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(sentences(2000, seed), trainer=trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                              "eos_token": "<|end_of_text|>"}))
    return folder


def c4_documents(count: int, seed: int = 0, words: int = 40) -> list[dict]:
    """C4-shaped records (``text``, ``timestamp``, ``url``): each text a few sentences of :func:`sentences`."""
    rng = random.Random(seed + 1)
    lines = sentences(count * 4, seed, words=words // 4 or 1)
    out = []
    for i in range(count):
        text = " ".join(lines[4 * i:4 * i + rng.randint(1, 4)])
        out.append({"text": text, "timestamp": f"2019-04-{1 + i % 28:02d}T12:00:00Z",
                    "url": f"https://example.com/{seed}/{i}"})
    return out


def write_c4(folder: Path, train_shards: range = range(768, 772), validation_shards: range = range(0, 2),
             documents_per_shard: int = 60, seed: int = 0, words: int = 40) -> Path:
    """C4's en layout: ``c4-train.XXXXX-of-01024.json.gz`` and ``c4-validation.XXXXX-of-00008.json.gz``, JSON
    lines gzipped, as AllenAI distributes them. Every document differs (its url names its shard and line)."""
    import gzip

    folder.mkdir(parents=True, exist_ok=True)
    for split, shards, total in (("train", train_shards, 1024), ("validation", validation_shards, 8)):
        for shard in shards:
            records = c4_documents(documents_per_shard, seed=seed * 100_003 + shard * 2 + (split == "train"),
                                   words=words)
            for line, record in enumerate(records):
                record["url"] = f"https://example.com/{split}/{shard}/{line}"
            with gzip.open(folder / f"c4-{split}.{shard:05d}-of-{total:05d}.json.gz", "wt", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
    return folder


def write_indexed(prefix: Path, documents: list[list[int]], dtype: str = "int32") -> Path:
    """A Megatron indexed dataset (``prefix.bin`` + ``prefix.idx``) written by megatron-core's own builder,
    one sequence per document. Returns the prefix."""
    import warnings

    import numpy as np

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.dtype(dtype).type)
    for ids in documents:
        builder.add_document(np.asarray(ids), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return prefix
