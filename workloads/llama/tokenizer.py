"""A Hugging Face tokenizer loaded from local files (``workload.tokenizer``): the Llama 3 tokenizer in
real use, any ``tokenizer.json`` in tests. Nothing is downloaded.

``workload.tokenizer`` is a ``tokenizer.json`` file or a folder holding one (a Hugging Face model
folder: its ``tokenizer_config.json`` names the end-of-text token). Read with the ``tokenizers``
library, the same files ``transformers``' fast tokenizers load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from workloads.data_source import DataError, require_path

# end-of-text tokens of common families, tried in order when no tokenizer_config.json names one
_EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")
WHERE_FROM = ("the Llama 3 tokenizer is the tokenizer.json of a Llama 3 model folder (e.g. meta-llama/Llama-3.1-8B on "
              "Hugging Face, downloaded beforehand with `hf download ... --include tokenizer*`)")


@dataclass
class TextTokenizer:
    """Text → token ids with a local Hugging Face tokenizer; ``eos_id`` ends (joins) documents."""

    path: Path
    backend: object  # tokenizers.Tokenizer
    eos_id: int
    bos_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts at once (the Rust library spreads them over threads)."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids)


def _special_token(folder: Path | None, key: str) -> str | None:
    """The token ``tokenizer_config.json`` of a model folder names for ``key`` (``eos_token``/``bos_token``)."""
    if folder is None or not (folder / "tokenizer_config.json").is_file():
        return None
    value = json.loads((folder / "tokenizer_config.json").read_text()).get(key)
    return value.get("content") if isinstance(value, dict) else value


def load_tokenizer(path: str | Path | None, vocab_size: int | None = None, key: str = "tokenizer") -> TextTokenizer:
    """The tokenizer at ``path`` (``workload.<key>``); a :class:`DataError` when it is missing, unreadable,
    has no end-of-text token, or has more ids than the model's ``vocab_size`` (its embedding would be
    indexed out of range)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise DataError("reading text needs the `tokenizers` package: pip install -e .[data]") from err
    found = require_path(key, path, "a tokenizer.json file or a folder holding one", WHERE_FROM)
    folder = found if found.is_dir() else found.parent
    file = found / "tokenizer.json" if found.is_dir() else found
    if not file.is_file():
        listed = ", ".join(sorted(p.name for p in found.iterdir())[:10]) or "nothing"
        raise DataError(f"'workload.{key}': {found} has no tokenizer.json (it holds: {listed}); {WHERE_FROM}")
    try:
        backend = Tokenizer.from_file(str(file))
    except Exception as err:  # the Rust library raises its own Exception type for a malformed file
        raise DataError(f"'workload.{key}': {file} is not a Hugging Face tokenizer.json ({err})") from err
    size = backend.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and size > vocab_size:
        raise DataError(f"'workload.{key}': {file} has {size} token ids but the model's vocabulary has {vocab_size}; "
                        f"set workload.vocab_size={size} (or more), or use the tokenizer the model was made for")

    def token_id(names: tuple[str, ...], config_key: str) -> int | None:
        named = _special_token(folder, config_key)
        for name in ((named,) if named else ()) + names:
            found_id = backend.token_to_id(name)
            if found_id is not None:
                return found_id
        return None

    eos_id = token_id(_EOS_CANDIDATES, "eos_token")
    if eos_id is None:
        raise DataError(f"'workload.{key}': {file} has no end-of-text token (looked for the tokenizer_config.json's "
                        f"eos_token and {', '.join(_EOS_CANDIDATES)}); documents are joined with it")
    return TextTokenizer(file, backend, eos_id, token_id(_BOS_CANDIDATES, "bos_token"), size)


__all__ = ["TextTokenizer", "load_tokenizer"]
