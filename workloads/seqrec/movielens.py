"""MovieLens ratings as next-item histories (``workload.data=movielens``): ML-1M and ML-20M, leave-one-out.

Files, told apart by their first line (whatever their name):

- ML-1M ``ratings.dat``: ``UserID::MovieID::Rating::Timestamp``, no header, latin-1; ratings 1–5.
- ML-20M ``ratings.csv`` (ML-25M and ML-latest share it): header ``userId,movieId,rating,timestamp``;
  half-star ratings 0.5–5.0.

``workload.data_path`` is the file or the folder holding it. The whole file is parsed, checked, sorted
and remapped when the workload is built (before any run exists), so a bad file is refused up front
(:class:`~workloads.data_source.DataError`, exit 2) and no file can go bad mid-run.

Histories. Each user's ratings in time order; ratings in the same second keep the file's order (a
stable sort). generative-recommenders sorts with pandas' default, unstable quicksort, whose order
among ties depends on the NumPy build; the file's order is the one every machine agrees on. Users
and items are remapped densely in ascending order of their ids in the file. A rating becomes the
model's action, ``ceil(rating) - 1`` (1–5 stars → 0–4; ML-20M's half stars round up): the encoder adds
the action's embedding to its item's, so a history says how much each movie was liked.

Leave-one-out, as SASRec and generative-recommenders split it: a user's last item is the test
target, the second-to-last the validation target, the rest is trained on. Users with fewer than
:data:`MIN_INTERACTIONS` ratings are left out (none in ML-1M or ML-20M: both keep users with 20 or
more). Histories longer than ``max_len`` keep their most recent ``max_len`` interactions, in training
and as evaluation prefixes.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from workloads.data_source import DataError, require_path
from workloads.seqrec.data import Histories, ranking_quality

if TYPE_CHECKING:  # pandas is imported only when a file is read
    import pandas as pd

RATINGS_FILES = ("ratings.dat", "ratings.csv")
WHERE_FROM = ("MovieLens comes from https://grouplens.org/datasets/movielens/ (ml-1m.zip holds ratings.dat, "
              "ml-20m.zip ratings.csv): unzip it and set workload.data_path to the folder or the ratings file")
ML1M_LINE = re.compile(r"^\s*\d+::\d+::\d+(\.\d+)?::\d+\s*$")
ML20M_HEADER = "userId,movieId,rating,timestamp"
NUM_ACTIONS = 5  # ceil(rating) - 1
MIN_INTERACTIONS = 4  # two to train on (one to read, one to predict), a validation and a test target
LAYOUTS = {"ml-1m": "UserID::MovieID::Rating::Timestamp lines without a header (ML-1M ratings.dat)",
           "ml-20m": f"comma-separated lines under the header {ML20M_HEADER} (ML-20M ratings.csv)"}


def ratings_file(data_path: str | Path | None) -> Path:
    """The ratings file ``workload.data_path`` names: the file itself, or the one ratings file in its folder."""
    path = require_path("data_path", data_path, "a MovieLens ratings file or its folder", WHERE_FROM)
    if path.is_file():
        return path
    found = [path / name for name in RATINGS_FILES if (path / name).is_file()]
    if not found:
        present = sorted(p.name for p in path.iterdir())[:10]
        raise DataError(f"'workload.data_path': {path} holds no MovieLens ratings file; expected one of "
                        f"{', '.join(RATINGS_FILES)} (found: {', '.join(present) or 'nothing'}). {WHERE_FROM}")
    if len(found) > 1:
        raise DataError(f"'workload.data_path': {path} holds both {' and '.join(RATINGS_FILES)}; set "
                        f"workload.data_path to the one to read")
    return found[0]


def sniff_layout(path: Path) -> str:
    """``ml-1m`` or ``ml-20m`` from the file's first line, else a DataError saying what either looks like."""
    with path.open("r", encoding="latin-1") as handle:
        first = handle.readline().rstrip("\r\n")
    if first.strip() == ML20M_HEADER:
        return "ml-20m"
    if ML1M_LINE.match(first):
        return "ml-1m"
    expected = "; or ".join(LAYOUTS.values())
    raise DataError(f"{path}: the first line {first[:80]!r} is no MovieLens ratings line; expected {expected}. "
                    f"Check the separator and the columns (an ML-1M file is '::'-separated). {WHERE_FROM}")


