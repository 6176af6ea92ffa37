"""workload=llama_infer on real prompts (workload.prompts): every accepted JSON lines shape loads with the
file's own lengths and budgets, each bad file is refused by the CLI before any MLflow run exists, and
Offline and Server runs serve the file under LoadGen with data_wait_ms_p50 logged."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import mlflow_runs
from data_files import make_bpe_tokenizer, sentences

from suite.cli import main
from workloads.data_source import DataError
from workloads.llama.tokenizer import load_tokenizer
from workloads.llama_infer.loadgen_sut import detail_log_entries
from workloads.llama_infer.prompts import load_prompts

TINY_VOCAB, TINY_CONTEXT, DEFAULT_BUDGET = 512, 256, 48  # the tiny preset's and workload.output_max's


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bpe_tokenizer(tmp_path_factory.mktemp("tokenizer"), vocab_size=512)  # 461 ids: fits tiny's 512


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path):
    return load_tokenizer(tokenizer_dir)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def load(path: Path, tokenizer: Path | None = None, context: int = TINY_CONTEXT, truncate: bool = False):
    return load_prompts(path, tokenizer, TINY_VOCAB, context, DEFAULT_BUDGET, truncate)


# -- each accepted shape --
TEXTS = sentences(6, seed=3)
ANSWERS = sentences(6, seed=4, words=4)


def test_text_prompts_are_tokenized_after_bos_with_budgets_from_the_file(tmp_path, tokenizer_dir, tok):
    records = [{"prompt": TEXTS[0], "max_new_tokens": 7}, {"text": TEXTS[1], "max_tokens": 3}, {"prompt": TEXTS[2]},
               {"prompt": TEXTS[3], "ref_output": ANSWERS[3]}]
    loaded = load(write_jsonl(tmp_path / "p.jsonl", records), tokenizer_dir)
    assert loaded.requests.prompts == [[tok.bos_id, *tok.encode(t)] for t in TEXTS[:4]]
    # no budget: workload.output_max; a reference answer: its length in tokens
    assert loaded.requests.max_new_tokens == [7, 3, DEFAULT_BUDGET, len(tok.encode(ANSWERS[3]))]
    assert loaded.truncated == 0


def test_token_id_prompts_are_served_as_given_without_a_tokenizer(tmp_path):
    records = [{"input_ids": [5, 6, 7], "max_new_tokens": 2}, {"tokens": [9] * 20},
               {"input_ids": [1, 2], "tok_ref_output": [3, 4, 5, 6]}]
    loaded = load(write_jsonl(tmp_path / "ids.jsonl", records))
    assert loaded.requests.prompts == [[5, 6, 7], [9] * 20, [1, 2]]
    assert loaded.requests.max_new_tokens == [2, DEFAULT_BUDGET, 4]  # the reference answer's length


def mlperf_records(tok) -> list[dict]:
    """MLPerf's llama3.1-8b cnn_eval.json records: the article, its templated prompt as ids, the reference summary."""
    template = ("In very brief sentences, summarize the following news article. Only return the summary.\n"
                "Article: {input}\nSummary: ")
    return [{"instruction": {"llama": template}, "input": text,
             "tok_input": [tok.bos_id, *tok.encode(template.format(input=text))], "output": answer}
            for text, answer in zip(TEXTS, ANSWERS, strict=True)]


def test_mlperf_cnn_dailymail_records_serve_the_templated_ids_with_the_reference_summary_length(
        tmp_path, tokenizer_dir, tok):
    records = mlperf_records(tok)
    loaded = load(write_jsonl(tmp_path / "cnn_eval.jsonl", records), tokenizer_dir)
    assert loaded.requests.prompts == [r["tok_input"] for r in records]  # tok_input, not the bare article
    assert loaded.requests.max_new_tokens == [len(tok.encode(a)) for a in ANSWERS]
    # the same records as one JSON array, the layout MLPerf distributes
    (tmp_path / "cnn_eval.json").write_text(json.dumps(records, indent=4))
    as_array = load(tmp_path / "cnn_eval.json", tokenizer_dir)
    assert as_array.requests == loaded.requests


