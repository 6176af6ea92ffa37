"""``cobench data prepare criteo``: the raw Criteo 1TB TSV days → MLPerf's preprocessed numpy layout.

The steps and their rules are those of MLPerf's ``process_Criteo_1TB_Click_Logs_dataset.sh``, which runs
TorchRec's ``torchrec.datasets.scripts`` (``BinaryCriteoUtils.tsv_to_npys``, ``sparse_to_contiguous``
with ``--frequency_threshold 0``, ``shuffle`` with ``--random_seed 0``), then optionally MLPerf's
``materialize_synthetic_multihot_dataset.py``:

1. each TSV day (label, 13 integer, 26 hex categorical columns; a missing value is 0) becomes dense
   ``log(x - min + 2)`` float32 (``min`` over the day's dense values), int32 labels ``[rows, 1]`` and the
   raw categorical values as integers — ``tsv_to_npys``'s rules, read with pyarrow's CSV reader and
   decoded in bulk instead of one Python call per value (TorchRec's takes about a day for the 1TB set);
2. each feature's raw values, over all days, become contiguous ids from 2 in order of first appearance
   (values seen fewer than ``--frequency-threshold`` times become 1) — ``sparse_to_contiguous``'s mapping,
   done with ``np.unique`` (one feature's values of every day in memory at once);
3. the training days (all but the last) are shuffled together with ``--seed`` and cut back into days of
   their original sizes; the last day (validation and test) stays in order — ``shuffle``;
4. with ``--multi-hot``: ``day_{d}_sparse_multi_hot.npz``, each id ``i`` of feature ``k`` replaced by row
   ``i % rows_k`` of a fixed random table whose first column is ``i`` itself — MLPerf's ``Multihot``
   lookup (``uniform`` or ``pareto``, NumPy seed 0).

TorchRec's own functions need ``iopath`` (its file layer) and take days on the full set; this module
keeps their output layout and rules. Everything is held in memory one step at a time (the full 1TB set
needs what the reference needs: hundreds of GB). It also writes ``criteo_manifest.json``: per sparse
file its size, mtime and each feature's smallest and largest id, which the workload reads instead of
scanning the files again.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from workloads.base import Progress
from workloads.data_source import DataError, require_path
from workloads.dlrm.criteo import MANIFEST
from workloads.dlrm.model import MLPERF_MULTI_HOT_SIZES

NUM_DENSE, NUM_SPARSE = 13, 26
ROW_CAP = 40_000_000  # MLPerf's cap on a table's rows (its num_embeddings_per_feature)
_HEX = np.full(256, -1, dtype=np.int64)
for _digit, _char in enumerate(b"0123456789abcdef"):
    _HEX[_char] = _HEX[ord(chr(_char).upper())] = _digit


@dataclass
class Options:
    input_dir: Path = field(metadata={"help": "folder of the raw TSV days day_0, day_1, … (as Criteo distributes "
                                              "them, uncompressed)"})
    out: Path = field(metadata={"help": "folder to write day_{d}_dense.npy, day_{d}_labels.npy, "
                                        "day_{d}_sparse.npy (and day_{d}_sparse_multi_hot.npz) into"})
    frequency_threshold: int = field(default=0, metadata={
        "help": "values of a feature seen fewer times than this become id 1 (MLPerf uses 0: none)"})
    shuffle: bool = field(default=True, metadata={"help": "shuffle the training days together (MLPerf does)"})
    seed: int = field(default=0, metadata={"help": "the shuffle's seed (MLPerf's is 0)"})
    multi_hot: bool = field(default=False, metadata={
        "help": "also write MLPerf's multi-hot day_{d}_sparse_multi_hot.npz"})
    multi_hot_sizes: list[int] | None = field(default=None, metadata={
        "help": "ids per sample per feature (26 values; default MLPerf's 3 2 1 2 6 … 100 27 10 3 1 1)"})
    num_embeddings_per_feature: list[int] | None = field(default=None, metadata={
        "help": "the tables' rows the multi-hot ids are hashed into (26 values; default: each feature's largest "
                "id + 1, capped at 40M; MLPerf's run passes 40000000 39060 17295 … for the full set)"})
    multi_hot_distribution: str = field(default="uniform", metadata={"help": "uniform | pareto (MLPerf: uniform)"})

    def __post_init__(self) -> None:
        if self.multi_hot_distribution not in ("uniform", "pareto"):
            raise ValueError(f"--multi-hot-distribution: got {self.multi_hot_distribution!r}, allowed: uniform, pareto")
        for name in ("multi_hot_sizes", "num_embeddings_per_feature"):
            values = getattr(self, name)
            if values is not None and (len(values) != NUM_SPARSE or min(values) < 1):
                raise ValueError(f"--{name.replace('_', '-')}: expected {NUM_SPARSE} positive values, got {values}")


def _hex_ids(column: Any, where: str) -> np.ndarray:
    """A pyarrow string column of up-to-8-digit hex values ('' for missing: 0) as int64."""
    import pyarrow.compute as pc

    column = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    if len(column) and pc.max(pc.utf8_length(column)).as_py() > 8:
        raise DataError(f"{where}: a categorical value longer than 8 hex digits; is this a Criteo day file?")
    padded = pc.utf8_lpad(column, width=8, padding="0")
    offsets = np.frombuffer(padded.buffers()[1], dtype=np.int32)[padded.offset:padded.offset + len(padded) + 1]
    raw = np.frombuffer(padded.buffers()[2], dtype=np.uint8)[offsets[0]:offsets[-1]].reshape(-1, 8)
    digits = _HEX[raw]
    if (digits < 0).any():
        raise DataError(f"{where}: a categorical value is not hexadecimal; is this a Criteo day file?")
    return digits @ (16 ** np.arange(7, -1, -1, dtype=np.int64))


def read_tsv_day(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One raw day as (dense float32 [n, 13], labels int32 [n, 1], raw categorical values int64 [n, 26]),
    with the rules of TorchRec's ``BinaryCriteoUtils.tsv_to_npys``."""
    import pyarrow as pa
    from pyarrow import csv

    names = ["label", *(f"int_{i}" for i in range(NUM_DENSE)), *(f"cat_{i}" for i in range(NUM_SPARSE))]
    types = {name: pa.int64() for name in names[:1 + NUM_DENSE]} | {name: pa.string() for name in names[1 + NUM_DENSE:]}
    try:
        table = csv.read_csv(path, read_options=csv.ReadOptions(column_names=names),
                             parse_options=csv.ParseOptions(delimiter="\t", quote_char=False),
                             convert_options=csv.ConvertOptions(column_types=types, strings_can_be_null=False))
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise DataError(f"{path}: not a Criteo TSV day (label, 13 integers, 26 hex values, tab-separated): "
                        f"{err}") from err
    filled = [table.column(name).fill_null(0).to_numpy() for name in names[:1 + NUM_DENSE]]
    labels = filled[0].astype(np.int32).reshape(-1, 1)
    dense = np.stack(filled[1:], axis=1) if len(labels) else np.zeros((0, NUM_DENSE), dtype=np.int64)
    dense = np.log(dense - (dense.min() - 2) if len(dense) else dense + 2, dtype=np.float32)  # TorchRec's transform
    sparse = np.stack([_hex_ids(table.column(name), f"{path}: {name}") for name in names[1 + NUM_DENSE:]], axis=1)
    return dense, labels, sparse.reshape(-1, NUM_SPARSE)