def parse_ratings(path: Path, layout: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(user ids, movie ids, ratings, timestamps) of every line, in file order; a DataError naming the file
    and the line for anything that is not four numbers in the layout's columns."""
    import pandas as pd

    try:
        frame = _read(path, layout, exact=True)
    except pd.errors.ParserError as err:  # a line with too many fields
        raise DataError(f"{path}: not a MovieLens ratings file ({_parser_message(err, layout)}); expected "
                        f"{LAYOUTS[layout]}, four numbers a line. {WHERE_FROM}") from err
    except ValueError:  # a missing or non-numeric field: read again as floats, where NaN marks the line
        try:
            frame = _read(path, layout, exact=False)
        except ValueError as err:
            raise DataError(f"{path}: not a MovieLens ratings file ({_parser_message(err, layout)}); expected "
                            f"{LAYOUTS[layout]}, four numbers a line. {WHERE_FROM}") from err
    header_lines = 1 if layout == "ml-20m" else 0
    if layout == "ml-1m":
        between = frame[[1, 3, 5]].notna().to_numpy().any(axis=1)
        if between.any():
            raise DataError(f"{path}: line {int(np.argmax(between)) + 1} is not '::'-separated ({between.sum()} such "
                            f"lines); expected {LAYOUTS[layout]}")
        frame = frame[[0, 2, 4, 6]]
    columns = [frame[c].to_numpy() for c in frame.columns]
    missing = np.flatnonzero(np.isnan(np.stack(columns)).any(axis=0))
    if missing.size:
        raise DataError(f"{path}: line {int(missing[0]) + 1 + header_lines} has fewer than four fields "
                        f"({missing.size} such lines); expected {LAYOUTS[layout]}. Check the separator and the columns")
    users, movies, ratings, timestamps = columns
    bad = np.flatnonzero((ratings < 0.5) | (ratings > 5))
    if bad.size:
        raise DataError(f"{path}: line {int(bad[0]) + 1 + header_lines} has rating {ratings[bad[0]]}, outside "
                        f"MovieLens' 0.5-5 stars ({bad.size} such lines); the third column is the rating")
    return users.astype(np.int64), movies.astype(np.int64), ratings, timestamps.astype(np.int64)


def _read(path: Path, layout: str, exact: bool) -> pd.DataFrame:
    """The file's columns: ids and times as int64 (``exact``: fast, but a missing field fails the whole read),
    or everything as float64 (a missing field is NaN, so its line can be named)."""
    import pandas as pd

    kinds = (np.int64, np.int64, np.float64, np.int64) if exact else (np.float64,) * 4
    if layout == "ml-1m":  # '::' read as ':' (the fast C parser takes one character): empty fields between
        dtype = {2 * k: kind for k, kind in enumerate(kinds)} | {k: np.float32 for k in (1, 3, 5)}
        options = dict(header=None, sep=":", names=list(range(7)), dtype=dtype)
    else:
        options = dict(header=0, sep=",", dtype=dict(zip(ML20M_HEADER.split(","), kinds, strict=True)))
    return pd.read_csv(path, engine="c", encoding="latin-1", **options)


def _parser_message(err: Exception, layout: str) -> str:
    """pandas' complaint in MovieLens' terms (its field counts are of ':'-separated fields in ML-1M)."""
    text = str(err).strip()
    fields = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", text)
    if fields:
        saw = int(fields[3]) // 2 + 1 if layout == "ml-1m" else int(fields[3])
        return f"line {fields[2]} has {saw} fields"
    return text.splitlines()[0] if text else type(err).__name__


@dataclass(frozen=True)
class Ratings:
    """Every kept user's ratings in time order, ids dense: user ``u``'s are ``offsets[u]:offsets[u + 1]``."""

    path: Path
    layout: str  # "ml-1m" | "ml-20m"
    offsets: np.ndarray  # [U + 1]
    items: np.ndarray  # [N] dense item ids
    actions: np.ndarray  # [N] 0 .. NUM_ACTIONS - 1
    num_items: int
    dropped_users: int  # users with fewer than MIN_INTERACTIONS ratings

    @property
    def num_users(self) -> int:
        return self.offsets.size - 1

    @property
    def num_ratings(self) -> int:
        return int(self.items.size)


def prepare_ratings(path: Path) -> Ratings:
    """Parse, check, drop too-short users, sort each user's ratings by time (ties in file order), remap."""
    layout = sniff_layout(path)
    users, movies, stars, timestamps = parse_ratings(path, layout)
    if users.size == 0:
        raise DataError(f"{path}: no ratings in the file; expected {LAYOUTS[layout]}")
    user_index, num_users = _dense(users)
    counts = np.bincount(user_index, minlength=num_users)
    keep = counts[user_index] >= MIN_INTERACTIONS
    dropped = int((counts < MIN_INTERACTIONS).sum())
    if not keep.any():
        raise DataError(f"{path}: no user has {MIN_INTERACTIONS} or more ratings (two to train on, a validation "
                        f"and a test item); is this the whole file?")
    if not keep.all():
        users, movies, stars, timestamps = users[keep], movies[keep], stars[keep], timestamps[keep]
        user_index, num_users = _dense(users)
    order = _user_time_order(user_index, timestamps)
    items, num_items = _dense(movies[order])
    offsets = np.concatenate([[0], np.cumsum(np.bincount(user_index, minlength=num_users))]).astype(np.int64)
    actions = (np.ceil(stars[order]) - 1).astype(np.int64)
    return Ratings(path, layout, offsets, items, actions, num_items, dropped)


def _dense(ids: np.ndarray) -> tuple[np.ndarray, int]:
    """``ids`` renumbered 0 .. n-1 in ascending order of id, and n. MovieLens ids are small positive numbers:
    a lookup table does it in one pass (``np.unique`` sorts, ten times slower on ML-20M); any other ids sort."""
    lowest, highest = int(ids.min()), int(ids.max())
    if lowest >= 0 and highest < max(4 * ids.size, 1 << 24):
        present = np.zeros(highest + 1, dtype=bool)
        present[ids] = True
        renumbered = np.cumsum(present) - 1
        return renumbered[ids], int(renumbered[-1]) + 1
    unique, inverse = np.unique(ids, return_inverse=True)
    return inverse.astype(np.int64), int(unique.size)


def _user_time_order(user_index: np.ndarray, timestamps: np.ndarray) -> np.ndarray:
    """The stable order by (user, time): one stable argsort of a packed key where the times fit 32 bits."""
    span = int(timestamps.max() - timestamps.min())
    if span < 2**32 and int(user_index.max()) < 2**31:
        key = (user_index.astype(np.int64) << 32) | (timestamps - timestamps.min())
        return np.argsort(key, kind="stable")
    return np.lexsort((timestamps, user_index))


@functools.lru_cache(maxsize=1)
def _prepared(path: str, size: int, mtime_ns: int) -> Ratings:
    """One preparation per file version: repetitions rebuild the workload on the same file."""
    return prepare_ratings(Path(path))


def load_ratings(data_path: str | Path | None) -> Ratings:
    """The prepared ratings ``workload.data_path`` names (see the module docstring); DataError when unusable."""
    path = ratings_file(data_path).resolve()
    stat = path.stat()
    return _prepared(str(path), stat.st_size, stat.st_mtime_ns)


class MovieLensSource:
    """The leave-one-out split of :class:`Ratings` for a ``max_len``, and the run's batches and eval sets."""

    def __init__(self, ratings: Ratings, max_len: int):
        self.ratings, self.max_len = ratings, max_len
        starts, ends = ratings.offsets[:-1], ratings.offsets[1:]
        self.train_end = ends - 2  # exclusive: the validation and test items stay out
        self.train_start = np.maximum(starts, self.train_end - max_len)
        self.train_lengths = self.train_end - self.train_start
        self._epoch_order: tuple[tuple[int, int] | None, np.ndarray] = (None, np.zeros(0, dtype=np.int64))
        self.popularity = np.bincount(ratings.items[_ranges(starts, self.train_end)], minlength=ratings.num_items)

    @property
    def num_users(self) -> int:
        return self.ratings.num_users

    def batches_per_epoch(self, batch_size: int) -> int:
        return self.num_users // batch_size  # the last, partial batch of a shuffled epoch is dropped

    def batch_users(self, seed: int, index: int, batch_size: int) -> np.ndarray:
        """Global batch ``index``'s users: a slice of its epoch's permutation of all users (seeded)."""
        epoch, position = divmod(index, self.batches_per_epoch(batch_size))
        key, order = self._epoch_order  # one tuple, read and replaced whole: the prefetch thread shares it
        if key != (seed, epoch):
            order = np.random.default_rng([seed, 1, epoch]).permutation(self.num_users)
            self._epoch_order = ((seed, epoch), order)
        return order[position * batch_size:(position + 1) * batch_size]

    def negatives(self, seed: int, index: int, count: int, num_negatives: int) -> np.ndarray:
        """Global batch ``index``'s sampled negatives, ``[count, num_negatives]``, uniform over the catalogue."""
        rng = np.random.default_rng([seed, 2, index])
        return rng.integers(self.ratings.num_items, size=(count, num_negatives))

    def train_histories(self, users: np.ndarray) -> Histories:
        """The users' training histories (all but the last two items, the most recent ``max_len``)."""
        return self._histories(self.train_start[users], self.train_end[users])

    def eval_set(self, which: str, users: np.ndarray) -> tuple[Histories, np.ndarray]:
        """(prefixes, targets) of ``which`` = ``validation`` (second-to-last item) or ``test`` (last item)."""
        target = self.ratings.offsets[1:][users] - (2 if which == "validation" else 1)
        prefixes = self._histories(np.maximum(self.ratings.offsets[:-1][users], target - self.max_len), target)
        return prefixes, self.ratings.items[target]

    def _histories(self, starts: np.ndarray, ends: np.ndarray) -> Histories:
        take = _ranges(starts, ends)
        return Histories(ends - starts, self.ratings.items[take], self.ratings.actions[take],
                         np.zeros((starts.size, 0)))

    def sample_lengths(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Training lengths drawn from the data's own (for the cost-model fit and the scaling simulation)."""
        return rng.choice(self.train_lengths, size=n)

    def popularity_quality(self, k: int = 10) -> tuple[float, float]:
        """HR@k and NDCG@k on the test targets of ranking every item by its count in the training part."""
        _, targets = self.eval_set("test", np.arange(self.num_users))
        ascending = np.sort(self.popularity)
        target_counts = self.popularity[targets]
        greater = ascending.size - np.searchsorted(ascending, target_counts, side="right")
        ties = np.searchsorted(ascending, target_counts, side="right") - np.searchsorted(ascending, target_counts)
        hits, ndcg = ranking_quality(greater, ties, k)
        return float(hits.mean()), float(ndcg.mean())

    def describe(self) -> str:
        r = self.ratings
        return (f"{r.path} ({r.layout}): {r.num_ratings} ratings, {r.num_users} users, {r.num_items} items"
                + (f", {r.dropped_users} users with fewer than {MIN_INTERACTIONS} ratings left out"
                   if r.dropped_users else ""))


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(starts[i], ends[i])``, without a Python loop."""
    lengths = ends - starts
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    shift = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return np.arange(total, dtype=np.int64) + shift
