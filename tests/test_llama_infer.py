"""workload=llama_infer: the cached decoder against transformers, continuous batching, LoadGen runs,
bad input refused before LoadGen starts, capacity search and the serving cost."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import mlflow_runs

from harness.cost import PlatformCost, serving_cost_metrics
from workloads.base import RunContext
from workloads.llama import Transformer, from_hf_config, load_hf_state_dict
from workloads.llama.model import PRESETS, build_model
from workloads.llama_infer.capacity import search_qps_at_slo
from workloads.llama_infer.config import LlamaInferConfig
from workloads.llama_infer.decoder import CachedDecoder
from workloads.llama_infer.engine import Request, ServingEngine, generate
from workloads.llama_infer.loadgen_sut import LoadGenResult
from workloads.llama_infer.workload import LlamaInferWorkload

# GQA (4 query heads over 2 KV heads) and Llama 3 RoPE scaling in all three frequency regimes
HF_CONFIG = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def hf_and_ours():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG)).eval()
    with torch.no_grad():
        for param in hf.parameters():
            if param.ndim == 1:  # norm gains start at 1, which would hide swapped norms
                param.uniform_(0.5, 1.5)
    ours = Transformer(from_hf_config(hf.config))
    load_hf_state_dict(ours, hf.state_dict())
    return hf, CachedDecoder(ours)


def _hf_generate(hf, prompt: list[int], new_tokens: int, **kwargs):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
                      pad_token_id=HF_CONFIG["vocab_size"] - 1, **kwargs)
    return out.sequences[0, len(prompt):].tolist(), [logits[0] for logits in out.logits]


def _prompts(lengths, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, HF_CONFIG["vocab_size"], (n,), generator=generator).tolist() for n in lengths]


def test_continuous_batching_gives_transformers_greedy_tokens_and_logits(hf_and_ours):
    hf, decoder = hf_and_ours
    prompts = _prompts((5, 31, 9, 17, 3, 24))
    # 2 slots for 6 requests: requests join as others leave, prefill is batched over unequal lengths
    engine = ServingEngine(decoder, max_batch=2, max_len=64)
    requests = [Request(i, p, NEW_TOKENS - i, record_logits=True) for i, p in enumerate(prompts)]
    for request in requests:
        engine.submit(request)
    most_running = 0
    while not engine.idle:
        engine.step()
        most_running = max(most_running, len(engine.running))
    assert most_running == 2
    for request in requests:
        tokens, logits = _hf_generate(hf, list(request.prompt), request.max_new_tokens,
                                      min_new_tokens=request.max_new_tokens)
        assert request.tokens == tokens
        assert request.finish_reason == "length"
        torch.testing.assert_close(torch.stack(request.logits), torch.stack(logits), rtol=1e-5, atol=1e-5)


def test_a_request_joining_a_running_batch_decodes_as_if_alone(hf_and_ours):
    _, decoder = hf_and_ours
    early, late = _prompts((20, 7), seed=2)
    alone = generate(ServingEngine(decoder, 4, 64), [late], NEW_TOKENS)[0]
    engine = ServingEngine(decoder, 4, 64)
    first, second = Request(0, early, NEW_TOKENS), Request(1, late, NEW_TOKENS)
    engine.submit(first)
    for _ in range(5):
        engine.step()
    engine.submit(second)  # joins while `first` is mid-way
    while not engine.idle:
        engine.step()
    assert second.tokens == alone
    assert len(first.tokens) == NEW_TOKENS


def test_generation_stops_at_eos_like_transformers(hf_and_ours):
    hf, decoder = hf_and_ours
    prompt = _prompts((11,), seed=3)[0]
    free_run, _ = _hf_generate(hf, prompt, NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    eos = free_run[4]
    expected, _ = _hf_generate(hf, prompt, NEW_TOKENS, eos_token_id=eos)
    engine = ServingEngine(decoder, 2, 64, eos_token_id=eos)
    request = Request(0, prompt, NEW_TOKENS)
    engine.submit(request)
    while not engine.idle:
        engine.step()
    assert request.tokens == expected[: expected.index(eos) + 1]
    assert request.finish_reason == "eos" and len(request.tokens) <= 5


def test_engine_refuses_a_request_longer_than_its_context(hf_and_ours):
    _, decoder = hf_and_ours
    engine = ServingEngine(decoder, 2, 32)
    with pytest.raises(ValueError, match="exceeds the context"):
        engine.submit(Request(0, [1] * 30, 8))


# -- bad configuration: refused before anything runs --
@pytest.mark.parametrize(("override", "message"), [
    ({"scenario": "MultiStream"}, "scenario.*Offline, Server, SingleStream"),
    ({"server_target_qps": 0.0}, "server_target_qps.*must be > 0"),
    ({"mlperf_model": "gptj"}, "mlperf_model.*llama3_1-8b"),
    ({"find_qps_at_slo": True, "scenario": "Offline"}, "find_qps_at_slo.*Server"),
])
def test_config_refuses_bad_values(override, message):
    with pytest.raises(ValueError, match=message):
        LlamaInferConfig(**override)


def _ctx(tmp_path: Path) -> RunContext:
    return RunContext(device=torch.device("cpu"), seed=0, work_dir=tmp_path)


def test_prompts_longer_than_the_context_are_refused_at_construction(tmp_path):
    config = LlamaInferConfig(prompt_max=240, output_max=48)  # tiny's context is 256
    with pytest.raises(ValueError, match="workload.prompt_max.*exceed the model's context of 256"):
        LlamaInferWorkload(config, _ctx(tmp_path))


def test_an_slo_no_load_can_meet_fails_before_loadgen_starts(tmp_path):
    config = LlamaInferConfig(latency_scale=1e-6, warmup_requests=2)  # TTFT 2 us, TPOT 0.1 us
    workload = LlamaInferWorkload(config, _ctx(tmp_path))
    with pytest.raises(ValueError, match="cannot be met at any load.*Raise workload.latency_scale to at least"):
        workload.setup()
    assert not (tmp_path / "loadgen").exists()


# -- LoadGen --
def _fast(**override) -> LlamaInferConfig:
    return LlamaInferConfig(**{"latency_scale": 0.2, "prompt_mean": 48, "prompt_max": 96, "output_max": 24,
                               "warmup_requests": 8, **override})


@pytest.mark.slow
def test_offline_run_reports_loadgen_throughput(tmp_path):
    workload = LlamaInferWorkload(_fast(scenario="Offline", offline_expected_qps=1000.0), _ctx(tmp_path))
    workload.setup()
    step = workload.step()
    metrics = workload.extra_metrics()
    assert metrics["result_valid"] == 1.0
    assert step.samples == 600 and step.tokens == metrics["completed_tokens"]
    assert metrics["tokens_per_s"] > 0 and metrics["samples_per_s"] > 0
    assert "ttft_ms_p99" not in metrics  # Offline bounds no latency
    assert "Result is : VALID" in (tmp_path / "mlperf_log_summary.txt").read_text()
    workload.teardown()


@pytest.mark.slow
@pytest.mark.alone  # VALID needs p99 latencies within their bounds and the served rate at the target: a quiet CPU
def test_server_run_is_valid_and_logs_loadgen_figures_to_mlflow(cobench, tmp_path):
    proc = cobench("run", "workload=llama_infer", "workload.scenario=Server", "platform=cpu", "runner.progress=false",
                   "workload.server_target_qps=30", "workload.warmup_requests=8")
    assert proc.returncode == 0, proc.stderr
    (run,) = mlflow_runs(tmp_path / "results")
    metrics = run.data.metrics
    assert run.info.status == "FINISHED" and run.data.tags["scenario"] == "Server"
    assert metrics["result_valid"] == 1.0 and metrics["quality_target_reached"] == 1.0
    for key in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "tokens_per_s", "samples_per_s"):
        assert metrics[key] > 0, key
    assert metrics["ttft_ms_p50"] <= metrics["ttft_ms_p99"] <= metrics["ttft_limit_ms"] == 400.0
    assert metrics["tpot_ms_p99"] <= metrics["tpot_limit_ms"] == 20.0
    assert 25 < metrics["samples_per_s"] < 35  # Poisson arrivals at 30/s, all served
    assert metrics["cost_per_million_tokens"] > 0  # platform=cpu declares its cost
    artifacts = {p.name for p in Path(run.info.artifact_uri.removeprefix("file://")).iterdir()}
    assert {"mlperf_log_summary.txt", "mlperf_log_detail.txt"} <= artifacts


# -- capacity and cost --
def _result(valid: bool) -> LoadGenResult:
    return LoadGenResult("Server", valid, 1.0, 1, 1, None, None, None, None, 0.0, 0.0, 0.0, Path("."))


@pytest.mark.parametrize("start", [5.0, 40.0, 300.0])
def test_capacity_search_finds_the_highest_valid_load_from_either_side(start):
    capacity = 37.0
    best, probes = search_qps_at_slo(lambda qps: _result(qps <= capacity), start, max_probes=12, min_qps=0.5,
                                     tolerance=0.02)
    assert best is not None and best.valid
    assert 0.98 * capacity <= best.qps <= capacity
    assert all(p.valid == (p.qps <= capacity) for p in probes) and len(probes) <= 12


def test_capacity_search_reports_none_when_no_load_is_valid():
    best, probes = search_qps_at_slo(lambda qps: _result(False), 8.0, max_probes=10, min_qps=1.0)
    assert best is None and [p.qps for p in probes] == [8.0, 4.0, 2.0, 1.0]


def test_cost_per_million_tokens_from_declared_capex_and_power():
    cost = PlatformCost(capex_usd=8766.0 * 4, amortisation_years=4.0, power_w=500.0, price_per_kwh_usd=0.2)
    figures = serving_cost_metrics(cost, {"tokens_per_s": 1000.0, "hosts_for_target_load": 3.0})
    assert figures["host_usd_per_hour"] == pytest.approx(1.0 + 0.1)
    assert figures["cost_per_million_tokens"] == pytest.approx(1.1 / 3.6)  # 3.6 M tokens per hour
    assert figures["fleet_usd_per_hour"] == pytest.approx(3.3)
    assert serving_cost_metrics(PlatformCost(), {"tokens_per_s": 1000.0}) == {}  # undeclared: no figure
    with pytest.raises(ValueError, match="platform.cost.amortisation_years"):
        PlatformCost(amortisation_years=0.0)


def test_dense_presets_only():
    with pytest.raises(ValueError, match="Llama 4 features"):
        CachedDecoder(build_model(dataclasses.replace(PRESETS["tiny_moe"]), "cpu", 0))
