"""Real prompts for serving: a JSON lines file of queries (``workload.prompts``), checked and tokenized once.

One JSON object per line (blank lines are skipped); a file whose first character is ``[`` is read as
one JSON array of such objects, the layout of MLPerf's ``cnn_eval.json``. Each object is one query:

- **the prompt**, token ids or text. Token ids win when a line has both, because MLPerf's ``tok_input``
  is the templated prompt its reference serves, while its ``input`` is the bare article:

  ============================================  ================================================
  token ids (lists of ints)                     ``tok_input`` (MLPerf), ``input_ids``, ``tokens``
  text (tokenized with ``workload.tokenizer``)  ``prompt``, ``text``, ``input`` (MLPerf)
  ============================================  ================================================

  Text is encoded with the tokenizer's BOS first when it has one (as a Hugging Face Llama tokenizer
  encodes a prompt); token ids are served as given.
- **the new-token budget**, first found of: ``max_new_tokens`` or ``max_tokens`` (an int); the length
  of a reference answer as token ids (``tok_ref_output``, ``tok_output``) or as text (``ref_output``,
  ``output`` — MLPerf's reference summary — counted with the tokenizer); else ``workload.output_max``.
  A reference answer's length stands in for the answer a real model would give: the file's own
  output-length distribution, not one fixed budget.

Every query must fit the model's context (prompt + budget tokens). A prompt that does not is refused
with its line (the default): the file's length distribution is what the benchmark measures, and
cutting prompts would change it unseen. ``workload.truncate_prompts=true`` instead keeps the last
tokens of each such prompt (the question of a templated prompt comes last) and reports how many
were cut (metric ``prompts_truncated``).

Every problem is a :class:`~workloads.data_source.DataError` naming the file, the line and what to do,
raised while the workload is built, so a bad file stops the command before any run exists.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from workloads.data_source import DataError, require_path
from workloads.llama.tokenizer import TextTokenizer, load_tokenizer
from workloads.llama_infer.data import RequestSet

TOKEN_PROMPT_FIELDS = ("tok_input", "input_ids", "tokens")
TEXT_PROMPT_FIELDS = ("prompt", "text", "input")
BUDGET_FIELDS = ("max_new_tokens", "max_tokens")
TOKEN_ANSWER_FIELDS = ("tok_ref_output", "tok_output")
TEXT_ANSWER_FIELDS = ("ref_output", "output")
WHERE_FROM = ("a JSON lines file of prompts, one object per line such as {\"prompt\": \"...\"} or {\"input_ids\": "
              "[...], \"max_new_tokens\": 64}; MLPerf's Llama 3.1 8B set is cnn_eval.json (CNN/DailyMail), from "
              "MLCommons' downloader (see language/llama3.1-8b in mlcommons/inference)")


@dataclass(frozen=True)
class PromptSet:
    """The queries of a prompts file, tokenized and fitted to the context."""

    path: Path
    requests: RequestSet
    truncated: int  # prompts cut from the left to fit the context (truncate_prompts)


@dataclass
class _Query:
    """One line as read, before tokenizing: where it is, and each part as ids, text or absent."""

    where: str
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    prompt_field: str = ""
    budget: int | None = None
    answer_ids: list[int] | None = None
    answer_text: str | None = None


def _records(path: Path) -> Iterator[tuple[str, object]]:
    """``(where, value)`` of every record: ``line N`` of a JSON lines file, ``element N`` of a JSON array."""
    try:
        with path.open(encoding="utf-8") as file:
            head = file.read(4096).lstrip()
            file.seek(0)
            if head.startswith("["):
                try:
                    values = json.load(file)
                except json.JSONDecodeError as err:
                    raise DataError(f"'workload.prompts': {path} starts as a JSON array but is not valid JSON "
                                    f"(line {err.lineno}: {err.msg}); write one JSON object per line instead") from err
                yield from ((f"element {i} of its JSON array", value) for i, value in enumerate(values, 1))
                return
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"'workload.prompts': {path} line {number} is not JSON ({err.msg}, column "
                                    f"{err.colno}); each line must be one JSON object such as {{\"prompt\": \"...\"}}"
                                    ) from err
                yield f"line {number}", value
    except UnicodeDecodeError as err:
        raise DataError(f"'workload.prompts': {path} is not UTF-8 text ({err.reason} at byte {err.start}); "
                        "give a JSON lines file") from err


def _ids(path: Path, where: str, field: str, value: object) -> list[int]:
    if not isinstance(value, list):
        raise DataError(f"'workload.prompts': {path} {where}: '{field}' must be a list of token ids (integers), "
                        f"got {type(value).__name__}")
    kinds = set(map(type, value))  # type, not isinstance: JSON's true/false are not token ids
    if not kinds <= {int}:
        others = ", ".join(sorted(k.__name__ for k in kinds - {int}))
        raise DataError(f"'workload.prompts': {path} {where}: '{field}' must be a list of token ids (integers), "
                        f"it holds {others}")
    return value


def _text(path: Path, where: str, field: str, value: object) -> str:
    if not isinstance(value, str):
        raise DataError(f"'workload.prompts': {path} {where}: '{field}' must be text (a JSON string), "
                        f"got {type(value).__name__}")
    return value


def _parse(path: Path, where: str, record: object) -> _Query:
    """One record's prompt and budget fields, type-checked (see the module docstring for the order)."""
    if not isinstance(record, dict):
        raise DataError(f"'workload.prompts': {path} {where} is a JSON {type(record).__name__}, not an object; each "
                        "line must be one JSON object such as {\"prompt\": \"...\"}")
    query = _Query(where)
    token_field = next((f for f in TOKEN_PROMPT_FIELDS if f in record), None)
    text_field = next((f for f in TEXT_PROMPT_FIELDS if f in record), None)
    if token_field is not None:
        query.prompt_ids, query.prompt_field = _ids(path, where, token_field, record[token_field]), token_field
    elif text_field is not None:
        query.prompt_text, query.prompt_field = _text(path, where, text_field, record[text_field]), text_field
    else:
        keys = ", ".join(sorted(record)[:10]) or "none"
        raise DataError(f"'workload.prompts': {path} {where} has no prompt (its keys: {keys}); give token ids as one "
                        f"of {', '.join(TOKEN_PROMPT_FIELDS)} or text as one of {', '.join(TEXT_PROMPT_FIELDS)}")
    budget_field = next((f for f in BUDGET_FIELDS if f in record), None)
    answer_ids_field = next((f for f in TOKEN_ANSWER_FIELDS if f in record), None)
    answer_text_field = next((f for f in TEXT_ANSWER_FIELDS if f in record), None)
    if budget_field is not None:
        budget = record[budget_field]
        if not (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1):
            raise DataError(f"'workload.prompts': {path} {where}: '{budget_field}' must be a whole number of new "
                            f"tokens >= 1, got {budget!r}")
        query.budget = budget
    elif answer_ids_field is not None:
        query.answer_ids = _ids(path, where, answer_ids_field, record[answer_ids_field])
    elif answer_text_field is not None:
        query.answer_text = _text(path, where, answer_text_field, record[answer_text_field])
    return query


