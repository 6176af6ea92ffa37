"""workload.data=movielens: ML-1M ``ratings.dat`` and ML-20M ``ratings.csv`` read, split leave-one-out, sharded,
checked and trained on.

The files are tiny but in exactly MovieLens' layouts, and their users follow hidden chains of movies (each
movie has one likely successor), so the HR@10 a run reaches means something. Movie and user ids are sparse
and the lines shuffled, so remapping and sorting are exercised; some ratings share a second.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import mlflow_runs

from suite.cli import main
from workloads.base import RunContext
from workloads.data_source import DataError
from workloads.seqrec.config import SeqRecConfig
from workloads.seqrec.data import FEATURES
from workloads.seqrec.movielens import MIN_INTERACTIONS, MovieLensSource, load_ratings
from workloads.seqrec.schedule import MovieLensSchedule, RankSplit
from workloads.seqrec.workload import SeqRecWorkload

CPU = torch.device("cpu")
CHAINS, CHAIN_LENGTH = 8, 10  # 80 movies; each one's successor is the next in its chain
FOLLOW = 0.9  # chance a user watches the successor of the last movie, else any movie
# small and quick: the tiny preset's shape, shorter histories and fewer negatives
QUICK = {"max_len": 32, "num_negatives": 16, "cost_model": "tokens", "simulate_batches": 0, "batch_size": 16,
         "train_batches": 2}
QUICK_CLI = [f"workload.{k}={v}" for k, v in QUICK.items()]


def chain_ratings(users: int = 240, seed: int = 0) -> list[tuple[int, int, float, int]]:
    """(user id, movie id, stars, timestamp) rows, shuffled; movie ids sparse (7 k + 3), user ids from 11 up."""
    g = np.random.default_rng(seed)
    movies = CHAINS * CHAIN_LENGTH
    rows = []
    for user in range(users):
        length = int(g.integers(MIN_INTERACTIONS + 4, 28))
        movie, time = int(g.integers(movies)), 978_300_000 + int(g.integers(10**6))
        for _ in range(length):
            rows.append((11 + 3 * user, 7 * movie + 3, float(g.integers(1, 6)), time))
            chain, position = divmod(movie, CHAIN_LENGTH)
            follow = g.random() < FOLLOW
            movie = chain * CHAIN_LENGTH + (position + 1) % CHAIN_LENGTH if follow else int(g.integers(movies))
            time += int(g.integers(0, 3)) * 60 if follow else 60  # a followed successor sometimes in the same second
    order = g.permutation(len(rows))
    return [rows[i] for i in order]


def write_ml1m(folder: Path, rows: list[tuple[int, int, float, int]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ratings.dat"
    path.write_text("".join(f"{u}::{m}::{int(r)}::{t}\n" for u, m, r, t in rows), encoding="latin-1")
    return path


def write_ml20m(folder: Path, rows: list[tuple[int, int, float, int]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ratings.csv"
    half = [(u, m, r - 0.5 * (m % 2), t) for u, m, r, t in rows]  # half stars, as ML-20M has
    path.write_text("userId,movieId,rating,timestamp\n" + "".join(f"{u},{m},{r:.1f},{t}\n" for u, m, r, t in half))
    return path


def expected_histories(rows: list[tuple[int, int, float, int]]) -> dict[int, list[tuple[int, float]]]:
    """Each user's (movie, stars) in time order, ties in file order (Python's sort is stable)."""
    ordered: dict[int, list[tuple[int, int, float]]] = {}
    for user, movie, stars, time in rows:
        ordered.setdefault(user, []).append((time, movie, stars))
    return {user: [(m, s) for _, m, s in sorted(events, key=lambda e: e[0])] for user, events in ordered.items()}


@pytest.fixture(scope="module")
def rows():
    return chain_ratings()


@pytest.fixture(scope="module")
def ml1m(tmp_path_factory, rows):
    return write_ml1m(tmp_path_factory.mktemp("ml-1m"), rows).parent


def workload(folder: Path, rank: int = 0, world_size: int = 1, seed: int = 1, **overrides) -> SeqRecWorkload:
    ctx = RunContext(device=CPU, seed=seed, work_dir=folder, rank=rank, world_size=world_size)
    return SeqRecWorkload(SeqRecConfig(**({"data": "movielens", "data_path": str(folder)} | QUICK | overrides)), ctx)


# -- reading ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["ml-1m", "ml-20m"])
def test_histories_are_in_time_order_with_dense_ids_and_a_leave_one_out_split(tmp_path, rows, layout):
    path = (write_ml1m if layout == "ml-1m" else write_ml20m)(tmp_path / layout, rows)
    ratings = load_ratings(path.parent)  # the folder: the file is found in it, its layout read from its first line
    assert ratings.layout == layout and ratings.num_ratings == len(rows) and ratings.dropped_users == 0
    expected = expected_histories(rows)
    movies = sorted({m for _, m, _, _ in rows})
    assert ratings.num_items == len(movies) and ratings.num_users == len(expected)
    for u, user in enumerate(sorted(expected)):  # users and movies dense, in ascending order of their file ids
        got = ratings.items[ratings.offsets[u]:ratings.offsets[u + 1]]
        assert [movies[i] for i in got] == [m for m, _ in expected[user]]
        stars = [s - (0.5 * (m % 2) if layout == "ml-20m" else 0) for m, s in expected[user]]
        assert ratings.actions[ratings.offsets[u]:ratings.offsets[u + 1]].tolist() == [int(np.ceil(s)) - 1
                                                                                        for s in stars]
    source = MovieLensSource(ratings, max_len=8)
    u = 5
    history = ratings.items[ratings.offsets[u]:ratings.offsets[u + 1]]
    train = source.train_histories(np.array([u]))
    assert train.items.tolist() == history[:-2][-8:].tolist()  # the most recent max_len, without the last two
    for which, target in (("validation", -2), ("test", -1)):
        prefix, targets = source.eval_set(which, np.array([u]))
        assert targets.tolist() == [history[target]] and prefix.items.tolist() == history[:target][-8:].tolist()


def test_batches_have_the_right_shapes_and_the_same_seed_gives_the_same_batches(ml1m):
    def first_batches(seed: int) -> list:
        w = workload(ml1m, seed=seed)
        w.setup()
        try:
            return [next(w._batch_iter) for _ in range(3)]
        finally:
            w.teardown()

    batches = first_batches(1)
    features = batches[0].features
    assert features.keys() == list(FEATURES) and features.stride() == QUICK["batch_size"]
    assert features.values().dtype == torch.int64 and features.lengths().dtype in (torch.int32, torch.int64)
    lengths = features["item_ids"].lengths()
    assert torch.equal(lengths, features["actions"].lengths()) and int(lengths.max()) <= QUICK["max_len"]
    assert (features["negatives"].lengths() == QUICK["num_negatives"]).all()
    assert int(features["actions"].values().max()) <= 4 and int(features["item_ids"].values().max()) < 80
    again = first_batches(1)
    assert all(torch.equal(a.features.values(), b.features.values()) for a, b in zip(batches, again, strict=True))
    other = first_batches(2)
    assert not torch.equal(batches[0].features.values(), other[0].features.values())


def test_two_ranks_train_and_evaluate_disjoint_users_that_together_are_all(ml1m):
    source = MovieLensSource(load_ratings(ml1m), QUICK["max_len"])
    per_epoch = source.batches_per_epoch(QUICK["batch_size"])
    seen: list[list[int]] = []
    evaluated: list[np.ndarray] = []
    for rank in (0, 1):
        w = workload(ml1m, rank=rank, world_size=2, compare_even=False)  # the balancer's partition
        # tokens: nothing to measure, no process group needed
        split = RankSplit(w._fit_cost_model(), 2, w.config.balancer, compare_even=False, token_budget=w.token_budget)
        schedule = MovieLensSchedule(source, split, w.ctx.seed, rank, QUICK["batch_size"], w.shape)
        users = []
        for entry in (e for k in range(per_epoch) for e in schedule.plan(k)):
            users += source.batch_users(w.ctx.seed, entry.global_index, QUICK["batch_size"])[entry.parts[rank]].tolist()
        seen.append(users)
        w._make_movielens_eval_sets()
        evaluated.append(w.eval_sets[""].targets.numpy())
    assert not set(seen[0]) & set(seen[1])
    epoch = per_epoch * QUICK["batch_size"]  # one epoch: every user once, but the last partial batch's
    assert len(seen[0]) + len(seen[1]) == epoch and len(set(seen[0]) | set(seen[1])) == epoch
    assert evaluated[0].size + evaluated[1].size == source.num_users


# -- bad input ----------------------------------------------------------------------------------


def _broken(kind: str, rows, folder: Path) -> tuple[Path, str]:
    """A bad ``workload.data_path`` of ``kind`` and a regex its error must match."""
    folder.mkdir(parents=True)
    if kind == "missing":
        return folder / "nope", r"nope does not exist; expected a MovieLens ratings file.*grouplens"
    if kind == "empty_folder":
        (folder / "movies.dat").write_text("1::Toy Story (1995)::Animation\n")
        return folder, r"holds no MovieLens ratings file; expected one of ratings\.dat, ratings\.csv \(found: movies"
    if kind == "wrong_separator":
        (folder / "ratings.dat").write_text("".join(f"{u}\t{m}\t{int(r)}\t{t}\n" for u, m, r, t in rows[:50]))
        return folder, r"ratings\.dat: the first line .* is no MovieLens ratings line.*'::'-separated"
    if kind == "wrong_columns":
        (folder / "ratings.csv").write_text("user,item,stars,time\n1,2,3.0,4\n")
        return folder, r"ratings\.csv: the first line .* is no MovieLens ratings line.*userId,movieId,rating"
    if kind == "extra_column":
        lines = [f"{u}::{m}::{int(r)}::{t}" for u, m, r, t in rows]
        lines[7] += "::12"
        (folder / "ratings.dat").write_text("\n".join(lines) + "\n")
        return folder, r"ratings\.dat: not a MovieLens ratings file \(line 8 has 5 fields\).*four numbers a line"
    if kind == "colon_separated":
        lines = [f"{u}::{m}::{int(r)}::{t}" for u, m, r, t in rows]
        lines[9] = lines[9].replace("::", ":")
        (folder / "ratings.dat").write_text("\n".join(lines) + "\n")
        return folder, r"ratings\.dat: line 10 is not '::'-separated"
    assert kind == "short_line"
    text = "userId,movieId,rating,timestamp\n" + "".join(f"{u},{m},{r},{t}\n" for u, m, r, t in rows)
    (folder / "ratings.csv").write_text(text + "7,3\n")
    return folder, rf"ratings\.csv: line {len(rows) + 2} has fewer than four fields"


@pytest.mark.parametrize("kind", ["missing", "empty_folder", "wrong_separator", "wrong_columns", "extra_column"])
def test_bad_files_exit_2_naming_the_file_before_any_run(rows, tmp_path, calibration_cache, capsys, kind):
    folder, message = _broken(kind, rows, tmp_path / "data")
    results = tmp_path / "results"
    code = main(["run", "workload=seqrec", "workload.data=movielens", f"workload.data_path={folder}",
                 f"results_dir={results}", f"platform.calibration_cache={calibration_cache}"])
    assert code == 2
    assert __import__("re").search(message, capsys.readouterr().err, __import__("re").S), kind
    assert mlflow_runs(results) == []


@pytest.mark.parametrize("kind", ["colon_separated", "short_line"])
def test_more_bad_lines_are_refused_naming_the_line(rows, tmp_path, kind):
    """The same refusal as above (the CLI turns it into exit 2), checked without a CLI run each."""
    folder, message = _broken(kind, rows, tmp_path / "data")
    with pytest.raises(DataError, match=message):
        load_ratings(folder)


def test_a_ratings_file_is_refused_as_the_workload_is_built(tmp_path, rows):
    with pytest.raises(DataError, match="set workload.data_path to the one to read"):
        write_ml1m(tmp_path, rows)
        write_ml20m(tmp_path, rows)
        workload(tmp_path)
    with pytest.raises(DataError, match="fewer users than workload.batch_size=512"):
        workload(write_ml1m(tmp_path / "one", rows).parent, batch_size=512)


# -- training -----------------------------------------------------------------------------------


def test_a_run_on_movielens_reaches_its_target_within_the_step_budget(ml1m, tmp_path, calibration_cache):
    """Trained until the target (stop_at_target) within a budget of steps: the assertion is the budget."""
    results = tmp_path / "results"
    budget, interval, target = 200, 10, 0.5
    code = main(["run", "workload=seqrec", "workload.data=movielens", f"workload.data_path={ml1m}", *QUICK_CLI,
                 f"workload.hr_at_10_target={target}", "runner.warmup_steps=2", f"runner.steps={budget}",
                 f"runner.eval_interval={interval}", "runner.stop_at_target=true", "runner.progress=false",
                 f"results_dir={results}", f"platform.calibration_cache={calibration_cache}"])
    assert code == 0
    (run,) = mlflow_runs(results)
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert {"hr_at_10", "ndcg_at_10", "val_hr_at_10", "val_ndcg_at_10", "data_wait_ms_p50",
            "popularity_hr_at_10"} <= set(metrics)
    assert metrics["quality_target_reached"] == 1.0 and metrics["hr_at_10"] >= target
    assert metrics["hr_at_10"] > 2 * metrics["popularity_hr_at_10"]  # the default target would be reached too
    assert 0 < metrics["ndcg_at_10"] <= metrics["hr_at_10"]
    (log,) = (results / "runs").glob("*/mllog_rep0.txt")
    events = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in log.read_text().splitlines() if ":::MLLOG" in line]
    values = {e["key"]: e["value"] for e in events}
    assert values["train_samples"] == values["eval_samples"] == 240


@pytest.mark.parametrize("data", ["synthetic", "movielens"])
def test_every_step_says_how_long_it_waited_for_its_batch(ml1m, tmp_path, data):
    """The harness logs data_wait_ms_p50 from StepResult.data_wait_s: both sources report it."""
    source = {"data": "movielens", "data_path": str(ml1m)} if data == "movielens" else {"data": "synthetic"}
    config = SeqRecConfig(**(QUICK | source))
    w = SeqRecWorkload(config, RunContext(device=CPU, seed=1, work_dir=tmp_path))
    w.setup()
    try:
        waits = [w.step().data_wait_s for _ in range(3)]
    finally:
        w.teardown()
    assert all(isinstance(wait, float) and 0 <= wait < 1 for wait in waits)
