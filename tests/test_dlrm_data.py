"""workload.data=criteo_1tb: MLPerf's preprocessed Criteo files (one-hot and multi-hot), read, sharded, checked
and trained on; `cobench data prepare criteo` from raw TSV days.

The files are tiny but in exactly the layout MLPerf's preprocessing writes (dense float32 [n, 13], labels
int32 [n, 1], sparse int32 [n, 26], the multi-hot .npz of int32 [n, hot] arrays "0" … "25"), and their labels
come from a hidden logistic model of the ids, so the AUC a run reaches means something.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from conftest import mlflow_runs

from suite.cli import main
from workloads.base import RunContext
from workloads.data_source import DataError
from workloads.dlrm.config import DLRMConfig
from workloads.dlrm.criteo import MANIFEST, CriteoSource, find_days
from workloads.dlrm.data import roc_auc
from workloads.dlrm.workload import DLRMWorkload

ROWS = 48  # rows per table in the test data: small enough that every id is seen often
HOT = tuple((3, 2, 1, 2, 4, 1, 1, 2)[k % 8] for k in range(26))  # the tiny preset's sizes, cycled to 26
TABLES = [ROWS] * 26
CPU = torch.device("cpu")


def hidden_model(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    return g.normal(size=(26, ROWS)), g.normal(size=13) * 0.3


def sample_day(g: np.random.Generator, rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[np.ndarray],
                                                                        np.ndarray]:
    """Dense, labels, one [rows, hot] id array per feature, and the hidden model's logits."""
    id_weights, dense_weights = hidden_model(seed)
    dense = np.log1p(g.exponential(2.0, size=(rows, 13))).astype(np.float32)
    bags = [np.minimum(g.zipf(1.3, size=(rows, hot)) - 1, ROWS - 1).astype(np.int32) for hot in HOT]
    logits = dense @ dense_weights - 0.5 + 0.6 * sum(id_weights[k][bag].mean(1) for k, bag in enumerate(bags))
    labels = (g.random(rows) < 1 / (1 + np.exp(-logits))).astype(np.int32).reshape(-1, 1)
    return dense, labels, bags, logits


def write_criteo(folder, days: int = 3, rows: int = 3000, seed: int = 0) -> np.ndarray:
    """MLPerf's layout for ``days`` days (one-hot and multi-hot files); returns the last day's hidden logits."""
    folder.mkdir(parents=True, exist_ok=True)
    g = np.random.default_rng(seed + 1)
    for d in range(days):
        dense, labels, bags, logits = sample_day(g, rows, seed)
        np.save(folder / f"day_{d}_dense.npy", dense)
        np.save(folder / f"day_{d}_labels.npy", labels)
        np.save(folder / f"day_{d}_sparse.npy", np.stack([bag[:, 0] for bag in bags], axis=1))
        np.savez(folder / f"day_{d}_sparse_multi_hot.npz", **{str(k): bag for k, bag in enumerate(bags)})
    return logits


def config(folder, **overrides) -> DLRMConfig:
    return DLRMConfig(**({"data": "criteo_1tb", "data_path": str(folder), "table_rows": TABLES,
                          "batch_size": 256} | overrides))


@pytest.fixture(scope="module")
def criteo(tmp_path_factory):
    folder = tmp_path_factory.mktemp("criteo")
    write_criteo(folder)
    return folder


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COBENCH_CACHE_DIR", str(tmp_path / "cache"))


# -- reading ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sparse", ["multi_hot", "one_hot"])
def test_batches_hold_the_files_rows_in_the_models_layout(criteo, sparse):
    workload = DLRMWorkload(config(criteo, criteo_sparse=sparse), RunContext(device=CPU, seed=1))
    batch = next(workload.source.train_batches())
    hot = HOT if sparse == "multi_hot" else (1,) * 26
    assert workload.shape.multi_hot_sizes == hot  # one-hot files: the planner's pooling factors follow
    assert batch.dense.dtype == torch.float32 and batch.dense.shape == (256, 13)
    assert batch.labels.dtype == torch.float32 and batch.labels.shape == (256,)
    assert set(batch.labels.unique().tolist()) <= {0.0, 1.0} and batch.planted_logits is None
    assert batch.sparse.keys() == [f"cat_{k}" for k in range(26)]
    assert batch.sparse.values().dtype == torch.int32  # as TorchRec's own Criteo reader gives them
    assert batch.sparse.lengths().tolist() == [h for h in hot for _ in range(256)]
    assert torch.equal(batch.dense, torch.from_numpy(np.load(criteo / "day_0_dense.npy")[:256]))
    if sparse == "multi_hot":
        with np.load(criteo / "day_0_sparse_multi_hot.npz") as npz:
            assert torch.equal(batch.sparse["cat_20"].values(), torch.from_numpy(npz["20"][:256].reshape(-1)))
    else:
        column = np.load(criteo / "day_0_sparse.npy")[:256, 20]
        assert torch.equal(batch.sparse["cat_20"].values(), torch.from_numpy(column))