def contiguous_ids(values: np.ndarray, frequency_threshold: int) -> np.ndarray:
    """``sparse_to_contiguous``'s mapping of one feature's values (every day, in order): ids from 2 in order
    of first appearance; with a threshold above 1, values seen fewer times than it become 1."""
    unique, first, inverse, counts = np.unique(values, return_index=True, return_inverse=True, return_counts=True)
    frequent = counts >= frequency_threshold if frequency_threshold > 1 else np.ones(len(unique), dtype=bool)
    order = np.argsort(first, kind="stable")  # unique values by first appearance
    ids = np.ones(len(unique), dtype=np.int64)
    ranked = order[frequent[order]]
    ids[ranked] = 2 + np.arange(len(ranked))
    return ids[inverse.reshape(-1)]


def multi_hot_tables(rows: list[int], sizes: list[int], distribution: str) -> list[np.ndarray]:
    """MLPerf's ``Multihot`` lookup tables: for table ``k``, row ``i`` is ``[i, sizes[k] - 1 random ids]``."""
    np.random.seed(0)  # MLPerf's: every rank and run builds the same tables
    tables = []
    for count, size in zip(rows, sizes, strict=True):
        if distribution == "uniform":
            extra = np.random.randint(0, count, size=(count, size - 1))
        else:
            extra = np.random.pareto(a=0.25, size=(count, size - 1)).astype(np.int32) % count
        tables.append(np.concatenate([np.arange(count)[:, None], extra], axis=1).astype(np.int32))
    return tables


def _manifest_entry(path: Path, per_feature: list[np.ndarray]) -> dict:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "rows": int(len(per_feature[0])),
            "min_ids": [int(a.min()) if a.size else 0 for a in per_feature],
            "max_ids": [int(a.max()) if a.size else 0 for a in per_feature]}


