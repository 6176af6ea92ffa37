"""C4 as AllenAI distributes it: finding the shards, checking them, reading their documents' text.

The ``allenai/c4`` ``en`` variant is a folder of gzipped JSON-lines files, ``c4-train.XXXXX-of-01024.json.gz``
and ``c4-validation.XXXXX-of-00008.json.gz``, one document a line with ``text``, ``timestamp`` and ``url``.
Documents are read one file at a time (so an error names its file) by the standard library's gzip + json, line
by line, or by Hugging Face ``datasets`` (its JSON builder on local files, ``streaming=True``); see
:func:`read_texts` for the measured choice.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

from workloads.data_source import DataError, cache_dir

TRAIN_FILES, VALIDATION_FILES = 1024, 8  # shards of the en variant
SPLIT_FILES = {"train": TRAIN_FILES, "validation": VALIDATION_FILES}
WHERE_FROM = ("C4 is the allenai/c4 dataset on Hugging Face, `en` variant (e.g. `hf download allenai/c4 --repo-type "
              "dataset --include 'en/c4-train.0076*' 'en/c4-validation.*'`), or MLCommons' copy for the Llama 3.1 "
              "benchmark (github.com/mlcommons/training, small_llm_pretraining/nemo/README.md)")
FULL_CHECK_BYTES = 64 << 20  # files the run reads are verified line by line up front when they total this or less


def shard_name(split: str, index: int) -> str:
    """The distributed name of shard ``index`` of ``split``, e.g. ``c4-train.00768-of-01024.json.gz``."""
    return f"c4-{split}.{index:05d}-of-{SPLIT_FILES[split]:05d}.json.gz"


def parse_shards(text: str, split: str = "train") -> range:
    """``"768-1023"`` (inclusive) or ``"5"`` as a range of shard indices; ValueError when malformed."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if match is None:
        raise ValueError(f"got {text!r}, expected FIRST-LAST (inclusive, e.g. 768-1023) or one shard number")
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) is not None else first
    if not 0 <= first <= last < SPLIT_FILES[split]:
        raise ValueError(f"got {text!r}: C4 {split} shards are numbered 0-{SPLIT_FILES[split] - 1}, first <= last")
    return range(first, last + 1)


def find_shards(folder: Path, split: str, shards: range | None, key: str = "data_path") -> list[Path]:
    """The ``split`` files of ``folder``, in shard order: every one of ``shards`` (each must be there), or,
    with ``shards`` None, every shard present (at least one). A :class:`DataError` lists what was expected."""
    if not folder.is_dir():
        raise DataError(f"'workload.{key}': {folder} is not a folder; expected the C4 folder holding "
                        f"{shard_name(split, 0)} ... ({WHERE_FROM})")
    pattern = re.compile(rf"c4-{split}\.(\d{{5}})-of-{SPLIT_FILES[split]:05d}\.json\.gz")
    present = {int(m.group(1)): p for p in folder.iterdir() if (m := pattern.fullmatch(p.name))}
    if shards is None:
        if not present:
            raise DataError(f"'workload.{key}': {folder} has no C4 {split} files: expected "
                            f"{shard_name(split, 0)} ... {shard_name(split, SPLIT_FILES[split] - 1)} "
                            f"(the en variant's layout, JSON lines gzipped); {WHERE_FROM}")
        return [present[i] for i in sorted(present)]
    missing = [i for i in shards if i not in present]
    if missing:
        examples = ", ".join(shard_name(split, i) for i in missing[:3]) + (" ..." if len(missing) > 3 else "")
        raise DataError(f"'workload.{key}': {folder} lacks {len(missing)} of the {len(shards)} C4 {split} files the "
                        f"run reads ({shard_name(split, shards[0])} to {shard_name(split, shards[-1])}): missing "
                        f"{examples}. Download them, or choose the shards present with workload.train_shards; "
                        f"{WHERE_FROM}")
    return [present[i] for i in shards]


def _bad_line(path: Path, line: int, what: str) -> DataError:
    return DataError(f"{path}: line {line} {what}; every line of a C4 file is a JSON object with a \"text\" string. "
                     f"Download the file again or leave it out")