def _check_vocabulary(path: Path, queries: list[_Query], vocab_size: int) -> None:
    """Every prompt id must index the model's embedding; the error names the first line out of range and the
    file's largest id, so one change of ``vocab_size`` covers the whole file."""
    first: tuple[_Query, int] | None = None
    largest = -1
    for query in queries:
        assert query.prompt_ids is not None  # _parse set ids or text, and _encode turned the text into ids
        if 0 <= min(query.prompt_ids) and max(query.prompt_ids) < vocab_size:  # min/max: C speed on big files
            continue
        bad = next((i for i in query.prompt_ids if not 0 <= i < vocab_size), None)
        if bad is not None:
            first = first or (query, bad)
            largest = max(largest, *query.prompt_ids)
    if first is not None:
        query, bad = first
        if bad < 0:
            raise DataError(f"'workload.prompts': {path} {query.where}: token id {bad} in '{query.prompt_field}' is "
                            "negative; token ids count from 0: fix the file")
        raise DataError(f"'workload.prompts': {path} {query.where}: token id {bad} in '{query.prompt_field}' is "
                        f"outside the model's vocabulary of {vocab_size} ids; the file's ids come from a tokenizer "
                        f"with a larger vocabulary: set workload.vocab_size={largest + 1} (or the model's real size, "
                        "128256 for Llama 3), or give text prompts with workload.tokenizer")


def _tokenizer_needed(path: Path, query: _Query) -> DataError:
    part = f"a text prompt ('{query.prompt_field}')" if query.prompt_text is not None else "a reference answer as text"
    return DataError(f"'workload.prompts': {path} {query.where} has {part} but workload.tokenizer is not set: set "
                     "workload.tokenizer=<folder or tokenizer.json> (the model's tokenizer), or give token ids "
                     f"({', '.join(TOKEN_PROMPT_FIELDS)}) and a budget ({', '.join(BUDGET_FIELDS)})")


