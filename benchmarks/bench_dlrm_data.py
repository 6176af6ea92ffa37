"""How fast MLPerf's Criteo files become DLRM batches, and how long a training step waits for its batch.

    .nox/cobench/bin/python benchmarks/bench_dlrm_data.py [--repeats 3] [--rows 2000000] [--folder /tmp/cobench-criteo]

1. Reading: a realistically sized day (``--rows`` samples, MLPerf's 26 features; the multi-hot ``.npz`` with
   MLPerf's sizes, 215 ids a sample, and the one-hot ``.npy``) read by :class:`workloads.dlrm.criteo.CriteoSource`
   into ``KeyedJaggedTensor`` batches of 512 (tiny DLRM's batch) — pread, id check, hashing of the 40M
   tables, KJT — on the caller's thread: samples/s. Beside it, tiny DLRM's own training samples/s
   (``cobench run workload=dlrm`` with its defaults), the figure reading must beat tenfold.
2. Data wait: ``cobench run workload=dlrm workload.data=criteo_1tb`` on those files (the tiny model's widths
   with MLPerf's 26 features and multi-hot sizes), ``data_wait_ms_p50`` against ``step_time_ms_p50``.

Each measurement is repeated ``--repeats`` times with the load average beside it (the machine is shared).
A benchmark, never a test: it reports, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workloads.dlrm.criteo import CriteoSource, check_ids, find_days  # noqa: E402
from workloads.dlrm.model import MLPERF_MULTI_HOT_SIZES, MLPERF_TABLE_ROWS  # noqa: E402

ID_RANGE = 100_000  # ids drawn below this (and below each table's rows): a tiny model can hold the tables
BATCH = 512


def load() -> str:
    return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def write_day(folder: Path, day: int, rows: int, seed: int) -> None:
    g = np.random.default_rng(seed)
    np.save(folder / f"day_{day}_dense.npy", np.log1p(g.exponential(2.0, (rows, 13))).astype(np.float32))
    np.save(folder / f"day_{day}_labels.npy", (g.random((rows, 1)) < 0.25).astype(np.int32))
    limits = [min(r, ID_RANGE) for r in MLPERF_TABLE_ROWS]
    one_hot = np.stack([g.integers(0, limit, rows, dtype=np.int32) for limit in limits], axis=1)
    np.save(folder / f"day_{day}_sparse.npy", one_hot)
    bags = {str(k): g.integers(0, limit, (rows, hot), dtype=np.int32)
            for k, (limit, hot) in enumerate(zip(limits, MLPERF_MULTI_HOT_SIZES, strict=True))}
    np.savez(folder / f"day_{day}_sparse_multi_hot.npz", **bags)


def make_data(folder: Path, rows: int) -> None:
    if (folder / "day_1_sparse_multi_hot.npz").exists() and np.load(folder / "day_0_labels.npy",
                                                                    mmap_mode="r").shape[0] == rows:
        return
    folder.mkdir(parents=True, exist_ok=True)
    write_day(folder, 0, rows, seed=0)
    write_day(folder, 1, 20_000, seed=1)  # the validation/test day


def read_rate(folder: Path, sparse: str, samples: int) -> float:
    """Samples/s of batches read on this thread (the page cache warm: the step's view of a read-ahead)."""
    days = find_days(folder, sparse)
    hashed = [rows == 40_000_000 for rows in MLPERF_TABLE_ROWS]
    max_ids = check_ids(days, MLPERF_TABLE_ROWS, hashed)  # as the workload does before a run (cached)
    source = CriteoSource(days, BATCH, 0, 1, MLPERF_TABLE_ROWS, hashed, max_ids=max_ids)
    stream = source.train_batches()
    next(stream)
    started = time.perf_counter()
    for _ in range(samples // BATCH):
        next(stream)
    return (samples // BATCH) * BATCH / (time.perf_counter() - started)


def cobench_run(results: Path, *overrides: str) -> dict:
    env = dict(os.environ, COBENCH_CACHE_DIR=str(results / "cache"))
    cmd = [sys.executable, "-m", "suite.cli", "run", "workload=dlrm", "runner.progress=false",
           f"results_dir={results}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    newest = max(results.glob("runs/*/metrics.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(newest.read_text())["metrics"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--samples", type=int, default=1_000_000, help="samples read per reading measurement")
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "cobench-criteo")
    args = parser.parse_args()
    started = time.perf_counter()
    make_data(args.folder, args.rows)
    print(f"data: {args.folder} ({args.rows:,} rows in day_0; {time.perf_counter() - started:.0f} s)")
    rows = []
    tables = "[" + ",".join(str(min(r, ID_RANGE)) for r in MLPERF_TABLE_ROWS) + "]"
    hot = "[" + ",".join(map(str, MLPERF_MULTI_HOT_SIZES)) + "]"
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            before = load()
            multi = read_rate(args.folder, "multi_hot", args.samples)
            one = read_rate(args.folder, "one_hot", args.samples)
            tiny = cobench_run(Path(scratch), "runner.steps=40")["samples_per_s"]
            real = cobench_run(Path(scratch), "workload.data=criteo_1tb", f"workload.data_path={args.folder}",
                               f"workload.table_rows={tables}", f"workload.multi_hot_sizes={hot}",
                               "workload.eval_batches=2", "runner.steps=40")
            rows.append((repeat, before, load(), multi, one, tiny, real["data_wait_ms_p50"],
                         real["step_time_ms_p50"], real["samples_per_s"]))
            print(f"repeat {repeat}: load {before} -> {load()}: multi-hot {multi:,.0f}/s, one-hot {one:,.0f}/s, "
                  f"tiny DLRM trains {tiny:,.0f}/s; on Criteo files wait p50 {real['data_wait_ms_p50']:.3f} ms of "
                  f"step p50 {real['step_time_ms_p50']:.1f} ms", flush=True)
    print("\n| run | load before | load after | multi-hot read samples/s | one-hot read samples/s | tiny DLRM "
          "train samples/s | multi-hot ÷ train | wait p50 ms | step p50 ms | wait share |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for repeat, before, after, multi, one, tiny, wait, step, _ in rows:
        print(f"| {repeat} | {before} | {after} | {multi:,.0f} | {one:,.0f} | {tiny:,.0f} | {multi / tiny:.1f}× | "
              f"{wait:.3f} | {step:.1f} | {100 * wait / step:.2f} % |")


if __name__ == "__main__":
    main()
