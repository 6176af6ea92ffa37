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