def test_two_ranks_read_disjoint_shares_that_together_are_the_whole_set(criteo):
    days = find_days(criteo, "multi_hot")
    ranks = [CriteoSource(days, 256, rank, 2, TABLES, [False] * 26) for rank in range(2)]
    epoch = ranks[0].batches_per_epoch
    assert epoch == 6000 // 256 and ranks[0].train_samples == epoch * 256
    train = np.concatenate([np.load(criteo / f"day_{d}_dense.npy") for d in range(2)])
    streams = [r.train_batches() for r in ranks]
    for g in range(epoch):  # global batch g = rank 0's half, then rank 1's (crossing day_0 → day_1 on the way)
        halves = [next(s).dense.numpy() for s in streams]
        assert np.array_equal(np.concatenate(halves), train[g * 256:(g + 1) * 256])
    assert np.array_equal(next(streams[0]).dense.numpy(), train[:128])  # the next epoch starts again
    # validation: the first ceil(3000 / 2) rows of the last day, one contiguous share per rank, every row once
    val = [torch.cat([b.dense for b in r.val_batches()]).numpy() for r in ranks]
    assert ranks[0].val_rows == 1500 and ranks[0].test_rows == 1500 and len(val[0]) == len(val[1]) == 750
    assert np.array_equal(np.concatenate(val), np.load(criteo / "day_2_dense.npy")[:1500])


def test_the_same_seed_gives_the_same_batches(criteo):
    def first_batches(seed):
        workload = DLRMWorkload(config(criteo), RunContext(device=CPU, seed=seed))
        stream = workload.source.train_batches()
        return [next(stream) for _ in range(3)]

    for a, b in zip(first_batches(5), first_batches(5), strict=True):
        assert torch.equal(a.sparse.values(), b.sparse.values()) and torch.equal(a.labels, b.labels)


def test_ids_are_checked_once_per_file_and_tables_at_the_row_cap_hash_them(criteo, tmp_path):
    DLRMWorkload(config(criteo), RunContext(device=CPU, seed=1))
    assert len(list((tmp_path / "cache" / "data" / "criteo_ids").glob("*.json"))) == 3  # one scan per day, kept
    # rows cut to the cap hash the ids modulo the rows, as MLPerf's 40M tables do
    capped = DLRMWorkload(config(criteo, table_rows=[32] * 26, max_table_rows=32), RunContext(device=CPU, seed=1))
    assert int(next(capped.source.train_batches()).sparse.values().max()) < 32


# -- bad input: exit 2 before any run exists -----------------------------------------------------


def _copy(criteo, folder, skip=()):
    folder.mkdir()
    for path in criteo.iterdir():
        if path.name not in skip:
            (folder / path.name).write_bytes(path.read_bytes())
    return folder


def _broken(kind, criteo, folder):
    if kind == "missing path":
        return folder / "nowhere", r"'workload.data_path': .*nowhere does not exist.*criteo-1tb-click-logs"
    if kind == "empty folder":
        folder.mkdir()
        return folder, r"expected day_\{d\}_dense.npy, day_\{d\}_labels.npy and day_\{d\}_sparse_multi_hot.npz"
    if kind == "missing file":
        return _copy(criteo, folder, skip={"day_1_labels.npy"}), r"day_1_labels.npy missing"
    if kind == "row counts":
        _copy(criteo, folder)
        np.save(folder / "day_1_labels.npy", np.zeros((2999, 1), dtype=np.int32))
        return folder, r"day 1: the arrays' row counts disagree \(day_1_dense.npy 3000, day_1_labels.npy 2999"
    if kind == "ids":
        _copy(criteo, folder)
        with np.load(folder / "day_2_sparse_multi_hot.npz") as npz:
            arrays = {k: npz[k] for k in npz.files}
        arrays["7"][5, 0] = ROWS + 10
        np.savez(folder / "day_2_sparse_multi_hot.npz", **arrays)
        return folder, rf"day_2_sparse_multi_hot.npz: feature cat_7 has ids 0 … {ROWS + 10} but its table has {ROWS}"
    if kind == "truncated":
        _copy(criteo, folder)
        data = (folder / "day_0_dense.npy").read_bytes()
        (folder / "day_0_dense.npy").write_bytes(data[:-100])
        return folder, r"day_0_dense.npy: its header says 3000 rows but the file is shorter"
    raise AssertionError(kind)


