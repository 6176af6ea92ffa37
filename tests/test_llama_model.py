"""Llama 3 model, HF interop, FLOP accounting and the synthetic Markov data."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from workloads.llama import PRESETS, ModelArgs, Transformer, from_hf_config, load_hf_state_dict
from workloads.llama.data import MarkovTokenSource
from workloads.llama.model import build_model, count_params, training_flops_per_token

# Small, but with GQA (4 query heads share 2 KV heads) and Llama 3 RoPE scaling whose original
# length (32) puts the 8 frequencies of a 16-wide head in all three regimes: kept, blended, slowed.
HF_CONFIG = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}


def _hf_model():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG)).eval()
    with torch.no_grad():
        for param in hf.parameters():
            if param.ndim == 1:  # norm gains start at 1, which would hide swapped norms
                param.uniform_(0.5, 1.5)
    return hf


def test_logits_match_transformers_llama():
    hf = _hf_model()
    model = Transformer(from_hf_config(hf.config)).eval()
    load_hf_state_dict(model, hf.state_dict())

    tokens_bs = torch.randint(0, HF_CONFIG["vocab_size"], (2, 96), generator=torch.Generator())
    with torch.no_grad():
        expected = hf(tokens_bs).logits
        actual = model(tokens_bs)
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_transformers_4_and_5_config_layouts_give_the_same_args():
    v5 = from_hf_config(HF_CONFIG)
    rope = dict(HF_CONFIG["rope_parameters"])
    v4 = {k: v for k, v in HF_CONFIG.items() if k != "rope_parameters"}
    v4["rope_theta"] = rope.pop("rope_theta")
    v4["rope_scaling"] = rope
    assert from_hf_config(v4) == v5
    assert v5.use_scaled_rope and v5.rope_original_max_seq_len == 32 and v5.kv_heads == 2

    unscaled = {**v4, "rope_scaling": None}
    assert not from_hf_config(unscaled).use_scaled_rope


def test_load_hf_state_dict_rejects_missing_key():
    model = Transformer(from_hf_config(HF_CONFIG))
    state = _hf_model().state_dict()
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing keys.*layers\.1\.feed_forward\.w3\.weight"):
        load_hf_state_dict(model, state)


def test_load_hf_state_dict_rejects_wrong_shape_naming_both_shapes():
    model = Transformer(from_hf_config(HF_CONFIG))
    before = model.tok_embeddings.weight.clone()
    state = _hf_model().state_dict()
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(ValueError, match=r"wk\.weight: checkpoint \(64, 64\) vs model \(32, 64\)"):
        load_hf_state_dict(model, state)
    assert torch.equal(model.tok_embeddings.weight, before), "failed load must not copy anything"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"head_dim": 32}, "head_dim=32"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ],
)
def test_from_hf_config_rejects_what_the_model_cannot_represent(override, message):
    with pytest.raises(ValueError, match=message):
        from_hf_config({**HF_CONFIG, **override})


@pytest.mark.parametrize(
    ("preset", "hidden_dim", "expected_params"),
    [("llama3_8b", 14336, 8.03e9), ("llama3_70b", 28672, 70.6e9), ("llama3_405b", 53248, 405.9e9)],
)
def test_published_presets_have_published_sizes_and_build_for_free_on_meta(
    preset, hidden_dim, expected_params
):
    args = PRESETS[preset]
    assert args.hidden_dim == hidden_dim
    assert count_params(args) == pytest.approx(expected_params, rel=0.01)
    with torch.device("meta"):
        model = Transformer(args)
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    assert count_params(model) == count_params(args)


def test_analytic_param_count_matches_the_real_module():
    model = build_model(PRESETS["tiny"], "cpu", seed=0)
    assert count_params(PRESETS["tiny"]) == sum(p.numel() for p in model.parameters())
    assert count_params(PRESETS["tiny"], include_embedding=False) == count_params(
        model, include_embedding=False
    )


def test_training_flops_per_token_matches_flop_counter():
    args = PRESETS["tiny"]
    model = build_model(args, "cpu", seed=0)
    batch, seq_len = 2, 128
    tokens_bs = torch.randint(0, args.vocab_size, (batch, seq_len))
    # CPU's fused SDPA kernel has no flop formula, so the counter would miss attention; the math
    # backend runs it as plain bmm's it does count. What the counter still leaves out are
    # elementwise ops (norms, SwiGLU, RoPE, softmax), which the analytic count also ignores
    # except through the norm gains in N -- hence the close match. Neither discounts causality.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens_bs).sum().backward()
    analytic = training_flops_per_token(args, seq_len) * batch * seq_len
    assert counter.get_total_flops() == pytest.approx(analytic, rel=0.01)


def test_validate_rejects_kv_heads_that_do_not_divide_heads():
    args = dataclasses.replace(PRESETS["tiny"], n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match=r"n_heads \(4\).*n_kv_heads \(3\)"):
        args.validate()
    with pytest.raises(ValueError, match="n_kv_heads"):
        Transformer(args)


def test_build_model_is_bit_identical_for_a_seed():
    first = build_model(PRESETS["tiny"], "cpu", seed=7).state_dict()
    torch.manual_seed(123)  # the global RNG must not matter
    second = build_model(PRESETS["tiny"], "cpu", seed=7).state_dict()
    other = build_model(PRESETS["tiny"], "cpu", seed=8).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["output.weight"], other["output.weight"])


def test_markov_source_is_deterministic_for_a_seed():
    def sample(seed: int) -> torch.Tensor:
        source = MarkovTokenSource(vocab_size=64, seed=seed)
        inputs_bs, targets_bs = source.batch(4, 32, torch.Generator().manual_seed(1))
        assert torch.equal(inputs_bs[:, 1:], targets_bs[:, :-1])
        return inputs_bs

    assert torch.equal(sample(0), sample(0))
    assert not torch.equal(sample(0), sample(1))


@pytest.mark.parametrize("smoothing", [0.0, 0.05])
def test_markov_entropy_rate_lies_between_zero_and_uniform(smoothing):
    vocab = 128
    rate = MarkovTokenSource(vocab_size=vocab, smoothing=smoothing, seed=0).entropy_rate()
    assert 0.0 < rate < math.log(vocab)


def test_tiny_model_learns_the_markov_chain():
    vocab, seq_len, batch = 64, 32, 16
    source = MarkovTokenSource(vocab_size=vocab, seed=0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab,
                     multiple_of=32, max_seq_len=seq_len)  # fmt: skip
    model = build_model(args, "cpu", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(0)
    for _ in range(100):
        inputs_bs, targets_bs = source.batch(batch, seq_len, data)
        loss = F.cross_entropy(model(inputs_bs).flatten(0, 1), targets_bs.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    with torch.no_grad():
        inputs_bs, targets_bs = source.batch(64, seq_len, data)
        eval_loss = F.cross_entropy(model(inputs_bs).flatten(0, 1), targets_bs.flatten()).item()
    floor, uniform = source.entropy_rate(), math.log(vocab)
    assert floor < uniform
    # Untrained, the loss sits near ln(vocab); learning the table brings it close to the floor.
    assert eval_loss < floor + 0.25 * (uniform - floor), f"{eval_loss=} {floor=} {uniform=}"


@pytest.mark.parametrize("chunk_elements", [1 << 22, 3 * 128])  # one chunk; many, with a ragged last one
def test_fused_output_loss_equals_logits_then_cross_entropy(monkeypatch, chunk_elements):
    """model(tokens, targets) — the output head and the loss fused over token chunks — gives the
    loss and every gradient of ``F.cross_entropy(model(tokens), targets)``, ignored targets included."""
    from workloads.llama import loss as fused_loss

    monkeypatch.setattr(fused_loss, "_CHUNK_ELEMENTS", chunk_elements)
    args = dataclasses.replace(PRESETS["tiny"], vocab_size=128, max_seq_len=32)
    model = build_model(args, "cpu", seed=0).double()
    tokens = torch.randint(0, 128, (3, 17), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 128, (3, 17), generator=torch.Generator().manual_seed(1))
    targets[:, ::4] = fused_loss.IGNORE_INDEX

    reference = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    reference.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    fused = model(tokens, targets)
    fused.backward()
    # (the reference's logits are rounded to float32 by forward; the fused loss stays in float64)
    assert fused.item() == pytest.approx(reference.item(), rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-8, msg=name)
    with torch.no_grad():  # evaluation: the loss alone, no gradient work
        assert model(tokens, targets).item() == pytest.approx(fused.item(), rel=1e-12)


def test_fused_output_loss_under_bf16_autocast_matches_the_unfused_loss():
    model = build_model(dataclasses.replace(PRESETS["tiny"], max_seq_len=32), "cpu", seed=0)
    tokens = torch.randint(0, model.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        fused = model(tokens[:, :-1], tokens[:, 1:])
    assert fused.dtype == torch.float32 and fused.item() == pytest.approx(reference.item(), rel=2e-3)
    fused.backward()
    assert model.output.weight.grad.dtype == torch.float32 and torch.isfinite(model.output.weight.grad).all()


def test_fused_output_loss_does_the_flops_of_the_unfused_one():
    """Fusing moves the output head's backward GEMMs into the forward; it adds none (the analytic
    training FLOPs, which MFU divides by, stay true)."""
    args = PRESETS["tiny"]
    model = build_model(args, "cpu", seed=0)
    tokens_bs = torch.randint(0, args.vocab_size, (2, 129))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens_bs[:, :-1], tokens_bs[:, 1:]).backward()
    analytic = training_flops_per_token(args, 128) * 2 * 128
    assert counter.get_total_flops() == pytest.approx(analytic, rel=0.01)


@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
def test_compiled_model_trains_like_the_eager_one(preset):
    """``workload.compile=true``: the compiled model (the fused loss traced, MoE's grouped GEMM left
    eager) gives the eager loss and gradients."""
    args = dataclasses.replace(PRESETS[preset], max_seq_len=64)
    eager = build_model(args, "cpu", seed=0)
    compiled_source = build_model(args, "cpu", seed=0)
    compiled = torch.compile(compiled_source)
    tokens = torch.randint(0, args.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (eager, compiled):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled_source.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
