"""How fast MovieLens becomes seqrec's histories, and how long a training step waits for its batch.

    .nox/cobench/bin/python benchmarks/bench_seqrec_data.py [--repeats 3] [--folder /tmp/cobench-movielens]

1. Preparation: an ML-20M-sized ``ratings.csv`` (20,000,263 ratings, 138,493 users, 26,744 movies; made here
   once, with ML-20M's header, sparse movie ids, at least 20 ratings a user, popularity and history lengths
   heavy-tailed) parsed, checked, sorted, remapped and split leave-one-out — everything the workload does
   while it is built. Timed ``--repeats`` times, each in a fresh process (no cache), with the load average.
   The ML-1M-sized file below is timed the same way (the '::' layout's parser).
2. Data wait: ``cobench run workload=seqrec workload.data=movielens`` on an ML-1M-sized ``ratings.dat``
   (1,000,209 ratings, 6,040 users, 3,706 movies; the tiny preset, ``max_len`` 200 as generative-recommenders
   trains ML-1M), ``data_wait_ms_p50`` against ``step_time_ms_p50``.

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
ML20M = {"ratings": 20_000_263, "users": 138_493, "items": 26_744, "max_movie_id": 131_262}
ML1M = {"ratings": 1_000_209, "users": 6_040, "items": 3_706, "max_movie_id": 3_952}


def synthetic_ratings(shape: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Columns of a MovieLens-shaped file: users in order, each with >= 20 ratings (MovieLens' own floor)."""
    g = np.random.default_rng(seed)
    extra = g.lognormal(0.0, 1.2, size=shape["users"])
    counts = 20 + np.floor(extra / extra.sum() * (shape["ratings"] - 20 * shape["users"])).astype(np.int64)
    counts[: shape["ratings"] - counts.sum()] += 1
    users = np.repeat(np.arange(1, shape["users"] + 1), counts)
    popularity = 1.0 / (np.arange(shape["items"]) + 10.0) ** 1.1
    movie_ids = np.sort(g.choice(np.arange(1, shape["max_movie_id"] + 1), size=shape["items"], replace=False))
    movies = movie_ids[g.choice(shape["items"], size=users.size, p=popularity / popularity.sum())]
    stars = g.integers(1, 11, size=users.size) / 2  # half stars, 0.5 .. 5.0
    start = np.repeat(g.integers(789_652_000, 1_400_000_000, size=counts.size), counts)
    gaps = np.where(g.random(users.size) < 0.3, 0, g.exponential(3_000, size=users.size).astype(np.int64))
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])  # each user's first rating
    elapsed = gaps.cumsum()
    timestamps = start + elapsed - np.repeat(elapsed[first] - gaps[first], counts)  # a user's gaps, summed
    order = np.lexsort((movies, users))  # ML-20M's own order: by user, then movie (so not by time)
    return {"userId": users[order], "movieId": movies[order], "rating": stars[order], "timestamp": timestamps[order]}


def write_ml20m(path: Path, columns: dict[str, np.ndarray]) -> None:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    with path.open("wb") as out:
        out.write(b"userId,movieId,rating,timestamp\n")
        pacsv.write_csv(pa.table(columns), out, write_options=pacsv.WriteOptions(include_header=False))


def write_ml1m(path: Path, columns: dict[str, np.ndarray]) -> None:
    stars = np.ceil(columns["rating"]).astype(np.int64)
    path.write_text("".join(f"{u}::{m}::{r}::{t}\n" for u, m, r, t in zip(
        columns["userId"].tolist(), columns["movieId"].tolist(), stars.tolist(), columns["timestamp"].tolist(),
        strict=True)), encoding="latin-1")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


PREPARE = """
import json, sys, time
start = time.perf_counter()
from workloads.seqrec.movielens import MovieLensSource, load_ratings
imported = time.perf_counter()
source = MovieLensSource(load_ratings(sys.argv[1]), 512)
source.popularity_quality()
done = time.perf_counter()
print(json.dumps({"prepare_s": done - imported, "import_s": imported - start, "what": source.describe()}))
"""


def time_preparation(path: Path) -> dict:
    """Everything the workload's constructor does with the file, in a fresh process (no cache)."""
    proc = subprocess.run([sys.executable, "-c", PREPARE, str(path)], capture_output=True, text=True, cwd=ROOT,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def time_data_wait(folder: Path, steps: int) -> dict:
    results = Path(tempfile.mkdtemp(prefix="bench-seqrec-"))
    # generative-recommenders' ML-1M history length; no cost-model timing or simulation: only the steps matter
    cmd = [sys.executable, "-m", "suite.cli", "run", "workload=seqrec", "workload.data=movielens",
           f"workload.data_path={folder}", "workload.max_len=200", "workload.cost_model=tokens",
           "workload.simulate_batches=0", "runner.warmup_steps=3",
           f"runner.steps={steps}", "runner.progress=false", f"results_dir={results}", "tracking=off"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    (metrics_file,) = (results / "runs").glob("*/metrics.json")
    metrics = json.loads(metrics_file.read_text())
    metrics = metrics.get("metrics", metrics)
    return {k: metrics[k] for k in ("data_wait_ms_p50", "step_time_ms_p50", "throughput", "hr_at_10")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "cobench-movielens")
    parser.add_argument("--steps", type=int, default=40, help="timed steps of the data-wait run")
    parser.add_argument("--skip-wait", action="store_true", help="time the preparation only")
    parser.add_argument("--skip-prepare", action="store_true", help="time the data wait only")
    args = parser.parse_args()
    big, small = args.folder / "ml-20m-sized" / "ratings.csv", args.folder / "ml-1m-sized" / "ratings.dat"
    for path, shape, write in ((big, ML20M, write_ml20m), (small, ML1M, write_ml1m)):
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            start = time.perf_counter()
            write(path, synthetic_ratings(shape))
            print(f"wrote {path} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - start:.1f} s")
    print(f"cpus: {os.cpu_count()}")
    print("| run | load before (1/5/15 min) | prepare s | load after | what |")
    print("|---|---|---|---|---|")
    for path in () if args.skip_prepare else (big, small):
        for run in range(args.repeats):
            before = load_average()
            result = time_preparation(path)
            print(f"| {run + 1} | {before} | {result['prepare_s']:.1f} | {load_average()} | {result['what']} |")
    if args.skip_wait:
        return
    print("\n| run | load before | data_wait_ms_p50 | step_time_ms_p50 | wait share | throughput samples/s |")
    print("|---|---|---|---|---|---|")
    for run in range(args.repeats):
        before = load_average()
        wait = time_data_wait(small.parent, args.steps)
        share = wait["data_wait_ms_p50"] / wait["step_time_ms_p50"]
        print(f"| {run + 1} | {before} | {wait['data_wait_ms_p50']:.3f} | {wait['step_time_ms_p50']:.1f} | "
              f"{share:.2%} | {wait['throughput']:.1f} |")


if __name__ == "__main__":
    main()