KINDS = ["missing path", "empty folder", "missing file", "row counts", "ids", "truncated"]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_files_are_refused_by_the_constructor_naming_the_file(criteo, tmp_path, kind):
    folder, message = _broken(kind, criteo, tmp_path / "data")
    with pytest.raises(DataError, match=message):  # a ValueError: the CLI exits 2
        DLRMWorkload(config(folder), RunContext(device=CPU, seed=1))


@pytest.mark.parametrize("kind", ["missing path", "empty folder", "ids"])
def test_bad_files_exit_2_through_the_cli_before_any_run(criteo, tmp_path, calibration_cache, capsys, kind):
    folder, message = _broken(kind, criteo, tmp_path / "data")
    results = tmp_path / "results"
    code = main(["run", "workload=dlrm", "workload.data=criteo_1tb", f"workload.data_path={folder}",
                 f"workload.table_rows=[{','.join(map(str, TABLES))}]", f"results_dir={results}",
                 f"platform.calibration_cache={calibration_cache}"])
    assert code == 2
    assert re.search(message, capsys.readouterr().err), kind
    assert mlflow_runs(results) == []


def test_a_file_that_goes_bad_mid_run_fails_the_step_with_its_name(criteo, tmp_path):
    folder = _copy(criteo, tmp_path / "data")
    workload = DLRMWorkload(config(folder, batch_size=512), RunContext(device=CPU, seed=1))
    workload.setup()
    workload.step()
    (folder / "day_1_sparse_multi_hot.npz").write_bytes(b"")  # replaced while training
    with pytest.raises(DataError, match=r"day_1_sparse_multi_hot.npz:\d+: rows .* could not be read"):
        for _ in range(12):  # day_1 starts at global batch 6 (3000 rows / 512)
            workload.step()
    workload.teardown()


def test_the_model_learns_the_hidden_click_model_within_a_step_budget(tmp_path, one_thread):
    """Trains until the target, evaluating every 10 steps: the margin is the budget, not a fixed step count."""
    logits = write_criteo(tmp_path / "data")
    labels = np.load(tmp_path / "data" / "day_2_labels.npy").reshape(-1)
    oracle = roc_auc(torch.from_numpy(logits[:1500]), torch.from_numpy(labels[:1500]))  # the validation half
    workload = DLRMWorkload(config(tmp_path / "data"), RunContext(device=CPU, seed=1))
    workload.setup()
    assert oracle > 0.75 and workload.evaluate()["auc"] < 0.6  # learnable, and not learnt yet
    target, budget, steps = 0.5 + 0.85 * (oracle - 0.5), 200, 0
    while steps < budget and workload.evaluate()["auc"] < target:
        for _ in range(10):
            assert workload.step().data_wait_s is not None
        steps += 10
    assert workload.evaluate()["auc"] >= target, f"AUC below {target:.4f} after {budget} steps"
    workload.teardown()


# -- end to end ---------------------------------------------------------------------------------


def write_tsv_days(folder, days: int = 3, rows: int = 3000, seed: int = 0) -> None:
    """Raw Criteo TSV days: label, 13 integers, 26 hex values; some values missing (empty)."""
    folder.mkdir(parents=True, exist_ok=True)
    g = np.random.default_rng(seed + 1)
    for d in range(days):
        dense, labels, bags, _ = sample_day(g, rows, seed)
        counts = np.expm1(dense).round().astype(np.int64)
        raw_ids = [(bag[:, 0].astype(np.int64) * 2654435761 + 977 * k) % 2**32 for k, bag in enumerate(bags)]
        lines = []
        for i in range(rows):
            ints = ["" if (i + j) % 17 == 0 else str(counts[i, j]) for j in range(13)]
            cats = ["" if (i + k) % 23 == 0 else f"{int(raw_ids[k][i]):08x}" for k in range(26)]
            lines.append("\t".join([str(labels[i, 0]), *ints, *cats]))
        (folder / f"day_{d}").write_text("\n".join(lines) + "\n")


