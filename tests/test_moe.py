"""Llama 4-style MoE in the llama workload: routing, grouped experts, Llama 4 attention, HF parity,
presets, load balancing and expert parallelism."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from workloads.llama import PRESETS, Transformer, from_hf_config, load_hf_state_dict
from workloads.llama import moe as moe_module
from workloads.llama.model import (
    ModelArgs,
    build_model,
    chunked_causal_attention,
    count_active_params,
    count_params,
)
from workloads.llama.moe import GroupedExperts, MoE, grouped_mm, grouped_mm_loop, skew_routers, update_expert_bias

# Every Llama 4 feature at once, small: NoPE every 2nd layer, MoE every 2nd layer (top-2 of 4, so
# the sum over a token's experts is exercised), a 16-token attention chunk (sequences of 40 cross
# two chunk boundaries), temperature tuning from position 7 on (floor 8), QK norm, Llama 3 RoPE.
HF_LLAMA4 = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 32, "intermediate_size_mlp": 96,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "num_local_experts": 4, "num_experts_per_tok": 2,
    "interleave_moe_layer_step": 2, "no_rope_layer_interval": 2, "attention_chunk_size": 16,
    "floor_scale": 8, "attn_scale": 0.1, "attn_temperature_tuning": True, "use_qk_norm": True,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}  # fmt: skip


def _hf_llama4(**overrides):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(**{**HF_LLAMA4, **overrides})
    hf = transformers.Llama4ForCausalLM(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            if param.ndim == 1:  # norm gains start at 1, which would hide swapped norms
                param.uniform_(0.5, 1.5)
            elif param.ndim == 3:  # experts start at zero in HF: give them something to compute
                param.normal_(0.0, 0.1)
    return hf


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_logits_match_transformers_llama4_beyond_the_attention_chunk(attn_implementation):
    hf = _hf_llama4(attn_implementation=attn_implementation)
    args = from_hf_config(hf.config)
    assert (args.n_routed_experts, args.moe_top_k, args.n_moe_layers) == (4, 2, 2)
    assert [args.uses_rope(i) for i in range(4)] == [True, False, True, False]
    model = Transformer(args).eval()
    load_hf_state_dict(model, hf.state_dict())

    tokens_bs = torch.randint(0, HF_LLAMA4["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens_bs).logits
        actual = model(tokens_bs)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_hf_score_on_the_expert_input_is_what_parity_needs():
    """Scaling the expert *output* by the gate instead (a common MoE convention) is not Llama 4:
    parity catches it, so the test above checks the routing convention, not only shapes."""
    hf = _hf_llama4()
    model = Transformer(from_hf_config(hf.config)).eval()
    load_hf_state_dict(model, hf.state_dict())
    moe = model.layers[1].feed_forward
    x_td = torch.randn(12, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, _ = hf.model.layers[1].feed_forward(x_td)
        torch.testing.assert_close(moe(x_td[None])[0], expected, atol=1e-5, rtol=1e-5)
        experts_tk, gates_tk, _ = moe.route(x_td)
        on_output = moe.shared_expert(x_td)
        for slot in range(moe.top_k):
            for token in range(x_td.shape[0]):
                e = int(experts_tk[token, slot])
                one = x_td[token : token + 1]
                out = moe.experts(one, F.one_hot(torch.tensor(e), 4)) * gates_tk[token, slot]
                on_output[token] += out[0]
    assert (on_output - expected).abs().max() > 1e-3


def test_from_hf_config_rejects_llama4_layouts_it_cannot_represent():
    with pytest.raises(ValueError, match="moe_layers"):
        from_hf_config({**HF_LLAMA4, "moe_layers": [0, 3]})
    with pytest.raises(ValueError, match="no_rope_layers"):
        from_hf_config({**HF_LLAMA4, "no_rope_layers": [1, 1, 1, 0]})
    with pytest.raises(ValueError, match="text_config"):
        from_hf_config({"text_config": HF_LLAMA4})
    with pytest.raises(ValueError, match="router_jitter_noise"):
        from_hf_config({**HF_LLAMA4, "router_jitter_noise": 0.1})


def test_grouped_experts_equal_a_loop_over_experts_forward_and_backward():
    experts = GroupedExperts(n_experts=4, dim=16, hidden_dim=8)
    generator = torch.Generator().manual_seed(0)
    experts.init_weights(0.5, 0.5, generator)
    tokens_per_expert = torch.tensor([3, 0, 6, 1])  # an idle expert is fine
    x_nd = torch.randn(10, 16, generator=generator, requires_grad=True)
    # sum() sends back a stride-0 gradient, which grouped_mm's backward rejects unless made contiguous
    experts(x_nd, tokens_per_expert).sum().backward()
    grads = (x_nd.grad, experts.w1.grad, experts.w3.grad, experts.w2.grad)

    x_ref = x_nd.detach().clone().requires_grad_()
    w1, w3, w2 = (w.detach().clone().requires_grad_() for w in (experts.w1, experts.w3, experts.w2))
    outs = []
    for e, x_md in enumerate(x_ref.split(tokens_per_expert.tolist())):
        outs.append((F.silu(x_md @ w1[e]) * (x_md @ w3[e])) @ w2[e])
    torch.cat(outs).sum().backward()
    for actual, expected in zip(grads, (x_ref.grad, w1.grad, w3.grad, w2.grad), strict=True):
        torch.testing.assert_close(actual, expected)
    assert torch.count_nonzero(experts.w1.grad[1]) == 0


def test_the_grouped_gemm_loop_equals_torchs_grouped_mm_forward_and_backward():
    """The stand-in for a torch without F.grouped_mm computes what it computes, gradients included."""
    generator = torch.Generator().manual_seed(0)
    offsets = torch.tensor([3, 3, 9, 10], dtype=torch.int32)  # an idle group too
    x = torch.randn(10, 16, generator=generator, requires_grad=True)
    w = torch.randn(4, 16, 8, generator=generator, requires_grad=True)
    grouped_mm(x, w, offsets).square().sum().backward()
    expected = (x.grad, w.grad)
    x.grad = w.grad = None
    grouped_mm_loop(x, w, offsets).square().sum().backward()
    torch.testing.assert_close((x.grad, w.grad), expected)


def test_experts_run_without_torchs_grouped_mm(monkeypatch):
    """A torch whose nn.functional has no grouped_mm runs the experts through the loop, to the same result."""
    experts = GroupedExperts(n_experts=4, dim=16, hidden_dim=8)
    experts.init_weights(0.5, 0.5, torch.Generator().manual_seed(0))
    tokens_per_expert = torch.tensor([3, 0, 6, 1])
    x_nd = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
    expected = experts(x_nd, tokens_per_expert)
    monkeypatch.setattr(moe_module, "_GROUPED_MM", None)
    torch.testing.assert_close(experts(x_nd, tokens_per_expert), expected)


def test_routed_copies_per_expert_are_counted_like_bincount():
    layer = MoE(dim=16, hidden_dim=8, n_experts=5, top_k=2).train()
    layer.init_weights(0.5, 0.5, torch.Generator().manual_seed(0))
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1))
    experts_tk, _, _ = layer.route(x.reshape(-1, 16))
    layer(x)
    expected = torch.bincount(experts_tk.flatten(), minlength=5).float()
    torch.testing.assert_close(layer.tokens_per_expert, expected)


def test_chunked_attention_equals_sdpa_with_the_chunked_causal_mask():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 37, 8, generator=generator) for heads in (4, 2, 2))
    positions = torch.arange(37)
    mask = (positions[:, None] >= positions) & (positions[:, None] // 10 == positions // 10)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(chunked_causal_attention(q, k, v, 10), expected)


def test_chunked_attention_calls_sdpa_with_4d_tensors(monkeypatch):
    """SDPA's fused CUDA kernels take only 4-D inputs: the blocks are folded into the batch dimension."""
    shapes = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        shapes.append((q.dim(), k.dim(), v.dim()))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    q, k, v = (torch.randn(2, heads, 37, 8) for heads in (4, 2, 2))
    out = chunked_causal_attention(q, k, v, 10)
    assert shapes == [(4, 4, 4)] and out.shape == (2, 4, 37, 8)


