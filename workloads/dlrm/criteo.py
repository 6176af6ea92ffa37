"""MLPerf's preprocessed Criteo 1TB, one-hot or multi-hot, as :class:`~workloads.dlrm.data.ClickBatch` es.

The layout is what TorchRec's preprocessing (``torchrec.datasets.scripts``, run by MLPerf's
``process_Criteo_1TB_Click_Logs_dataset.sh``) and MLPerf's ``materialize_synthetic_multihot_dataset.py``
write, one set of files per day ``d``:

- ``day_{d}_dense.npy``: ``[rows, 13]`` float32, already ``log``-transformed;
- ``day_{d}_labels.npy``: ``[rows, 1]`` int32 click labels;
- ``day_{d}_sparse.npy``: ``[rows, 26]`` int32 (int64 for the unshuffled last day) contiguous ids, one-hot;
- ``day_{d}_sparse_multi_hot.npz`` (the DCNv2 benchmark's input): arrays ``"0"`` … ``"25"``, each
  ``[rows, multi_hot_size_k]`` int32, stored uncompressed (``np.savez``) so they are read in place.

Split, as the reference's loader (``InMemoryBinaryCriteoIterDataPipe`` with stage train/val/test): the
days ``0 … K-2`` train, the last day ``K-1`` (day 23 of the full set) is cut in two, its first
``ceil(rows / 2)`` rows validate, the rest test. With fewer days present (test-sized data) the last day
present plays day 23's part; the days must run ``day_0`` … ``day_{K-1}`` without a gap, ``K >= 2``.

Sharding: training walks the train days in file order (the preprocessing shuffled them) in whole
global batches; rank ``r`` of ``W`` reads rows ``[r * B/W, (r + 1) * B/W)`` of each global batch, so the
ranks' shares are disjoint and together every whole global batch (a tail of fewer than one global batch
is left out each epoch, as ``drop_last``). Validation splits its rows into one contiguous range per rank
with TorchRec's ``BinaryCriteoUtils.get_file_row_ranges_and_remainder`` (sizes differ by at most one), so
the ranks together evaluate every row. Reading is ``pread`` at computed offsets, never ``mmap``
(:mod:`workloads.dlrm.stored_arrays`): a file truncated while training gives a :class:`DataError` naming it.

Ids: a table cut to ``max_table_rows`` (MLPerf's 40M cap) takes its ids modulo its rows, as the reference
passes ``hashes=num_embeddings_per_feature`` to TorchRec's reader; any other table must hold every id.
That is checked over the whole files before the run (:func:`id_ranges`: a chunked scan whose result is
kept per file size + mtime, or read from the ``criteo_manifest.json`` that ``cobench data prepare criteo``
writes), and again for every batch as it is read.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from workloads.data_source import DataError, cache_dir, require_path
from workloads.dlrm.config import DLRMConfig
from workloads.dlrm.data import ClickBatch
from workloads.dlrm.stored_arrays import StoredArray, npz_member_count, open_npy, open_npz

if TYPE_CHECKING:
    from workloads.dlrm.model import DLRMShape

# MLPerf Training's quality target for DLRM-DCNv2 on this data: validation AUROC 0.80275 within one
# epoch (mlcommons/training recommendation_v2/torchrec_dlrm/README.MD, "Running the MLPerf DLRM v2
# benchmark": "The proposed target AUROC to reach within one epoch is 0.80275").
MLPERF_AUC_TARGET = 0.80275
MANIFEST = "criteo_manifest.json"  # what `cobench data prepare criteo` records about the files it wrote
WHERE_FROM = ("Criteo 1TB comes from https://ailab.criteo.com/ressources/criteo-1tb-click-logs-dataset-for-mlperf "
              "(raw day_0 … day_23 TSV files: turn them into this layout with `cobench data prepare criteo`), or "
              "preprocessed from MLCommons (see mlcommons/training recommendation_v2/torchrec_dlrm/README.MD)")
_SCAN_ROWS = 1 << 20  # rows per read of the full id scan


@dataclass
class CriteoDay:
    """One day's arrays; ``sparse`` is one ``[rows, 26]`` array (one-hot) or one array per feature."""

    index: int
    dense: StoredArray
    labels: StoredArray
    sparse: list[StoredArray]

    @property
    def one_hot(self) -> bool:
        return self.sparse[0].path.suffix == ".npy"

    @property
    def hot(self) -> list[int]:
        """Ids per sample of each feature."""
        return [1] * self.sparse[0].width if self.one_hot else [array.width for array in self.sparse]

    @property
    def rows(self) -> int:
        return self.dense.rows