def load_prompts(path: str | Path | None, tokenizer_path: str | Path | None, vocab_size: int, context: int,
                 default_budget: int, truncate: bool) -> PromptSet:
    """The queries of ``path`` (``workload.prompts``) as token ids and budgets that fit ``context`` tokens.

    ``tokenizer_path`` (``workload.tokenizer``) encodes text prompts and counts text answers; queries
    without a budget get ``default_budget``; ``truncate`` cuts over-long prompts from the left instead
    of refusing them. Any problem is a :class:`DataError` naming the file and line."""
    file = require_path("prompts", path, "a JSON lines file of prompts", WHERE_FROM)
    if not file.is_file():
        raise DataError(f"'workload.prompts': {file} is a folder; give the JSON lines file itself ({WHERE_FROM})")
    tokenizer: TextTokenizer | None = None
    if tokenizer_path is not None:
        tokenizer = load_tokenizer(tokenizer_path, vocab_size)
    queries = [_parse(file, where, record) for where, record in _records(file)]
    if not queries:
        raise DataError(f"'workload.prompts': {file} holds no prompts (it is empty); give {WHERE_FROM}")
    if tokenizer is None:
        unreadable = next((q for q in queries if q.prompt_text is not None or q.answer_text is not None), None)
        if unreadable is not None:
            raise _tokenizer_needed(file, unreadable)
    else:
        _encode(queries, tokenizer)
    return _fit(file, queries, vocab_size, context, default_budget, truncate)


def _encode(queries: list[_Query], tokenizer: TextTokenizer) -> None:
    """Tokenize every text prompt (BOS first, when the tokenizer has one) and text answer, in batches."""
    prompts = [q for q in queries if q.prompt_text is not None]
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    for query, ids in zip(prompts, tokenizer.encode_batch([q.prompt_text for q in prompts]), strict=True):
        query.prompt_ids = bos + ids
    answers = [q for q in queries if q.answer_text is not None]
    for query, ids in zip(answers, tokenizer.encode_batch([q.answer_text for q in answers]), strict=True):
        query.answer_ids = ids


def _fit(file: Path, queries: list[_Query], vocab_size: int, context: int, default_budget: int,
         truncate: bool) -> PromptSet:
    """Budgets resolved, ids checked against the vocabulary, every query fitted to ``context``."""
    prompts: list[list[int]] = []
    budgets: list[int] = []
    too_long: list[tuple[_Query, int, int]] = []  # (query, prompt tokens, budget)
    empty = next((q for q in queries if not q.prompt_ids), None)
    if empty is not None:
        raise DataError(f"'workload.prompts': {file} {empty.where}: the prompt ('{empty.prompt_field}') is empty; "
                        "every query needs at least one prompt token")
    _check_vocabulary(file, queries, vocab_size)
    for query in queries:
        ids = query.prompt_ids
        assert ids is not None
        if query.budget is not None:
            budget = query.budget
        elif query.answer_ids is not None:
            budget = max(len(query.answer_ids), 1)  # an empty reference answer still gets its first token
        else:
            budget = default_budget
        if budget >= context:
            raise DataError(f"'workload.prompts': {file} {query.where}: a budget of {budget} new tokens leaves no room "
                            f"for a prompt in the model's context of {context} tokens; lower it or raise "
                            "workload.max_seq_len")
        if len(ids) + budget > context:
            too_long.append((query, len(ids), budget))
            if truncate:
                ids = ids[len(ids) + budget - context:]  # keep the end: a template's question comes last
        prompts.append(ids)
        budgets.append(budget)
    if too_long and not truncate:
        query, length, budget = too_long[0]
        longest = max(n + b for _, n, b in too_long)
        raise DataError(
            f"'workload.prompts': {file} {query.where}: a prompt of {length} tokens plus {budget} new tokens exceeds "
            f"the model's context of {context} tokens ({len(too_long)} of {len(queries)} queries do; the longest needs "
            f"{longest}): raise workload.max_seq_len to at least {longest}, or set workload.truncate_prompts=true to "
            "keep the last tokens of each such prompt")
    return PromptSet(file, RequestSet(prompts, budgets), len(too_long))


__all__ = ["BUDGET_FIELDS", "TEXT_ANSWER_FIELDS", "TEXT_PROMPT_FIELDS", "TOKEN_ANSWER_FIELDS", "TOKEN_PROMPT_FIELDS",
           "PromptSet", "load_prompts"]
