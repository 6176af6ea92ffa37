"""Our serving engine's greedy decoding against transformers' ``generate()`` with a static KV cache.

Same weights (transformers' model is built and its state dict loaded into ours), same batch of
prompts, same number of new tokens (EOS off, so both generate exactly ``NEW_TOKENS`` per sequence),
in one process. One round generates the whole batch: a prefill of ``PROMPT`` tokens, then
``NEW_TOKENS - 1`` decode steps, so decoding dominates. Reported: generated tokens per second
(median round); the transformers row carries ``ours_over_transformers``, the ratio of the two medians.
Greedy outputs are checked equal before timing, so both sides do the same work.
"""

from __future__ import annotations

import pytest
import torch
from conftest import hf_llama_config

from workloads.llama import PRESETS, Transformer, from_hf_config, load_hf_state_dict
from workloads.llama.model import ModelArgs
from workloads.llama_infer.decoder import CachedDecoder
from workloads.llama_infer.engine import ServingEngine, generate

transformers = pytest.importorskip("transformers")

PROMPT, NEW_TOKENS = 32, 64
SHAPES = {
    # the smoke suite's model (preset tiny) at the engine's default batch
    "tiny": (PRESETS["tiny"], 32),
    # a model where the GEMMs, not the framework, take most of a decode step
    "small": (ModelArgs(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, multiple_of=256,
                        max_seq_len=512), 8),
}
_MEDIANS: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="module", params=list(SHAPES))
def setting(request):
    args, batch = SHAPES[request.param]
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_llama_config(args)).eval()
    ours = Transformer(from_hf_config(hf.config))
    load_hf_state_dict(ours, hf.state_dict())
    engine = ServingEngine(CachedDecoder(ours), max_batch=batch, max_len=PROMPT + NEW_TOKENS)
    prompts_bs = torch.randint(0, args.vocab_size, (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    return request.param, hf, engine, prompts_bs


def _ours(engine: ServingEngine, prompts_bs: torch.Tensor) -> list[list[int]]:
    return generate(engine, prompts_bs.tolist(), NEW_TOKENS)


def _transformers(hf, prompts_bs: torch.Tensor) -> list[list[int]]:
    out = hf.generate(prompts_bs, attention_mask=torch.ones_like(prompts_bs), max_new_tokens=NEW_TOKENS,
                      min_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static",
                      pad_token_id=0)
    return out[:, PROMPT:].tolist()


@pytest.mark.parametrize("impl", ["cobench", "transformers"])
def test_greedy_decode(benchmark, setting, impl):
    shape, hf, engine, prompts_bs = setting
    with torch.inference_mode():
        assert _ours(engine, prompts_bs) == _transformers(hf, prompts_bs)  # the same work on both sides
    run, model = (_ours, engine) if impl == "cobench" else (_transformers, hf)
    benchmark.group = f"llama greedy decode, {shape} (batch {prompts_bs.shape[0]}, {PROMPT}+{NEW_TOKENS} tokens)"
    tokens = prompts_bs.shape[0] * NEW_TOKENS
    with torch.inference_mode():
        benchmark.pedantic(run, args=(model, prompts_bs), rounds=10 if shape == "tiny" else 5, warmup_rounds=2)
    median = benchmark.stats.stats.median
    benchmark.extra_info["generated_tokens_per_s_median"] = tokens / median
    _MEDIANS[(shape, impl)] = median
    if impl == "transformers" and (shape, "cobench") in _MEDIANS:
        benchmark.extra_info["ours_over_transformers"] = median / _MEDIANS[(shape, "cobench")]