def prepare(options: Options, progress: Progress) -> dict:
    """Write the numpy layout (and optionally the multi-hot files) into ``options.out``; what was written."""
    source = require_path("input_dir", options.input_dir, "a folder of the raw Criteo TSV days day_0, day_1, …",
                          "Criteo 1TB comes from https://ailab.criteo.com/ressources/criteo-1tb-click-logs-dataset-"
                          "for-mlperf (download and uncompress the day_N files)")
    count = 0
    while (source / f"day_{count}").is_file():
        count += 1
    if count < 2:
        raise DataError(f"{source}: expected the raw TSV days day_0, day_1, … (at least two: the last is split into "
                        f"validation and test), found {count}")
    out = Path(options.out).expanduser()
    work = out / "_raw"
    work.mkdir(parents=True, exist_ok=True)

    advance = progress.task("TSV → numpy", total=count, unit="days")
    rows = []
    for d in range(count):
        dense, labels, raw = read_tsv_day(source / f"day_{d}")
        np.save(work / f"day_{d}_dense.npy", dense)
        np.save(work / f"day_{d}_labels.npy", labels)
        np.save(work / f"day_{d}_raw.npy", raw)
        rows.append(len(labels))
        advance(1)

    advance = progress.task("contiguous ids", total=NUM_SPARSE, unit="features")
    raws = [np.load(work / f"day_{d}_raw.npy", mmap_mode="r") for d in range(count)]
    sparse = np.empty((sum(rows), NUM_SPARSE), dtype=np.int32)
    for k in range(NUM_SPARSE):
        sparse[:, k] = contiguous_ids(np.concatenate([raw[:, k] for raw in raws]), options.frequency_threshold)
        advance(1)
    del raws

    advance = progress.task("shuffle and write", total=count, unit="days")
    train = sum(rows[:-1])
    order = np.random.RandomState(options.seed).permutation(train) if options.shuffle else np.arange(train)
    dense = np.concatenate([np.load(work / f"day_{d}_dense.npy") for d in range(count - 1)])[order]
    labels = np.concatenate([np.load(work / f"day_{d}_labels.npy") for d in range(count - 1)])[order]
    sparse[:train] = sparse[:train][order]
    manifest: dict[str, dict] = {}
    starts = np.cumsum([0, *rows])
    for d in range(count):
        part = slice(starts[d], starts[d + 1])
        if d < count - 1:
            np.save(out / f"day_{d}_dense.npy", dense[part])
            np.save(out / f"day_{d}_labels.npy", labels[part])
        else:  # the last day, in order: validation then test half
            shutil.move(work / f"day_{d}_dense.npy", out / f"day_{d}_dense.npy")
            shutil.move(work / f"day_{d}_labels.npy", out / f"day_{d}_labels.npy")
        np.save(out / f"day_{d}_sparse.npy", sparse[part])
        manifest[f"day_{d}_sparse.npy"] = _manifest_entry(out / f"day_{d}_sparse.npy", list(sparse[part].T))
        advance(1)
    shutil.rmtree(work)
    table_rows = [min(int(sparse[:, k].max()) + 1, ROW_CAP) for k in range(NUM_SPARSE)]
    summary: dict[str, Any] = {"out": str(out), "days": count, "rows_per_day": rows, "train_rows": train,
                               "table_rows": table_rows}

    if options.multi_hot:
        hashes = options.num_embeddings_per_feature or table_rows
        sizes = options.multi_hot_sizes or list(MLPERF_MULTI_HOT_SIZES)
        tables = multi_hot_tables(hashes, sizes, options.multi_hot_distribution)
        advance = progress.task("multi-hot", total=count, unit="days")
        for d in range(count):
            day = sparse[starts[d]:starts[d + 1]]
            bags = [tables[k][day[:, k] % hashes[k]] for k in range(NUM_SPARSE)]
            path = out / f"day_{d}_sparse_multi_hot.npz"
            np.savez(path, **{str(k): bag for k, bag in enumerate(bags)})
            manifest[path.name] = _manifest_entry(path, bags)
            advance(1)
        summary.update(table_rows=list(hashes), multi_hot_sizes=sizes)
    (out / MANIFEST).write_text(json.dumps({"files": manifest}, indent=1))
    summary["run"] = (f"cobench run workload=dlrm workload.data=criteo_1tb workload.data_path={out} "
                      f"workload.criteo_sparse={'multi_hot' if options.multi_hot else 'one_hot'} "
                      f"'workload.table_rows=[{','.join(map(str, summary['table_rows']))}]'"
                      + (f" 'workload.multi_hot_sizes=[{','.join(map(str, summary['multi_hot_sizes']))}]'"
                         if options.multi_hot else ""))
    return summary