def test_prepared_tsv_days_train_to_the_target_through_the_cli(tmp_path, calibration_cache):
    write_tsv_days(tmp_path / "raw")
    out = tmp_path / "prepared"
    hot = [str(h) for h in HOT]
    assert main(["data", "prepare", "criteo", "--input-dir", str(tmp_path / "raw"), "--out", str(out), "--multi-hot",
                 "--multi-hot-sizes", *hot]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [MANIFEST] + [f"day_{d}_{part}" for d in range(3)
                      for part in ("dense.npy", "labels.npy", "sparse.npy", "sparse_multi_hot.npz")])
    dense, labels, sparse = (np.load(out / f"day_2_{part}.npy") for part in ("dense", "labels", "sparse"))
    assert (dense.dtype, labels.dtype, sparse.dtype) == (np.float32, np.int32, np.int32)
    assert dense.shape == (3000, 13) and labels.shape == (3000, 1) and sparse.shape == (3000, 26)
    with np.load(out / "day_0_sparse_multi_hot.npz") as npz:
        assert [npz[str(k)].shape for k in range(26)] == [(3000, h) for h in HOT]
        assert np.array_equal(npz["3"][:, 0], np.load(out / "day_0_sparse.npy")[:, 3])  # MLPerf: first id is the id
    manifest = json.loads((out / MANIFEST).read_text())["files"]
    table_rows = [max(manifest[f"day_{d}_sparse.npy"]["max_ids"][k] for d in range(3)) + 1 for k in range(26)]
    results = tmp_path / "results"
    budget = 120
    code = main(["run", "workload=dlrm", "workload.data=criteo_1tb", f"workload.data_path={out}",
                 f"workload.table_rows=[{','.join(map(str, table_rows))}]", "workload.batch_size=256",
                 "workload.eval_batches=null", "workload.auc_target=0.70", "runner.warmup_steps=1",
                 f"runner.steps={budget}", "runner.eval_interval=10", "runner.stop_at_target=true",
                 "runner.progress=false", "platform.num_threads=1", f"results_dir={results}",
                 f"platform.calibration_cache={calibration_cache}"])
    assert code == 0
    (run,) = mlflow_runs(results)
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert metrics["auc"] >= 0.70 and metrics["data_wait_ms_p50"] >= 0
    assert "auc_oracle" not in metrics  # real data has no hidden model to compare with
    (history,) = [json.loads(p.read_text())["quality_history"] for p in results.glob("runs/*/metrics.json")]
    assert history[-1][0] < budget * 256  # stopped at the target, inside the budget


def test_one_hot_days_read_as_torchrecs_own_criteo_reader_reads_them(criteo):
    """The in-place reader gives, batch for batch, what TorchRec's InMemoryBinaryCriteoIterDataPipe gives for
    the same one-hot files: training days in file order, then the last day's first half as validation."""
    from torchrec.datasets.criteo import InMemoryBinaryCriteoIterDataPipe

    def files(days):
        return [[str(criteo / f"day_{d}_{kind}.npy") for d in days] for kind in ("dense", "sparse", "labels")]

    ours = CriteoSource(find_days(criteo, "one_hot"), 256, 0, 1, TABLES, [False] * 26)
    for stage, days, mine in (("train", (0, 1), ours.train_batches()), ("val", (2,), ours.val_batches())):
        theirs = list(InMemoryBinaryCriteoIterDataPipe(stage, *files(days), batch_size=256, rank=0, world_size=1,
                                                       drop_last=stage == "train"))
        assert len(theirs) == (ours.batches_per_epoch if stage == "train" else math.ceil(1500 / 256))
        for reference, batch in zip(theirs, mine, strict=False):
            assert torch.equal(batch.dense, reference.dense_features)
            assert torch.equal(batch.labels, reference.labels.float())
            assert torch.equal(batch.sparse.values(), reference.sparse_features.values())
            assert torch.equal(batch.sparse.lengths(), reference.sparse_features.lengths())