def find_days(folder: Path, sparse_kind: str) -> list[CriteoDay]:
    """The days ``day_0`` … ``day_{K-1}`` in ``folder`` (headers read, sizes checked, no data read)."""
    sparse_suffix = "sparse_multi_hot.npz" if sparse_kind == "multi_hot" else "sparse.npy"
    expected = f"day_{{d}}_dense.npy, day_{{d}}_labels.npy and day_{{d}}_{sparse_suffix} for d = 0, 1, …"
    if not folder.is_dir():
        raise DataError(f"'workload.data_path': {folder} is not a folder; expected one holding {expected}. "
                        f"{WHERE_FROM}")
    count = 0
    while (folder / f"day_{count}_dense.npy").exists():
        count += 1
    stray = sorted(p.name for p in folder.glob("day_*_dense.npy")
                   if p.name.split("_")[1].isdigit() and int(p.name.split("_")[1]) >= count)
    if stray:
        raise DataError(f"{folder}: {', '.join(stray)} present but day_{count}_dense.npy is missing: the days must "
                        f"run day_0 … day_{{K-1}} without a gap")
    if count < 2:
        raise DataError(f"{folder}: expected {expected} (at least two days: the last one is split into validation "
                        f"and test halves), found {count} day(s). {WHERE_FROM}")
    days = []
    for d in range(count):
        names = [f"day_{d}_dense.npy", f"day_{d}_labels.npy", f"day_{d}_{sparse_suffix}"]
        missing = [n for n in names if not (folder / n).exists()]
        if missing:
            hint = ""
            if sparse_kind == "multi_hot" and (folder / f"day_{d}_sparse.npy").exists():
                hint = (" (the one-hot day_{d}_sparse.npy is there: train on it with workload.criteo_sparse=one_hot, "
                        "or write the multi-hot files with `cobench data prepare criteo --multi-hot`)")
            raise DataError(f"{folder}: {', '.join(missing)} missing; each day needs {', '.join(names)}{hint}")
        sparse_path = folder / names[2]
        sparse = (open_npz(sparse_path, [str(k) for k in range(npz_member_count(sparse_path))])
                  if sparse_kind == "multi_hot" else [open_npy(sparse_path)])
        days.append(CriteoDay(d, open_npy(folder / names[0]), open_npy(folder / names[1]), sparse))
    return days


