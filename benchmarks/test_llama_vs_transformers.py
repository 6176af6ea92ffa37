"""Our Llama training step against transformers' LlamaForCausalLM: same shapes, batch, optimiser.

Both models get identical weights (transformers' model is built, and its state dict loaded into
ours with ``load_hf_state_dict``), the same AdamW, and the same token batch; one round is one
full training step (forward, loss, backward, clip, optimiser step). pytest-benchmark prints them
side by side; the ratio of the medians is our speed relative to transformers. Each side computes
its loss as its users do: ours as the workload does, ``model(tokens, targets)`` with the output
head and the loss fused over token chunks (no logits stored, ``workloads/llama/loss.py``);
transformers' as ``LlamaForCausalLM`` does given labels (float32 logits, then cross-entropy).

The optimiser is the fused AdamW on both sides: what our workload uses, and what transformers'
Trainer picks by default on torch >= 2.8 (``adamw_torch_fused``), so neither side wins on the
optimiser alone. The ``compiled`` variants wrap each model in ``torch.compile`` (our
``workload.compile=true``; the Trainer's ``torch_compile=True``); compilation happens in the
warm-up rounds, outside the timing.

:func:`test_side_by_side_interleaved` is the figure to quote: the four variants (ours and
transformers', eager and compiled) in one process, interleaved in rounds whose order alternates,
so the machine's drift hits all alike; each ratio is the median of the per-round ratios with the
min-max range of those. The headline is our reference set-up (``workload.compile=true``) against
transformers as its users run it by default (eager); compiled against compiled is printed beside it.
"""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_llama_config, interleaved_times, ratio_text

from workloads.llama import PRESETS, Transformer, from_hf_config, load_hf_state_dict
from workloads.llama.model import ModelArgs

transformers = pytest.importorskip("transformers")

SHAPES = {
    # the smoke suite's model and batch (preset tiny, batch 8 x 64 tokens)
    "tiny": (PRESETS["tiny"], 8, 64),
    # a step where the GEMMs, not the framework, dominate
    "small": (ModelArgs(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, multiple_of=256,
                        max_seq_len=512), 8, 256),
    # the reference shape of the parity comparison (before the fused optimiser and the compile switch)
    "medium": (ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, multiple_of=256,
                         max_seq_len=256), 8, 256),
}


def _models(shape: str):
    args, batch, seq = SHAPES[shape]
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_llama_config(args)).train()
    ours = Transformer(from_hf_config(hf.config)).train()
    load_hf_state_dict(ours, hf.state_dict())
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    return ours, hf, tokens[:, :-1], tokens[:, 1:]


def _train_step(model, optimizer, loss_of, inputs, targets):
    loss = loss_of(model, inputs, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def _ours(model, inputs, targets):
    return model(inputs, targets)  # what the workload runs: the output head and the loss fused


def _transformers(model, inputs, targets):
    # what LlamaForCausalLM computes given labels (its loss upcasts the logits, then cross-entropy)
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _measure(benchmark, shape: str, impl: str, compiled: bool) -> None:
    ours, hf, inputs, targets = _models(shape)
    model, forward = (ours, _ours) if impl == "cobench" else (hf, _transformers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if compiled:
        model = torch.compile(model)
    benchmark.group = f"llama train step, {shape}" + (", compiled" if compiled else "")
    tokens = inputs.numel()
    benchmark.extra_info["tokens_per_step"] = tokens
    benchmark.pedantic(_train_step, args=(model, optimizer, forward, inputs, targets),
                       rounds=30 if shape == "tiny" else 8, warmup_rounds=5 if shape == "tiny" else 3)
    benchmark.extra_info["tokens_per_s_median"] = tokens / benchmark.stats.stats.median


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("impl", ["cobench", "transformers"])
def test_training_step(benchmark, shape, impl):
    _measure(benchmark, shape, impl, compiled=False)


@pytest.mark.parametrize("impl", ["cobench", "transformers"])
def test_training_step_compiled(benchmark, impl):
    _measure(benchmark, "medium", impl, compiled=True)


SIDE_BY_SIDE: list[str] = []  # the interleaved comparison's lines, printed after pytest-benchmark's tables


def side_by_side_table() -> list[str]:
    return SIDE_BY_SIDE


def test_side_by_side_interleaved() -> None:
    shape, rounds, steps = "medium", 10, 3
    variants = {}
    for impl in ("cobench", "transformers"):
        for compiled in (False, True):
            ours, hf, inputs, targets = _models(shape)
            model, forward = (ours, _ours) if impl == "cobench" else (hf, _transformers)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            variants[(impl, compiled)] = (torch.compile(model) if compiled else model, optimizer, forward)
    first = {key: float(_train_step(m, o, f, inputs, targets)) for key, (m, o, f) in variants.items()}
    # the same weights and batch: the first losses agree (compiled or not, ours or transformers')
    assert max(first.values()) - min(first.values()) < 1e-3 * abs(first[("transformers", False)]), first
    for m, o, f in variants.values():  # warm-up (compilation) outside the timing
        for _ in range(2):
            _train_step(m, o, f, inputs, targets)
    times = interleaved_times({key: (lambda m=m, o=o, f=f: _train_step(m, o, f, inputs, targets))
                               for key, (m, o, f) in variants.items()}, rounds, steps)
    tokens = inputs.numel()

    def ratio(slow: tuple[str, bool], fast: tuple[str, bool]) -> str:
        return ratio_text(times[slow], times[fast])

    SIDE_BY_SIDE[:] = [f"llama train step, {shape} (8 x 256 tokens), {rounds} interleaved rounds of {steps} steps:"]
    for (impl, compiled), ts in times.items():
        median = statistics.median(ts)
        SIDE_BY_SIDE.append(f"  {impl:<12} {'compiled' if compiled else 'eager':<8} {median * 1e3:8.1f} ms/step "
                            f"(cv {statistics.pstdev(ts) / statistics.fmean(ts):.0%}), {tokens / median:8.0f} tokens/s")
    SIDE_BY_SIDE.append("  ours compiled vs transformers eager (its default): "
                        + ratio(("transformers", False), ("cobench", True)))
    SIDE_BY_SIDE.append("  eager vs eager: " + ratio(("transformers", False), ("cobench", False))
                        + "; compiled vs compiled: " + ratio(("transformers", True), ("cobench", True)))
