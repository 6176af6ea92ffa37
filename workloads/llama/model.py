"""A Llama 3-style decoder, written to be read top to bottom like the paper.

Shape suffixes on tensor names: ``b`` batch, ``s`` sequence, ``d`` model dim, ``h`` query heads,
``g`` key/value heads, ``e`` head dim, ``f`` feed-forward hidden dim, ``v`` vocabulary.

Construction and weight initialisation are kept apart: build the module on the meta device (free,
even for 405B), move it with ``to_empty`` and call :meth:`Transformer.init_weights`.
:func:`build_model` does exactly that, seeded so the same seed gives bit-identical weights.
The shapes (:class:`ModelArgs`), presets and analytic parameter/FLOP counts are in
:mod:`workloads.llama.args` (re-exported here).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from workloads.llama.args import (
    PRESETS,
    ModelArgs,
    count_active_params,
    count_total_params,
    training_flops_per_token,
)
from workloads.llama.loss import linear_cross_entropy
from workloads.llama.moe import MoE


class RMSNorm(nn.Module):
    """Root-mean-square norm: rescale each vector to unit RMS, then apply a learned gain.

    Statistics are taken in float32 so bfloat16 activations normalise as accurately as in HF.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.type_as(x)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


def rope_inverse_frequencies(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """Per-pair rotation speeds ``theta^(-2i/head_dim)``, with Llama 3.1's long-context scaling.

    The scaling leaves high frequencies (wavelength shorter than ``original / high_freq_factor``)
    alone, slows low frequencies (wavelength longer than ``original / low_freq_factor``) by
    ``rope_scale_factor``, and blends smoothly in between.
    """
    exponents = torch.arange(0, args.head_dim, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (args.rope_theta ** (exponents / args.head_dim))
    if not args.use_scaled_rope:
        return inv_freq

    factor = args.rope_scale_factor
    low, high = args.rope_low_freq_factor, args.rope_high_freq_factor
    original = args.rope_original_max_seq_len
    wavelength = 2 * math.pi / inv_freq
    # low == high (Llama 4 Scout's setting) leaves no band to blend
    smooth = (original / wavelength - low) / (high - low) if high > low else torch.zeros_like(inv_freq)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, blended)
    return torch.where(wavelength < original / high, inv_freq, scaled)


def rope_cos_sin(
    args: ModelArgs, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin tables of shape ``(max_seq_len, head_dim)`` for every position."""
    inv_freq = rope_inverse_frequencies(args, device)
    positions = torch.arange(args.max_seq_len, dtype=torch.float32, device=device)
    angles_se = torch.outer(positions, inv_freq).repeat(1, 2)
    return angles_se.cos(), angles_se.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Map the two halves ``(x1, x2)`` of the last dim to ``(-x2, x1)``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_bhse: torch.Tensor, cos_se: torch.Tensor, sin_se: torch.Tensor) -> torch.Tensor:
    """Rotate channel ``i`` with channel ``i + head_dim/2`` by each position's angle.

    This is the *rotate-half* convention of Hugging Face transformers, not the interleaved pairs
    of Meta's reference code. HF checkpoints already store q/k weights permuted for it, so they
    load here unchanged; Meta's original ``consolidated.pth`` files would need that permutation.
    """
    cos_se, sin_se = cos_se.to(x_bhse.dtype), sin_se.to(x_bhse.dtype)
    return x_bhse * cos_se + rotate_half(x_bhse) * sin_se


class Attention(nn.Module):
    """Causal grouped-query self-attention: ``n_kv_heads`` key/value heads, each shared by
    ``n_heads / n_kv_heads`` query heads, which shrinks the KV projections and cache.

    Llama 4 adds, per layer: RoPE layers may attend only within chunks of
    ``attention_chunk_size`` tokens (local attention) and may L2-normalise q and k after RoPE;
    the interleaved NoPE layers attend globally without positions and, with temperature tuning,
    sharpen queries at long positions by ``1 + attn_scale * log1p(floor((pos + 1) / floor_scale))``
    (the identity below ``floor_scale - 1`` positions).
    """

    def __init__(self, args: ModelArgs, layer_id: int = 0) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        self.use_rope = args.uses_rope(layer_id)
        self.chunk_size = args.attention_chunk_size if self.use_rope else None
        self.qk_norm_eps = args.norm_eps if (args.use_qk_norm and self.use_rope) else None
        self.temperature = ((args.attn_floor_scale, args.attn_scale)
                            if (args.attn_temperature_tuning and not self.use_rope) else None)

    def forward(
        self, x_bsd: torch.Tensor, cos_se: torch.Tensor, sin_se: torch.Tensor
    ) -> torch.Tensor:
        b, s, _ = x_bsd.shape
        cos_se, sin_se = cos_se[:s], sin_se[:s]
        # -1 heads: under tensor parallelism this rank's projections hold n_heads / tp of them
        q_bhse = self.wq(x_bsd).view(b, s, -1, self.head_dim).transpose(1, 2)
        k_bgse = self.wk(x_bsd).view(b, s, -1, self.head_dim).transpose(1, 2)
        v_bgse = self.wv(x_bsd).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.use_rope:
            q_bhse, k_bgse = apply_rope(q_bhse, cos_se, sin_se), apply_rope(k_bgse, cos_se, sin_se)
        if self.qk_norm_eps is not None:
            q_bhse, k_bgse = l2_norm(q_bhse, self.qk_norm_eps), l2_norm(k_bgse, self.qk_norm_eps)
        if self.temperature is not None:
            q_bhse = q_bhse * attention_temperature(s, *self.temperature, x_bsd.device)[:, None].to(q_bhse.dtype)
        if self.chunk_size is not None and s > self.chunk_size:
            out_bhse = chunked_causal_attention(q_bhse, k_bgse, v_bgse, self.chunk_size)
        else:
            out_bhse = F.scaled_dot_product_attention(
                q_bhse, k_bgse, v_bgse, is_causal=True, enable_gqa=True
            )
        return self.wo(out_bhse.transpose(1, 2).reshape(b, s, -1))

    def init_weights(
        self, init_std: float, out_std: float, generator: torch.Generator | None
    ) -> None:
        for linear in (self.wq, self.wk, self.wv):
            _trunc_normal(linear.weight, init_std, generator)
        _trunc_normal(self.wo.weight, out_std, generator)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS normalisation of the last dim, in float32 (Llama 4's QK norm)."""
    x_fp32 = x.float()
    return (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def attention_temperature(seq_len: int, floor_scale: int, attn_scale: float,
                          device: torch.device | None = None) -> torch.Tensor:
    """Per-position query scale of Llama 4's NoPE layers, shape ``(seq_len,)``."""
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    return torch.log1p(torch.floor((positions + 1.0) / floor_scale)) * attn_scale + 1.0


def chunked_causal_attention(q_bhse: torch.Tensor, k_bgse: torch.Tensor, v_bgse: torch.Tensor,
                             chunk: int) -> torch.Tensor:
    """Causal attention where a token sees only earlier tokens of its own ``chunk``-long block.

    The blocks become a batch dimension of one causal SDPA call, so the work is
    ``seq * chunk`` rather than ``seq^2``. A ragged tail is padded to a whole block: padding sits
    after every real token of its block, so causality keeps it out of their results. The call's
    tensors are 4-D (batch x blocks folded into one dimension): SDPA's fused CUDA kernels (flash,
    memory-efficient, cuDNN) take only 4-D inputs, and would otherwise leave it to the unfused math
    kernel, which stores every block's score matrix.
    """
    b, h, s, e = q_bhse.shape
    pad = -s % chunk
    if pad:
        q_bhse, k_bgse, v_bgse = (F.pad(t, (0, 0, 0, pad)) for t in (q_bhse, k_bgse, v_bgse))
    n = (s + pad) // chunk

    def blocks(t: torch.Tensor) -> torch.Tensor:  # (b, heads, n*c, e) -> (b*n, heads, c, e)
        return t.unflatten(2, (n, chunk)).transpose(1, 2).flatten(0, 1)

    out_Bhce = F.scaled_dot_product_attention(  # B = b*n
        blocks(q_bhse), blocks(k_bgse), blocks(v_bgse), is_causal=True, enable_gqa=True
    )
    return out_Bhce.unflatten(0, (b, n)).transpose(1, 2).flatten(2, 3)[:, :, :s]


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``; w1 is the gate, w3 the up and w2 the down projection."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x_bsd: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_bsd)) * self.w3(x_bsd))

    def init_weights(
        self, init_std: float, out_std: float, generator: torch.Generator | None
    ) -> None:
        _trunc_normal(self.w1.weight, init_std, generator)
        _trunc_normal(self.w3.weight, init_std, generator)
        _trunc_normal(self.w2.weight, out_std, generator)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attn(norm(x))``, ``out = h + ffn(norm(h))``; the
    feed-forward is a mixture of experts on Llama 4's MoE layers."""

    def __init__(self, args: ModelArgs, layer_id: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward: nn.Module
        if args.is_moe_layer(layer_id):
            self.feed_forward = MoE(args.dim, args.moe_hidden_dim, args.n_routed_experts, args.moe_top_k,
                                    args.router_score_function, args.shared_expert)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(
        self, x_bsd: torch.Tensor, cos_se: torch.Tensor, sin_se: torch.Tensor
    ) -> torch.Tensor:
        h_bsd = x_bsd + self.attention(self.attention_norm(x_bsd), cos_se, sin_se)
        return h_bsd + self.feed_forward(self.ffn_norm(h_bsd))

    def init_weights(
        self, init_std: float, out_std: float, generator: torch.Generator | None
    ) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(init_std, out_std, generator)
        self.feed_forward.init_weights(init_std, out_std, generator)


class SkippedLayer(nn.Module):
    """A layer another pipeline stage runs: it keeps the layer's place (and the others' names)."""

    def forward(self, x_bsd: torch.Tensor, cos_se: torch.Tensor, sin_se: torch.Tensor) -> torch.Tensor:
        return x_bsd

    def init_weights(self, init_std: float, out_std: float, generator: torch.Generator | None) -> None:
        pass


class Transformer(nn.Module):
    """Token embedding, ``n_layers`` blocks, final norm and an untied output head."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        # Built on the meta device (build_model, the layout planner), the table is not initialised here:
        # init_weights fills it once materialised, and a normal_ on meta runs torch's Python reference, whose
        # first call imports torch._dynamo (~3 s of start-up that serving and the planner otherwise never pay).
        on_meta = torch.get_default_device().type == "meta"
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim,
                                           _weight=torch.empty(args.vocab_size, args.dim) if on_meta else None)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Non-persistent: derived from args, so checkpoints stay free of them. Under a meta
        # device context these are only allocated (computing them there would import torch._dynamo
        # too); init_weights fills them after to_empty.
        if on_meta:
            rope_cos_se, rope_sin_se = (torch.empty(args.max_seq_len, args.head_dim) for _ in range(2))
        else:
            rope_cos_se, rope_sin_se = rope_cos_sin(args)
        self.register_buffer("rope_cos", rope_cos_se, persistent=False)
        self.register_buffer("rope_sin", rope_sin_se, persistent=False)

    def forward(self, tokens_bs: torch.Tensor, targets_bs: torch.Tensor | None = None) -> torch.Tensor:
        """Return float32 next-token logits of shape ``(batch, seq, vocab)``; given ``targets_bs``,
        the mean cross-entropy loss instead, computed by the output head and the loss together over
        token chunks without storing the logits (:mod:`workloads.llama.loss`).

        A pipeline stage (:func:`workloads.llama.parallel.split_stage`) without the embedding takes the
        previous stage's hidden states instead of tokens; one without the output head returns its hidden
        states."""
        if self.tok_embeddings is not None:
            if tokens_bs.shape[1] > self.args.max_seq_len:
                raise ValueError(
                    f"sequence length {tokens_bs.shape[1]} exceeds ModelArgs.max_seq_len "
                    f"({self.args.max_seq_len}); shorten the input or build with a larger max_seq_len"
                )
            h_bsd = self.tok_embeddings(tokens_bs)
        else:
            h_bsd = tokens_bs
        for layer in self.layers:  # each attention takes the table's first rows, as many as its sequence
            h_bsd = layer(h_bsd, self.rope_cos, self.rope_sin)
        if self.output is None:
            return h_bsd
        if targets_bs is not None:
            return linear_cross_entropy(self.norm(h_bsd).flatten(0, 1), self.output.weight, targets_bs.flatten())
        return self.output(self.norm(h_bsd)).float()

    @torch.no_grad()
    def init_weights(
        self, init_std: float = 0.02, generator: torch.Generator | None = None
    ) -> None:
        """(Re)initialise every parameter and recompute the RoPE tables in place.

        Weights are truncated normals with ``init_std``; the projections that write into the
        residual stream (``wo``, ``w2``) use ``init_std / sqrt(2 * n_layers)`` so the stream's
        variance does not grow with depth (GPT-2's scheme). Norm gains start at one.
        """
        cos_se, sin_se = rope_cos_sin(self.args, device=self.rope_cos.device)
        self.rope_cos.copy_(cos_se)
        self.rope_sin.copy_(sin_se)
        if self.tok_embeddings is not None:
            _trunc_normal(self.tok_embeddings.weight, init_std, generator)
        out_std = init_std / math.sqrt(2 * self.args.n_layers)
        for layer in self.layers:
            layer.init_weights(init_std, out_std, generator)
        if self.output is not None:
            self.norm.init_weights()
            _trunc_normal(self.output.weight, init_std, generator)


def _trunc_normal(weight: torch.Tensor, std: float, generator: torch.Generator | None) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)


def build_model(args: ModelArgs, device: torch.device | str, seed: int) -> Transformer:
    """Construct on meta, materialise on ``device`` and initialise from ``seed``.

    The same seed on the same device type gives bit-identical weights, independent of the
    global RNG state.
    """
    with torch.device("meta"):
        model = Transformer(args)
    device = torch.device(device)
    model.to_empty(device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    model.init_weights(generator=generator)
    return model


def count_params(model_or_args: Transformer | ModelArgs, include_embedding: bool = True) -> int:
    """Parameter count (every expert included). From ``ModelArgs`` it is analytic (no module
    needed); from a model it sums the real tensors (meta tensors count too).
    ``include_embedding=False`` drops only the token embedding table, which is a lookup and costs
    no FLOPs; the output head stays in."""
    if isinstance(model_or_args, nn.Module):
        total = sum(p.numel() for p in model_or_args.parameters())
        if not include_embedding:
            total -= model_or_args.tok_embeddings.weight.numel()
        return total
    return count_total_params(model_or_args, include_embedding)


__all__ = [
    "PRESETS",
    "ModelArgs",
    "SkippedLayer",
    "Transformer",
    "build_model",
    "count_active_params",
    "count_params",
    "training_flops_per_token",
]