def check_layout(days: list[CriteoDay], num_dense: int, num_tables: int, multi_hot_sizes: Sequence[int] | None) -> None:
    """Dtypes, widths and row counts agree with each other and with the model (``multi_hot_sizes`` None: one-hot)."""
    for day in days:
        rows = {day.dense.name: day.dense.rows, day.labels.name: day.labels.rows}
        rows.update({array.name: array.rows for array in day.sparse})
        if len(set(rows.values())) > 1:
            listed = ", ".join(f"{name} {count}" for name, count in rows.items())
            raise DataError(f"day {day.index}: the arrays' row counts disagree ({listed}); the day's files come from "
                            f"different preparations: prepare the day again")
        if day.dense.dtype.kind != "f" or day.dense.width != num_dense:
            raise DataError(f"{day.dense.name}: expected [rows, {num_dense}] float dense features, got "
                            f"{day.dense.dtype} with {day.dense.width} columns (workload.num_dense is {num_dense})")
        if day.labels.dtype.kind not in "iub" or day.labels.width != 1:
            raise DataError(f"{day.labels.name}: expected [rows, 1] integer labels, got {day.labels.dtype} "
                            f"with {day.labels.width} columns")
        widths = day.hot
        for array in day.sparse:
            if array.dtype.kind not in "iu":
                raise DataError(f"{array.name}: expected integer ids, got {array.dtype}")
        if len(widths) != num_tables:
            raise DataError(f"{day.sparse[0].path.name}: {len(widths)} sparse features, but the model has "
                            f"{num_tables} tables; set workload.num_tables={len(widths)} (and table_rows), or "
                            f"workload.preset=mlperf_dcnv2")
        if multi_hot_sizes is not None and list(widths) != list(multi_hot_sizes):
            raise DataError(f"{day.sparse[0].path.name}: its multi-hot sizes are {widths}, the model's "
                            f"{list(multi_hot_sizes)}; set workload.multi_hot_sizes=[{','.join(map(str, widths))}]")


def _file_key(path: Path) -> dict:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def id_ranges(day: CriteoDay) -> tuple[list[int], list[int]]:
    """Each feature's smallest and largest id in ``day``'s sparse file: from the prepare command's manifest
    or the cache when the file's size and mtime match, else a chunked scan of the whole file (cached)."""
    path = day.sparse[0].path
    key = _file_key(path)
    manifest = path.parent / MANIFEST
    if manifest.exists():
        entry = json.loads(manifest.read_text()).get("files", {}).get(path.name)
        if entry and all(entry.get(k) == v for k, v in key.items()):
            return entry["min_ids"], entry["max_ids"]
    digest = hashlib.sha256(f"{path.resolve()}|{key['size']}|{key['mtime_ns']}".encode()).hexdigest()[:32]
    cached = cache_dir() / "criteo_ids" / f"{digest}.json"
    if cached.exists():
        entry = json.loads(cached.read_text())
        return entry["min_ids"], entry["max_ids"]
    lows, highs = [], []
    for array in day.sparse:
        low = np.full(array.width, np.iinfo(np.int64).max)
        high = np.full(array.width, np.iinfo(np.int64).min)
        for start in range(0, array.rows, _SCAN_ROWS):
            chunk = array.read(start, min(start + _SCAN_ROWS, array.rows))
            low, high = np.minimum(low, chunk.min(axis=0)), np.maximum(high, chunk.max(axis=0))
        if day.one_hot:
            lows, highs = low.tolist(), high.tolist()
        else:
            lows.append(int(low.min()) if array.rows else 0)
            highs.append(int(high.max()) if array.rows else 0)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps({"file": str(path.resolve()), **key, "min_ids": lows, "max_ids": highs}))
    except OSError:
        pass  # an unwritable cache only costs the next run the same scan
    return lows, highs


def check_ids(days: list[CriteoDay], table_rows: Sequence[int], hashed: Sequence[bool]) -> list[int]:
    """Every id of every day fits its table (tables in ``hashed`` take ids modulo their rows); each feature's
    largest id over the days."""
    largest = [0] * len(table_rows)
    for day in days:
        lows, highs = id_ranges(day)
        bad = [k for k, (low, high) in enumerate(zip(lows, highs, strict=True))
               if low < 0 or (high >= table_rows[k] and not hashed[k])]
        if bad:
            need = [max(rows, high + 1) for rows, high in zip(table_rows, highs, strict=True)]
            worst = bad[0]
            raise DataError(
                f"{day.sparse[0].path.name}: feature cat_{worst} has ids {lows[worst]} … {highs[worst]} but its "
                f"table has {table_rows[worst]} rows (features out of range: {', '.join(f'cat_{k}' for k in bad)}). "
                f"Set workload.table_rows=[{','.join(map(str, need))}] (at least each feature's largest id + 1), "
                f"or prepare the data for these tables")
        largest = [max(a, b) for a, b in zip(largest, highs, strict=True)]
    return largest