def test_moe_training_counts_every_routed_token_and_drops_none():
    args = PRESETS["tiny_moe"]
    model = build_model(args, "cpu", seed=0).train()
    tokens_bs = torch.randint(0, args.vocab_size, (3, 64), generator=torch.Generator().manual_seed(0))
    model(tokens_bs).sum().backward()
    loads = update_expert_bias(model, coeff=0.0)
    assert len(loads) == args.n_moe_layers == 2
    assert all(int(load.sum()) == 3 * 64 * args.moe_top_k for load in loads)  # dropless
    assert all(layer.feed_forward.experts.w1.grad is not None
               for layer in model.layers if isinstance(layer.feed_forward, MoE))


@pytest.mark.parametrize(("preset", "total", "active"),
                         [("llama4_scout", 107.8e9, 17.17e9), ("llama4_maverick", 400.7e9, 17.18e9)])
def test_llama4_presets_have_transformers_sizes_and_build_on_meta(preset, total, active):
    args = PRESETS[preset]
    assert count_params(args) == pytest.approx(total, rel=1e-3)
    assert count_active_params(args) == pytest.approx(active, rel=1e-3)
    with torch.device("meta"):
        model = Transformer(args)
    assert count_params(model) == count_params(args)
    assert all(p.is_meta for p in model.parameters())


