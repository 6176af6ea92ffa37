"""Our Llama 4 MoE layer against transformers' ``Llama4TextMoe``: same shapes, same weights, same
tokens, one training step of the layer each round (forward, a loss, backward, fused AdamW).

transformers runs every token through every expert (its experts see each token pre-scaled by a
router score that is zero for the experts not chosen), so its expert work is ``n_experts / top_k``
times ours; ours sorts the routed copies by expert and runs one grouped GEMM over them. The ratio
of the medians is the speed-up a dropless grouped-GEMM layer buys at these shapes (goal >= 3x).
Both layers' outputs are checked equal before timing, so the two compute the same function.
:func:`test_side_by_side_interleaved` is the figure to quote: both in one process, interleaved.
"""

from __future__ import annotations

import statistics

import pytest
import torch
from conftest import interleaved_times, ratio_text

from workloads.llama.moe import MoE

transformers = pytest.importorskip("transformers")

# Scout's routing (16 experts, top-1 + shared) at a width a CPU steps through in a fraction of a second
SHAPES = {"scout_like_small": dict(dim=512, hidden_dim=1024, n_experts=16, top_k=1, tokens=8 * 256)}


def _layers(shape: str):
    cfg = SHAPES[shape]
    config = transformers.Llama4TextConfig(
        hidden_size=cfg["dim"], intermediate_size=cfg["hidden_dim"], num_local_experts=cfg["n_experts"],
        num_experts_per_tok=cfg["top_k"], num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8,
        head_dim=cfg["dim"] // 8, vocab_size=128,
    )
    torch.manual_seed(0)
    hf = transformers.models.llama4.modeling_llama4.Llama4TextMoe(config).train()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.02)
    ours = MoE(cfg["dim"], cfg["hidden_dim"], cfg["n_experts"], cfg["top_k"]).train()
    ours.load_state_dict({**hf.state_dict(), "expert_bias": torch.zeros(cfg["n_experts"])})
    x_td = torch.randn(cfg["tokens"], cfg["dim"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(x_td[None])[0], hf(x_td)[0], atol=1e-5, rtol=1e-4)
    ours.tokens_per_expert.zero_()
    return ours, hf, x_td


def _train_step(layer, optimizer, forward, x_td):
    x_td = x_td.detach().requires_grad_()  # the layer sits inside a model: its input needs a gradient too
    loss = forward(layer, x_td).float().square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def _ours(layer, x_td):
    return layer(x_td[None])[0]


def _transformers(layer, x_td):
    return layer(x_td)[0]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("impl", ["cobench", "transformers"])
def test_moe_layer_training_step(benchmark, shape, impl):
    ours, hf, x_td = _layers(shape)
    layer, forward = (ours, _ours) if impl == "cobench" else (hf, _transformers)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-4, fused=True)
    benchmark.group = f"llama4 MoE layer train step, {shape}"
    benchmark.extra_info["tokens_per_step"] = x_td.shape[0]
    benchmark.pedantic(_train_step, args=(layer, optimizer, forward, x_td), rounds=10, warmup_rounds=2)
    benchmark.extra_info["tokens_per_s_median"] = x_td.shape[0] / benchmark.stats.stats.median


SIDE_BY_SIDE: list[str] = []  # printed after pytest-benchmark's tables (benchmarks/conftest.py)


def side_by_side_table() -> list[str]:
    return SIDE_BY_SIDE


@pytest.mark.parametrize("shape", list(SHAPES))
def test_side_by_side_interleaved(shape) -> None:
    ours, hf, x_td = _layers(shape)
    steps = {}
    for key, layer, forward in (("cobench", ours, _ours), ("transformers", hf, _transformers)):
        optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-4, fused=True)
        steps[key] = (lambda layer=layer, optimizer=optimizer, forward=forward:
                      _train_step(layer, optimizer, forward, x_td))
        for _ in range(2):  # warm-up
            steps[key]()
    rounds = 8
    times = interleaved_times(steps, rounds, 1)
    SIDE_BY_SIDE.append(f"llama4 MoE layer train step, {shape} ({x_td.shape[0]} tokens), {rounds} interleaved rounds:")
    for key, ts in times.items():
        median = statistics.median(ts)
        cv = statistics.pstdev(ts) / statistics.fmean(ts)
        SIDE_BY_SIDE.append(f"  {key:<12} {median * 1e3:8.1f} ms/step (cv {cv:.0%}), "
                            f"{x_td.shape[0] / median:8.0f} tokens/s")
    SIDE_BY_SIDE.append("  ours vs transformers: " + ratio_text(times["transformers"], times["cobench"]))