def test_prompts_over_the_context_are_cut_from_the_left_when_asked(tmp_path):
    records = [{"input_ids": list(range(1, 41)), "max_new_tokens": 8}, {"input_ids": [1, 2, 3], "max_new_tokens": 8}]
    loaded = load(write_jsonl(tmp_path / "long.jsonl", records), context=32, truncate=True)
    assert loaded.requests.prompts == [list(range(17, 41)), [1, 2, 3]]  # 24 + 8 = 32: the last tokens kept
    assert loaded.truncated == 1


def test_a_json_value_of_the_wrong_type_names_its_field_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "max_new_tokens": 2}, {"input_ids": "1 2 3"}])
    with pytest.raises(DataError, match=r"bad.jsonl line 2: 'input_ids' must be a list of token ids"):
        load(path)


# -- bad input: the CLI exits 2 and no MLflow run exists --
def cli_run(tmp_path: Path, *overrides: str) -> tuple[int, Path]:
    results = tmp_path / "results"
    # no GEMM calibration: these runs report no MFU, and measuring it would write the user's calibration cache
    code = main(["run", "workload=llama_infer", "platform=cpu", "platform.calibrate=false", "runner.progress=false",
                 f"results_dir={results}", *overrides])
    return code, results


def bad_inputs(tmp_path: Path, tokenizer_dir: Path) -> dict[str, tuple[list[str], str]]:
    """name → (overrides, what stderr must say), each file written here."""
    d = tmp_path
    (d / "empty.jsonl").write_text("\n")
    (d / "notjson.jsonl").write_text('{"prompt": "fine"}\n{"prompt": "cut\n')
    write_jsonl(d / "nofield.jsonl", [{"prompt": "a"}, {"prompt": "b"}, {"question": "where?", "answer": "here"}])
    write_jsonl(d / "vocab.jsonl", [{"input_ids": [1, 2, 600]}, {"input_ids": [3]}, {"input_ids": [900, 4]}])
    write_jsonl(d / "text.jsonl", [{"text": "no tokenizer for me"}])
    write_jsonl(d / "long.jsonl", [{"input_ids": [1] * 10}, {"input_ids": [1] * 40, "max_new_tokens": 8}])
    return {
        "missing file": ([f"workload.prompts={d / 'none.jsonl'}"], r"none.jsonl does not exist; expected a JSON lines"),
        "empty file": ([f"workload.prompts={d / 'empty.jsonl'}"], r"empty.jsonl holds no prompts"),
        "not JSON": ([f"workload.prompts={d / 'notjson.jsonl'}"], r"notjson.jsonl line 2 is not JSON"),
        "no prompt field": ([f"workload.prompts={d / 'nofield.jsonl'}"],
                            r"nofield.jsonl line 3 has no prompt \(its keys: answer, question\); give token ids as "
                            r"one of tok_input, input_ids, tokens or text as one of prompt, text, input"),
        "ids outside the vocabulary": ([f"workload.prompts={d / 'vocab.jsonl'}"],
                                       r"vocab.jsonl line 1: token id 600 .* vocabulary of 512 ids.*"
                                       r"set workload.vocab_size=901"),  # the file's largest id
        "text without a tokenizer": ([f"workload.prompts={d / 'text.jsonl'}"],
                                     r"text.jsonl line 1 has a text prompt \('text'\) but workload.tokenizer is "
                                     r"not set"),
        "tokenizer over the vocabulary": ([f"workload.prompts={d / 'text.jsonl'}",
                                           f"workload.tokenizer={tokenizer_dir}", "workload.vocab_size=256"],
                                          r"has 461 token ids but the model's vocabulary has 256"),
        "prompt over the context": ([f"workload.prompts={d / 'long.jsonl'}", "workload.max_seq_len=32",
                                     "workload.output_max=4"],
                                    r"long.jsonl line 2: a prompt of 40 tokens plus 8 new tokens exceeds the model's "
                                    r"context of 32 tokens \(1 of 2 queries do.*raise workload.max_seq_len to at least "
                                    r"48, or set workload.truncate_prompts=true"),
        "tokenizer without prompts": ([f"workload.tokenizer={tokenizer_dir}"],
                                      r"workload.tokenizer.*workload.prompts, which is not set"),
    }