class CriteoSource:
    """Rank ``rank``'s batches of the train days (endless, epoch after epoch) and of the validation half.

    A batch is read straight into its final buffers: the dense features, the labels, and the KJT's values,
    feature-major (feature ``k``'s ``[n, hot_k]`` rows of a multi-hot ``.npz`` are already its ids in KJT
    order, so they are ``pread`` into place). Ids are hashed only where a table's largest id (known from the
    full check) can exceed its rows, and checked per batch only when no full check was made."""

    def __init__(self, days: list[CriteoDay], global_batch: int, rank: int, world_size: int,
                 table_rows: Sequence[int], hashed: Sequence[bool], eval_rows: int | None = None,
                 max_ids: Sequence[int] | None = None):
        self.train_days, self.last_day = days[:-1], days[-1]
        self.global_batch, self.rank, self.world_size = global_batch, rank, world_size
        self.local_batch = global_batch // world_size
        self.table_rows = list(table_rows)
        self.hot = days[0].hot
        known = max_ids is not None  # every id's range is known: hash only what can exceed, check nothing
        self.modulo = [h and (not known or max_ids[k] >= rows)
                       for k, (h, rows) in enumerate(zip(hashed, table_rows, strict=True))]
        self.check = [not h and not known for h in hashed]
        self.keys = [f"cat_{k}" for k in range(len(table_rows))]
        self.train_rows = sum(day.rows for day in self.train_days)
        self.batches_per_epoch = self.train_rows // global_batch
        if self.batches_per_epoch < 1:
            raise DataError(f"the training days (day_0 … day_{len(days) - 2}) hold {self.train_rows} rows, fewer "
                            f"than one global batch of {global_batch}; use a smaller workload.batch_size")
        half = math.ceil(self.last_day.rows / 2)  # the reference's validation half of the last day
        self.val_rows = half if eval_rows is None else min(half, eval_rows)
        self.test_rows = self.last_day.rows - half
        self._day_starts = np.cumsum([0] + [day.rows for day in self.train_days])
        self._layouts: dict[int, tuple] = {}

    @property
    def train_samples(self) -> int:
        return self.batches_per_epoch * self.global_batch

    def _layout(self, size: int) -> tuple:
        """What every batch of ``size`` samples shares (TorchRec's reader precomputes the same)."""
        if size not in self._layouts:
            per_key = [hot * size for hot in self.hot]
            offset_per_key = np.concatenate([[0], np.cumsum(per_key)]).tolist()
            lengths = torch.tensor([hot for hot in self.hot for _ in range(size)], dtype=torch.int32)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lengths, 0, dtype=torch.int32)])
            self._layouts[size] = (per_key, offset_per_key, lengths, offsets)
        return self._layouts[size]

    def _read(self, days: list[CriteoDay], starts: np.ndarray, start: int, stop: int) -> ClickBatch:
        """Rows ``[start, stop)`` of ``days`` laid end to end, as a batch."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        size = stop - start
        per_key, offset_per_key, lengths, offsets = self._layout(size)
        dense = np.empty((size, days[0].dense.width), dtype=np.float32)
        labels = np.empty(size, dtype=days[0].labels.dtype)
        values = np.empty(offset_per_key[-1], dtype=np.int32)
        index, row = int(np.searchsorted(starts, start, side="right")) - 1, 0
        while row < size:
            day = days[index]
            first = start + row - int(starts[index])
            take = min(size - row, day.rows - first)
            day.dense.read_into(first, first + take, dense[row:row + take])
            day.labels.read_into(first, first + take, labels[row:row + take])
            if day.one_hot:  # [n, 26]: transposed into feature-major order
                by_feature = values.reshape(len(self.hot), size)
                by_feature[:, row:row + take] = day.sparse[0].read(first, first + take).T
            else:
                for k, array in enumerate(day.sparse):
                    base, hot = offset_per_key[k], self.hot[k]
                    array.read_into(first, first + take, values[base + row * hot:base + (row + take) * hot])
            row, index = row + take, index + 1
        for k, rows in enumerate(self.table_rows):
            ids = values[offset_per_key[k]:offset_per_key[k + 1]]
            if self.modulo[k]:
                np.remainder(ids, rows, out=ids)
            elif self.check[k] and ids.size and (ids.max() >= rows or ids.min() < 0):
                raise DataError(f"{days[index - 1].sparse[0].path.name}: feature cat_{k} has id {int(ids.max())} "
                                f"but its table has {rows} rows (workload.criteo_id_check=batch let the file "
                                f"through); set workload.table_rows or prepare the data again")
        sparse = KeyedJaggedTensor(keys=self.keys, values=torch.from_numpy(values), lengths=lengths, offsets=offsets,
                                   stride=size, length_per_key=per_key, offset_per_key=offset_per_key,
                                   index_per_key={key: k for k, key in enumerate(self.keys)})
        return ClickBatch(torch.from_numpy(dense), sparse, torch.from_numpy(labels.astype(np.float32)))

    def train_batches(self, first_step: int = 0) -> Iterator[ClickBatch]:
        """This rank's share of global batch ``step % batches_per_epoch`` for ``step = first_step, …``."""
        step = first_step
        while True:
            start = (step % self.batches_per_epoch) * self.global_batch + self.rank * self.local_batch
            yield self._read(self.train_days, self._day_starts, start, start + self.local_batch)
            step += 1

    def val_batches(self) -> Iterator[ClickBatch]:
        """This rank's contiguous share of the validation rows, in local batches (the last one short)."""
        from torchrec.datasets.criteo import BinaryCriteoUtils

        ranges, _ = BinaryCriteoUtils.get_file_row_ranges_and_remainder([self.val_rows], self.rank, self.world_size)
        if not ranges:
            return
        first, last = ranges[0]
        starts = np.array([0, self.last_day.rows])
        for start in range(first, last + 1, self.local_batch):
            yield self._read([self.last_day], starts, start, min(start + self.local_batch, last + 1))