def _bad_gzip(path: Path, err: BaseException) -> DataError:
    return DataError(f"{path}: not a complete gzip file ({type(err).__name__}: {err}); it may be truncated "
                     f"(an interrupted download): download it again, or leave it out")


def check_head(path: Path) -> None:
    """The gzip header and the first line's JSON ``text``: what a large file is checked for up front."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as stream:
            first = stream.readline()
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as err:
        raise _bad_gzip(path, err) from err
    _text_of(path, 1, first)


def _text_of(path: Path, line: int, raw: str) -> str:
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as err:
        raise _bad_line(path, line, f"is not JSON ({err})") from err
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise _bad_line(path, line, "has no \"text\" string")
    return text


def check_fully(path: Path) -> int:
    """Decompress ``path`` to its end and parse every line: a truncated file, a line that is not JSON or
    has no ``text`` is a :class:`DataError` naming the file (and line). Returns the documents it holds.
    A file that passed is remembered (by size and modification time) under :func:`cache_dir`."""
    stat = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    marker = cache_dir() / "c4-checked" / digest
    if marker.is_file():
        return int(marker.read_text())
    documents = 0
    try:
        with gzip.open(path, "rt", encoding="utf-8") as stream:
            for documents, raw in enumerate(stream, 1):
                _text_of(path, documents, raw)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as err:
        raise _bad_gzip(path, err) from err
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(documents))
    except OSError:  # a read-only home: the check is simply repeated next time
        pass
    return documents


def check_files(paths: list[Path], full_check_bytes: float = FULL_CHECK_BYTES) -> str:
    """Check the files a run will read before it starts: every line of every file when they total at most
    ``full_check_bytes`` (compressed), else each file's gzip header and first line (a file that goes bad
    further on then ends the run FAILED with the reason, from the reader). Returns which check ran."""
    if sum(p.stat().st_size for p in paths) <= full_check_bytes:
        for path in paths:
            check_fully(path)
        return "full"
    for path in paths:
        check_head(path)
    return "head"


def read_texts(path: Path, reader: str = "json") -> Iterator[str]:
    """The documents' text in one C4 file, in file order. ``reader``: ``json`` (the standard library's gzip +
    json, line by line) or ``datasets`` (Hugging Face's JSON builder, streamed). Errors name the file.

    ``json`` is the default: it spends about a third of ``datasets``' CPU time per character (interleaved runs on
    this project's 2-core CPU: 95-119 M characters per CPU-second against 30-38 M; benchmarks/bench_llama_data.py)
    — ``datasets`` parses every column into Arrow, converts the text back to Python strings and reads each
    file's first 10 MB twice to learn its columns. Tokenizing costs more than either, but it spreads over the
    tokenizer's threads while reading is single-threaded, so reading bounds the pipeline on many cores."""
    if reader == "json":
        yield from _read_texts_json(path)
        return
    import datasets

    datasets.disable_progress_bars()
    line = 0
    try:  # the builder reads the file's first block to learn its columns: errors can come from here on
        stream = datasets.load_dataset("json", data_files=[str(path)], split="train", streaming=True)
        stream = stream.select_columns(["text"]) if "text" in (stream.column_names or ["text"]) else stream
        for batch in stream.iter(batch_size=1024):
            texts = batch.get("text")
            if texts is None:
                raise _bad_line(path, line + 1, "has no \"text\" string")
            for text in texts:
                line += 1
                if not isinstance(text, str):
                    raise _bad_line(path, line, "has no \"text\" string")
                yield text
    except DataError:
        raise
    except (OSError, EOFError, zlib.error) as err:
        raise _bad_gzip(path, err) from err
    except Exception as err:  # datasets wraps Arrow's parse errors in its own types
        raise DataError(f"{path}: cannot be read as C4 JSON lines after document {line} ({type(err).__name__}: "
                        f"{err}); download the file again or leave it out") from err


def _read_texts_json(path: Path) -> Iterator[str]:
    try:
        with gzip.open(path, "rt", encoding="utf-8") as stream:
            for line, raw in enumerate(stream, 1):
                yield _text_of(path, line, raw)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as err:
        raise _bad_gzip(path, err) from err


__all__ = ["WHERE_FROM", "check_files", "check_fully", "check_head", "find_shards", "parse_shards", "read_texts",
           "shard_name"]