def test_every_bad_prompts_file_exits_2_before_any_run_exists(tmp_path, tokenizer_dir, capsys):
    for name, (overrides, message) in bad_inputs(tmp_path, tokenizer_dir).items():
        code, results = cli_run(tmp_path / name.replace(" ", "_"), *overrides)
        err = capsys.readouterr().err
        assert code == 2, (name, err)
        assert "cobench run: error:" in err, name
        assert re.search(message, err), (name, err)
        assert not (results / "mlflow.db").exists() or mlflow_runs(results) == [], name


# -- LoadGen runs on the file --
def run_metrics(results: Path) -> dict[str, float]:
    (run,) = mlflow_runs(results)
    assert run.info.status == "FINISHED", run.data.tags
    return run.data.metrics


@pytest.mark.slow
def test_offline_run_serves_every_query_of_a_text_file_with_its_budget(tmp_path, tokenizer_dir, tok):
    records = [{"input": t, "output": a} for t, a in zip(sentences(50, seed=5), sentences(50, seed=6, words=4),
                                                          strict=True)]
    path = write_jsonl(tmp_path / "cnn.jsonl", records)
    budgets = [len(tok.encode(r["output"])) for r in records]
    code, results = cli_run(tmp_path, f"workload.prompts={path}", f"workload.tokenizer={tokenizer_dir}",
                            "workload.scenario=Offline", "workload.offline_expected_qps=1000",
                            "workload.min_queries=100", "workload.warmup_requests=4")
    assert code == 0
    metrics = run_metrics(results)
    assert metrics["result_valid"] == 1.0
    # LoadGen issues whole permutations of the library: 100 queries = the file twice, each to its budget
    assert metrics["completed_tokens"] == 2 * sum(budgets)
    assert metrics["tokens_per_s"] > 0 and metrics["prompts_truncated"] == 0
    assert 0 < metrics["data_wait_ms_p50"] < 100
    (run_dir,) = (results / "runs").iterdir()
    assert detail_log_entries(run_dir / "mlperf_log_detail.txt")["qsl_reported_performance_count"] == 50
    mllog = (run_dir / "mllog_rep0.txt").read_text()
    assert '"key": "train_samples", "value": 50' in mllog


@pytest.mark.slow
def test_server_run_on_token_ids_reports_ttft_tpot_and_data_wait(tmp_path):
    ids = [[(7 * i + j) % 500 + 1 for j in range(8 + i % 40)] for i in range(40)]
    path = write_jsonl(tmp_path / "ids.jsonl",
                       [{"input_ids": p, "max_new_tokens": 2 + i % 9} for i, p in enumerate(ids)])
    # 40 queries: too few for LoadGen's early stopping to judge the p99s (the verdict is not what this checks)
    code, results = cli_run(tmp_path, f"workload.prompts={path}", "workload.scenario=Server",
                            "workload.server_target_qps=40", "workload.min_queries=40", "workload.warmup_requests=4")
    assert code == 0
    metrics = run_metrics(results)
    for key in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "tokens_per_s", "data_wait_ms_p50"):
        assert metrics[key] > 0, key
    assert metrics["completed_tokens"] == sum(2 + i % 9 for i in range(40))


def test_every_query_the_engine_serves_records_its_data_wait():
    """The figure behind data_wait_ms_p50, for synthetic requests and a file's alike: the engine times how long
    each query's prompt tokens took to reach the device once it took the query up."""
    import torch

    from workloads.llama.model import PRESETS, build_model
    from workloads.llama_infer.decoder import CachedDecoder
    from workloads.llama_infer.engine import Request, ServingEngine

    engine = ServingEngine(CachedDecoder(build_model(PRESETS["tiny"], torch.device("cpu"), 0)), 2, 64)
    requests = [Request(i, [1 + i] * (3 + i), 2) for i in range(5)]  # 5 queries through 2 slots: 3 admissions
    for request in requests:
        engine.submit(request)
    while not engine.idle:
        engine.step()
    assert all(r.data_wait_s is not None and 0 < r.data_wait_s < 1 for r in requests)