def open_source(config: DLRMConfig, shape: DLRMShape, rank: int, world_size: int) -> tuple[CriteoSource, DLRMShape]:
    """``workload.data_path``'s days, their layout, row counts and ids checked against the model (a
    :class:`DataError` if not), as rank ``rank``'s source; and the model's shape for them (one-hot files:
    one id per sample and table, which the sharding planner's pooling factors follow)."""
    folder = require_path("data_path", config.data_path, "a folder of MLPerf's preprocessed Criteo 1TB files "
                          "(day_{d}_dense.npy, day_{d}_labels.npy, day_{d}_sparse_multi_hot.npz or "
                          "day_{d}_sparse.npy)", WHERE_FROM)
    days = find_days(folder, config.criteo_sparse)
    if config.criteo_sparse == "one_hot":
        shape = replace(shape, multi_hot_sizes=(1,) * shape.num_tables)
    check_layout(days, shape.num_dense, shape.num_tables,
                 shape.multi_hot_sizes if config.criteo_sparse == "multi_hot" else None)
    hashed = [rows == config.max_table_rows for rows in shape.table_rows]  # cut to the cap: ids modulo rows
    max_ids = check_ids(days, shape.table_rows, hashed) if config.criteo_id_check == "full" else None
    eval_rows = config.eval_batches * shape.batch_size if config.eval_batches is not None else None
    source = CriteoSource(days, shape.batch_size, rank, world_size, shape.table_rows, hashed, eval_rows, max_ids)
    return source, shape
