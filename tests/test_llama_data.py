"""Llama on real text: C4 as AllenAI ships it, Megatron indexed datasets, and `cobench data prepare c4`.

Tiny files in exactly those formats are written here (tests/data_files.py): C4 JSON-lines shards gzipped under
their distributed names, a BPE tokenizer trained with `tokenizers`, indexed datasets written by megatron-core's
own builder. Runs go through the real CLI (`suite.cli.main`) into a store under tmp_path.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import mlflow_runs
from data_files import make_bpe_tokenizer, write_c4, write_indexed

from workloads.base import RunContext
from workloads.data_source import DataError
from workloads.llama import c4
from workloads.llama.config import LlamaConfig
from workloads.llama.sources import open_text_source
from workloads.llama.text_data import C4Stream, IndexedStream, IndexedTokens, Packer, pack_texts
from workloads.llama.tokenizer import load_tokenizer
from workloads.llama.workload import LlamaWorkload

TINY_RUN = ["runner.warmup_steps=1", "runner.steps=4", "runner.progress=false", "workload.batch_size=8",
            "workload.eval_sequences=16"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama_data")
    tokenizer = make_bpe_tokenizer(root / "tokenizer", vocab_size=320)
    folder = write_c4(root / "c4", train_shards=range(768, 772), validation_shards=range(0, 2),
                      documents_per_shard=60)
    tok = load_tokenizer(tokenizer)
    documents = [tok.encode(text) + [tok.eos_id] for text in c4.read_texts(folder / c4.shard_name("train", 768),
                                                                              "json")]
    train = write_indexed(root / "megatron" / "train", documents)
    val = write_indexed(root / "megatron" / "val", documents[:40])
    return {"root": root, "tokenizer": tokenizer, "c4": folder, "train": train, "val": val}


@pytest.fixture(autouse=True)
def _quiet_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _config(**values) -> LlamaConfig:
    return LlamaConfig(**{"batch_size": 8, "seq_len": 32, "eval_sequences": 8, **values})


def _source(cfg: LlamaConfig, rank: int = 0, world: int = 1, seed: int = 1234):
    return open_text_source(cfg, RunContext(torch.device("cpu"), seed, rank, world), cfg.batch_size // world,
                            cfg.model_args().vocab_size)


def _take(source, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    stream = source.make_batches()
    return [next(stream) for _ in range(count)]


@pytest.mark.parametrize("kind", ["c4", "megatron"])
def test_each_source_gives_shifted_int64_batches_of_the_local_size(data, kind):
    path = data["c4"] if kind == "c4" else data["train"]
    source = _source(_config(data=kind, data_path=str(path), tokenizer=str(data["tokenizer"])), rank=1, world=2)
    for inputs, targets in _take(source, 3):
        assert inputs.shape == targets.shape == (4, 32) and inputs.dtype == targets.dtype == torch.int64
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        assert 0 <= int(inputs.min()) and int(inputs.max()) < 320
    assert source.eval_windows.shape == (4, 33)  # rank 1's half of the 8 evaluation sequences


@pytest.mark.parametrize("reader", ["json", "datasets"])
def test_both_c4_readers_give_the_documents_in_order_and_name_a_bad_file(data, tmp_path, reader):
    good = data["c4"] / c4.shard_name("train", 768)
    expected = [json.loads(line)["text"] for line in gzip.open(good, "rt")]
    assert list(c4.read_texts(good, reader)) == expected
    for spoil, message in ((_truncate, "truncated"), (_no_text, "line 6 has no \"text\"")):
        bad = tmp_path / spoil.__name__ / good.name
        bad.parent.mkdir()
        shutil.copy(good, bad)
        spoil(bad)
        with pytest.raises(DataError, match=message) as caught:
            list(c4.read_texts(bad, reader))
        assert str(bad) in str(caught.value)


def test_two_ranks_read_disjoint_c4_files_that_together_are_all_of_them(data):
    tok = load_tokenizer(data["tokenizer"])
    files = c4.find_shards(data["c4"], "train", None)
    shares = [C4Stream(files, tok, 32, rank, 2, seed=0, shuffle_sequences=64).files for rank in (0, 1)]
    assert not set(shares[0]) & set(shares[1]) and sorted(shares[0] + shares[1]) == files
    urls = [{json.loads(line)["url"] for f in share for line in gzip.open(f, "rt")} for share in shares]
    assert not urls[0] & urls[1] and len(urls[0] | urls[1]) == 4 * 60


def test_two_ranks_take_disjoint_megatron_windows_that_together_are_all_of_them(data):
    tok = load_tokenizer(data["tokenizer"])
    tokens = IndexedTokens(data["train"], tok.eos_id, 512)
    count = tokens.window_count(32)
    orders = [IndexedStream(tokens, 32, count, rank, 2, seed=5, block=8).order(0) for rank in (0, 1)]
    assert not set(orders[0]) & set(orders[1]) and sorted(np.concatenate(orders)) == list(range(count))


@pytest.mark.parametrize("kind", ["c4", "megatron"])
def test_the_same_seed_gives_the_same_batches_and_another_seed_others(data, kind):
    path = data["c4"] if kind == "c4" else data["train"]
    cfg = _config(data=kind, data_path=str(path), tokenizer=str(data["tokenizer"]), shuffle_sequences=64)
    first, again, other = (_take(_source(cfg, seed=seed), 4) for seed in (7, 7, 8))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, other, strict=True))


def test_documents_are_joined_with_eos_and_windows_overlap_by_one_token(data):
    tok = load_tokenizer(data["tokenizer"])
    texts = list(c4.read_texts(data["c4"] / c4.shard_name("train", 768), "json"))
    stream = np.concatenate([np.asarray(tok.encode(t) + [tok.eos_id]) for t in texts])
    windows = np.concatenate(list(pack_texts(iter(texts), tok, 32)))
    assert len(windows) == (len(stream) - 1) // 32
    assert np.array_equal(windows[:, :-1].reshape(-1), stream[:len(windows) * 32])
    assert np.array_equal(windows[:-1, -1], windows[1:, 0])  # each window's last target starts the next
    assert np.array_equal(Packer(4, 0).add([[1, 2, 3], [4, 5]]), [[1, 2, 3, 0, 4]])


def test_megatron_documents_without_eos_get_it_after_each_document(data):
    tok = load_tokenizer(data["tokenizer"])
    with_eos = IndexedTokens(data["train"], tok.eos_id, 512)
    bare_docs = [[int(t) for t in with_eos.dataset.get(i)[:-1]] for i in range(len(with_eos.lengths))]
    bare = IndexedTokens(write_indexed(data["root"] / "bare" / "train", bare_docs), tok.eos_id, 512)
    assert not with_eos.appends_eos and bare.appends_eos and bare.total_tokens == with_eos.total_tokens
    for seq_len in (32, 1024):  # short windows are gathered position by position, long ones sliced
        picks = np.arange(bare.window_count(seq_len))  # every window, the last included
        assert len(picks) >= 2 and np.array_equal(bare.windows(picks, seq_len), with_eos.windows(picks, seq_len))


def test_eos_is_inserted_after_a_document_not_after_each_of_its_sequences(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{tmp_path / 'two'}.bin", dtype=np.int32)
    builder.add_document(np.array([1, 2, 3, 4, 5]), [2, 3])  # two documents of two sequences each
    builder.add_document(np.array([6, 7, 8]), [1, 2])
    builder.finalize(f"{tmp_path / 'two'}.idx")
    tokens = IndexedTokens(tmp_path / "two", eos_id=9, vocab_size=16)
    assert tokens.appends_eos and tokens.total_tokens == 10
    assert tokens.windows(np.array([0]), 9).tolist() == [[1, 2, 3, 4, 5, 9, 6, 7, 8, 9]]
    assert tokens.windows(np.array([1, 2]), 3).tolist() == [[4, 5, 9, 6], [6, 7, 8, 9]]


# -- through the CLI ------------------------------------------------------------------------------------------------

def _cli(results: Path, calibration_cache: str, *overrides: str) -> int:
    from suite.cli import main

    return main(["run", "workload=llama", f"results_dir={results}", f"platform.calibration_cache={calibration_cache}",
                 *overrides])


def _truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) // 2])


def _no_text(path: Path) -> None:
    lines = gzip.open(path, "rt").read().splitlines()
    lines[5] = json.dumps({"timestamp": "2019-04-01T12:00:00Z", "url": "https://example.com/x"})
    with gzip.open(path, "wt") as stream:
        stream.write("\n".join(lines) + "\n")


def _swap_index(data: dict[str, Path], prefix: Path) -> None:
    shutil.copy(f"{data['train']}.bin", f"{prefix}.bin")
    shutil.copy(f"{data['val']}.idx", f"{prefix}.idx")


BAD_INPUTS = {
    "missing folder": (lambda d, t: ["workload.data=c4", f"workload.data_path={t / 'nowhere'}"], "does not exist"),
    "folder without C4 files": (lambda d, t: ["workload.data=c4", f"workload.data_path={d['tokenizer']}"],
                                "c4-train.00000-of-01024.json.gz"),
    "truncated gzip": (lambda d, t: ["workload.data=c4", f"workload.data_path={_copy_c4(d, t, 769, _truncate)}"],
                       "truncated"),
    "line without text": (lambda d, t: ["workload.data=c4", f"workload.data_path={_copy_c4(d, t, 770, _no_text)}"],
                          "line 6 has no \"text\""),
    "tokenizer too large": (lambda d, t: ["workload.data=c4", "workload.vocab_size=300"],
                            "but the model's vocabulary has 300"),
    "idx not matching bin": (lambda d, t: ["workload.data=megatron", f"workload.data_path={_swapped(d, t)}"],
                             "does not match"),
}


def _copy_c4(data: dict[str, Path], tmp: Path, shard: int, spoil) -> Path:
    folder = tmp / "spoilt"
    shutil.copytree(data["c4"], folder)
    spoil(folder / c4.shard_name("train", shard))
    return folder


def _swapped(data: dict[str, Path], tmp: Path) -> Path:
    _swap_index(data, tmp / "swapped")
    return tmp / "swapped"


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_naming_the_problem_before_any_run(data, tmp_path, calibration_cache, capsys, case):
    overrides, expected = BAD_INPUTS[case]
    defaults = [f"workload.data_path={data['c4']}", f"workload.tokenizer={data['tokenizer']}"]
    results = tmp_path / "results"
    assert _cli(results, calibration_cache, *defaults, *overrides(data, tmp_path), *TINY_RUN) == 2
    assert expected in capsys.readouterr().err
    assert mlflow_runs(results) == [] and not (results / "runs").exists()


@pytest.mark.parametrize(("values", "expected"), [
    ({"data": "parquet"}, "allowed values: synthetic, c4, megatron"),
    ({"data": "c4", "data_recipe": "gpt3"}, "mlperf_llama31_8b"),
    ({"data": "c4", "train_shards": "900-800"}, "first <= last"),
    ({"data": "c4", "data_check": "some"}, "full, head"),
    ({"data": "c4", "eval_sequences": 0}, ">= 1"),
])
def test_bad_values_are_refused_as_config_errors(values, expected):
    with pytest.raises(ValueError, match="invalid config 'workload.") as caught:
        LlamaConfig(**values)
    assert expected in str(caught.value)


def test_missing_megatron_files_and_shards_name_what_was_expected(data, tmp_path):
    with pytest.raises(DataError, match=r"does not exist.*PREFIX.bin and PREFIX.idx"):
        _source(_config(data="megatron", data_path=str(tmp_path / "nothing"), tokenizer=str(data["tokenizer"])))
    (tmp_path / "only.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"only.idx does not exist"):
        _source(_config(data="megatron", data_path=str(tmp_path / "only"), tokenizer=str(data["tokenizer"])))


def test_a_file_that_goes_bad_mid_run_ends_the_run_failed_with_the_reason(data, tmp_path, calibration_cache):
    folder = _copy_c4(data, tmp_path, 771, _truncate)
    c4.check_head(folder / c4.shard_name("train", 771))  # its start is sound: only reading on finds the damage
    results = tmp_path / "results"
    code = _cli(results, calibration_cache, "workload.data=c4", f"workload.data_path={folder}",
                f"workload.tokenizer={data['tokenizer']}", "workload.data_check=head", "workload.train_shards=771",
                "workload.shuffle_sequences=8", *TINY_RUN, "runner.steps=400")
    (run,) = mlflow_runs(results)
    assert code == 1 and run.info.status == "FAILED"
    (run_dir,) = (results / "runs").iterdir()
    error = json.loads((run_dir / "metrics.json").read_text())["error"]
    assert c4.shard_name("train", 771) in error and "truncated" in error


def _finished(results: Path) -> dict:
    (run,) = mlflow_runs(results)
    assert run.info.status == "FINISHED"
    (run_dir,) = (results / "runs").iterdir()
    return json.loads((run_dir / "metrics.json").read_text())


def test_c4_trains_to_its_target_within_the_step_budget(data, tmp_path, calibration_cache):
    """No recipe, no configured target: the target is the evaluation tokens' unigram entropy, which a model
    reaches only by predicting from context. Evaluated every 5 steps; the run stops at the target (seen at 20 of
    the 100 steps allowed)."""
    budget = 100
    results = tmp_path / "results"
    assert _cli(results, calibration_cache, "workload.data=c4", f"workload.data_path={data['c4']}",
                f"workload.tokenizer={data['tokenizer']}", *TINY_RUN, f"runner.steps={budget}",
                "runner.eval_interval=5", "runner.stop_at_target=true") == 0
    record = _finished(results)
    metrics = record["metrics"]
    assert metrics["quality_target_reached"] == 1.0 and metrics["eval_loss"] <= metrics["eval_loss_target"]
    assert record["quality_history"][-1][0] <= budget * 8
    assert 0 <= metrics["data_wait_ms_p50"] < metrics["step_time_ms_p50"]


def test_prepared_c4_trains_as_megatron_data(data, tmp_path, calibration_cache):
    from suite.cli import main

    prefix = tmp_path / "prepared" / "c4-train"
    assert main(["data", "prepare", "c4", "--input", str(tmp_path / "nowhere"), "--tokenizer", str(data["tokenizer"]),
                 "--out", str(prefix)]) == 2
    assert not prefix.parent.exists()
    assert main(["data", "prepare", "c4", "--input", str(data["c4"]), "--tokenizer", str(data["tokenizer"]),
                 "--out", str(prefix)]) == 0
    tok = load_tokenizer(data["tokenizer"])
    prepared = IndexedTokens(prefix, tok.eos_id, 512)
    assert len(prepared.lengths) == 4 * 60 and not prepared.appends_eos
    val = tmp_path / "prepared" / "c4-validation"
    assert main(["data", "prepare", "c4", "--input", str(data["c4"]), "--split", "validation", "--tokenizer",
                 str(data["tokenizer"]), "--out", str(val), "--max-documents", "100"]) == 0
    results = tmp_path / "results"
    assert _cli(results, calibration_cache, "workload.data=megatron", f"workload.data_path={prefix}",
                f"workload.val_data_path={val}", f"workload.tokenizer={data['tokenizer']}", *TINY_RUN) == 0
    metrics = _finished(results)["metrics"]
    assert metrics["eval_loss"] > 0 and metrics["data_wait_ms_p50"] >= 0


def test_synthetic_steps_report_their_data_wait_too():
    workload = LlamaWorkload(LlamaConfig(train_batches=2, eval_batches=1), RunContext(torch.device("cpu"), 0))
    workload.setup()
    try:
        waits = [workload.step().data_wait_s for _ in range(3)]
    finally:
        workload.teardown()
    assert all(w is not None and 0 <= w < 0.1 for w in waits)


def test_the_recipe_fills_what_mlperf_sets_and_leaves_overrides_alone(data):
    recipe = "mlperf_llama31_8b"
    with pytest.raises(DataError, match="lacks 252 of the 256"):  # shards 768-1023, only 768-771 here
        _source(_config(data="c4", data_path=str(data["c4"]), tokenizer=str(data["tokenizer"]), data_recipe=recipe,
                        eval_sequences=None))
    source = _source(_config(data="c4", data_path=str(data["c4"]), tokenizer=str(data["tokenizer"]),
                             data_recipe=recipe, train_shards="768-771", eval_sequences=8))
    assert source.target == 3.3 and source.recipe.eval_every_sequences == 12_288 and source.eval_sequences == 8