def test_active_params_of_a_dense_model_are_all_params():
    assert count_active_params(PRESETS["tiny"]) == count_params(PRESETS["tiny"])


@pytest.mark.parametrize(("override", "message"), [
    ({"moe_top_k": 9}, r"moe_top_k \(9\) exceeds n_routed_experts \(8\)"),
    ({"moe_hidden_dim": 60}, r"moe_hidden_dim \(60\) must be a multiple of 8"),
    ({"router_score_function": "relu"}, "router_score_function"),
    ({"attention_chunk_size": 0}, "attention_chunk_size must be >= 1"),
])  # fmt: skip
def test_validate_rejects_bad_moe_settings(override, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(PRESETS["tiny_moe"], **override).validate()


def test_softmax_router_gates_sum_to_at_most_one():
    args = dataclasses.replace(PRESETS["tiny_moe"], router_score_function="softmax", moe_top_k=2)
    model = build_model(args, "cpu", seed=0)
    moe = model.layers[1].feed_forward
    _, gates_tk, scores_tx = moe.route(torch.randn(5, args.dim))
    torch.testing.assert_close(scores_tx.sum(-1), torch.ones(5))
    assert bool((gates_tk.sum(-1) <= 1 + 1e-6).all())


def test_tiny_moe_model_args_are_llama4_shaped():
    args: ModelArgs = PRESETS["tiny_moe"]
    assert [args.uses_rope(i) for i in range(4)] == [True, True, True, False]
    assert [args.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


def _balance_run(coeff: float, steps: int = 150) -> tuple[float, float]:
    """Route fresh random tokens through a frozen MoE layer whose router starts tilted towards a few
    experts, updating only the balancing bias: the load max/mean of the first step and the mean of
    the last 20."""
    generator = torch.Generator().manual_seed(0)
    moe = MoE(dim=32, hidden_dim=16, n_experts=8, top_k=1)
    moe.init_weights(0.02, 0.02, generator)
    skew_routers(moe, skew=0.8, seed=0)
    ratios = []
    with torch.no_grad():
        for _ in range(steps):
            moe.train()(torch.randn(1, 512, 32, generator=generator))
            (load,) = update_expert_bias(moe, coeff)
            ratios.append(float(load.max() / load.mean()))
    return ratios[0], sum(ratios[-20:]) / 20


def test_expert_bias_balances_a_skewed_router_and_nothing_else_does():
    start, with_bias = _balance_run(coeff=1e-3)
    _, without_bias = _balance_run(coeff=0.0)
    assert start > 2.0, "the skewed router must start unbalanced for this test to mean anything"
    assert with_bias <= 1.6
    assert without_bias > 2.0


def test_expert_bias_is_recentred_and_selection_only():
    moe = MoE(dim=16, hidden_dim=8, n_experts=4, top_k=1)
    moe.init_weights(0.02, 0.02, torch.Generator().manual_seed(0))
    moe.tokens_per_expert.copy_(torch.tensor([9.0, 0.0, 0.0, 3.0]))  # mean 3: expert 3 stays
    update_expert_bias(moe, coeff=0.1)
    assert float(moe.expert_bias.sum()) == pytest.approx(0.0, abs=1e-7)
    assert moe.expert_bias[0] < moe.expert_bias[3] < moe.expert_bias[1]
    assert int(moe.tokens_per_expert.sum()) == 0
    # the bias changes which expert is picked, never the gate value that scales the token
    moe.expert_bias.copy_(torch.tensor([5.0, 0.0, 0.0, 0.0]))
    x_td = torch.randn(6, 16)
    experts_tk, gates_tk, scores_tx = moe.route(x_td)
    assert bool((experts_tk == 0).all())
    torch.testing.assert_close(gates_tk[:, 0], scores_tx[:, 0])
    assert bool((gates_tk < 1).all())


def test_aux_loss_reaches_the_router_and_is_one_when_balanced():
    from workloads.llama.moe import moe_aux_loss

    moe = MoE(dim=16, hidden_dim=8, n_experts=4, top_k=1)
    moe.init_weights(0.02, 0.02, torch.Generator().manual_seed(0))
    moe.aux_loss_weight = 1.0
    moe.train()(torch.randn(1, 64, 16))
    aux = moe_aux_loss(moe)
    assert aux is not None and 0.5 < float(aux.detach()) < 2.0
    aux.backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    moe.aux_loss_weight = 0.0
    moe(torch.randn(1, 8, 16))
    assert moe_aux_loss(moe) is None


@pytest.mark.slow
def test_two_rank_expert_parallel_matches_one_rank(tmp_path):
    """Experts sharded over 2 gloo ranks under torchrun, tokens over all_to_all_single: the same
    global losses and load figures as one process training the same global batches."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import clean_env

    sys.path.insert(0, str(Path(__file__).parent))
    from moe_ep_worker import train

    from workloads.base import RunContext

    worker = Path(__file__).parent / "moe_ep_worker.py"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(worker),
         str(tmp_path)], capture_output=True, text=True, timeout=300, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = json.loads((tmp_path / "result.json").read_text())
    one = train(RunContext(device=torch.device("cpu"), seed=0))
    assert two["parallelism"] == "ep+ddp" and one["parallelism"] == "none"
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert two["losses"][-1] < two["losses"][0]
    for key in ("expert_load_max_over_mean", "tokens_dropped"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key])
    assert two["metrics"]["tokens_dropped"] == 0
    assert two["metrics"]["a2a_bytes_per_step"] > 0 and 0 < two["metrics"]["a2a_share"]


@pytest.mark.slow
def test_cobench_run_tiny_moe_reports_the_moe_metrics(cobench, tmp_path):
    from conftest import TINY, mlflow_runs

    proc = cobench("run", "workload=llama", "workload.preset=tiny_moe", *TINY)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = mlflow_runs(tmp_path / "results")
    metrics = run.data.metrics
    assert run.info.status == "FINISHED"
    assert metrics["throughput"] > 0 and 0 < metrics["mfu"] < 1
    assert metrics["active_params"] < metrics["model_params"]
    assert metrics["tokens_dropped"] == 0
    layers = [metrics[f"expert_load_max_over_mean_layer{i}"] for i in (1, 3)]
    assert all(ratio >= 1 for ratio in layers) and metrics["expert_load_max_over_mean"] == max(layers)
    assert "eval_loss" in metrics


def test_active_parameter_flops_match_the_flop_counter():
    """The MFU numerator for an MoE model (active parameters, chunked attention span) against
    torch's FlopCounterMode, taught the grouped GEMM it has no formula for: 2 x rows x inner x
    columns, both for the forward ``[m, k] x [e, k, n]`` and the weight gradient ``[k, m] x [m, n]``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from workloads.llama.model import training_flops_per_token

    def grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
        return 2 * a_shape[0] * a_shape[1] * b_shape[-1]

    args = PRESETS["tiny_moe"]
    model = build_model(args, "cpu", seed=0)
    batch, seq_len = 2, 128  # 4 chunks of 32 on the RoPE layers
    tokens_bs = torch.randint(0, args.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten._grouped_mm: grouped_mm_flops})
    with sdpa_kernel(SDPBackend.MATH), counter:
        model(tokens_bs).sum().backward()
    analytic = training_flops_per_token(args, seq_len) * batch * seq_len
    assert counter.get_total_flops() == pytest.approx(analytic, rel=0.01)


def test_the_moe_logs_no_mlperf_benchmark_name_it_does_not_mirror():
    """MLPerf Training has no MoE LLM benchmark: the MoE's MLPerf logs must not claim Llama 3.1 8B's rules."""
    import torch

    from workloads.base import RunContext
    from workloads.llama.config import LlamaConfig
    from workloads.llama.workload import LlamaWorkload

    ctx = RunContext(device=torch.device("cpu"), seed=0)
    assert LlamaWorkload(LlamaConfig(preset="tiny_moe"), ctx).mlperf_info().benchmark == "llama4_moe"
    assert LlamaWorkload(LlamaConfig(preset="tiny"), ctx).mlperf_info().benchmark == "llama31_8b"
