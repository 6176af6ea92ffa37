"""A Llama 3-style decoder, written to be read top to bottom like the paper.

Shape suffixes on tensor names: ``b`` batch, ``s`` sequence, ``d`` model dim, ``h`` query heads,
``g`` key/value heads, ``e`` head dim, ``f`` feed-forward hidden dim, ``v`` vocabulary.

Construction and weight initialisation are kept apart: build the module on the meta device (free,
even for 405B), move it with ``to_empty`` and call :meth:`Transformer.init_weights`.
:func:`build_model` does exactly that, seeded so the same seed gives bit-identical weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True)
class ModelArgs:
    """Shape and numerics of the decoder; defaults follow Llama 3.1. Keyword-only, so a
    positional mix-up of the many integer fields cannot happen."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None: plain multi-head attention (= n_heads)
    vocab_size: int
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    ffn_hidden_dim: int | None = None  # explicit override, e.g. HF's intermediate_size
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_scaled_rope: bool = True
    rope_scale_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 8192

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden size: 2/3 of the classic 4*dim (three matrices instead of two), then
        scaled by ``ffn_dim_multiplier`` and rounded up to ``multiple_of`` for efficient GEMMs."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field and what it may be."""
        sizes = {
            "dim": self.dim,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_kv_heads": self.kv_heads,
            "vocab_size": self.vocab_size,
            "multiple_of": self.multiple_of,
            "max_seq_len": self.max_seq_len,
        }
        if self.ffn_hidden_dim is not None:
            sizes["ffn_hidden_dim"] = self.ffn_hidden_dim
        for name, value in sizes.items():
            if value <= 0:
                raise ValueError(f"ModelArgs.{name} must be a positive integer, got {value}")
        for name in ("norm_eps", "rope_theta", "ffn_dim_multiplier"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"ModelArgs.{name} must be > 0, got {value}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"ModelArgs.dim ({self.dim}) must be divisible by n_heads ({self.n_heads}); "
                f"pick n_heads from the divisors of dim, e.g. {_divisors(self.dim)[-6:]}"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"heads not divisible by KV heads: n_heads ({self.n_heads}) must be a multiple of "
                f"n_kv_heads ({self.kv_heads}) so each KV head serves a whole group of query "
                f"heads; allowed n_kv_heads: {_divisors(self.n_heads)}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = dim / n_heads = {self.head_dim} must be even because RoPE rotates "
                f"pairs of channels; change ModelArgs.dim ({self.dim}) or n_heads ({self.n_heads})"
            )
        if self.use_scaled_rope:
            if self.rope_scale_factor < 1:
                raise ValueError(
                    f"ModelArgs.rope_scale_factor must be >= 1, got {self.rope_scale_factor}"
                )
            if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ValueError(
                    "Llama 3 RoPE scaling needs 0 < rope_low_freq_factor < rope_high_freq_factor, "
                    f"got {self.rope_low_freq_factor} and {self.rope_high_freq_factor}"
                )


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


# "tiny" is a CPU smoke-test size; the rest are Llama 3.1's published shapes (Meta's
# params.json). All keep the scaled-RoPE defaults above, as Llama 3.1 does.
PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=32,
        max_seq_len=256,
    ),
    "llama3_8b": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
        ffn_dim_multiplier=1.3, multiple_of=1024, rope_theta=500000.0,
    ),
    "llama3_70b": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
        ffn_dim_multiplier=1.3, multiple_of=4096, rope_theta=500000.0,
    ),
    "llama3_405b": ModelArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
        ffn_dim_multiplier=1.2, multiple_of=4096, rope_theta=500000.0,
    ),
}  # fmt: skip


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
    smooth = (original / wavelength - low) / (high - low)
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
    ``n_heads / n_kv_heads`` query heads, which shrinks the KV projections and cache."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def forward(
        self, x_bsd: torch.Tensor, cos_se: torch.Tensor, sin_se: torch.Tensor
    ) -> torch.Tensor:
        b, s, _ = x_bsd.shape
        q_bhse = self.wq(x_bsd).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k_bgse = self.wk(x_bsd).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v_bgse = self.wv(x_bsd).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q_bhse, k_bgse = apply_rope(q_bhse, cos_se, sin_se), apply_rope(k_bgse, cos_se, sin_se)
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
    """Pre-norm residual block: ``h = x + attn(norm(x))``, ``out = h + ffn(norm(h))``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
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


class Transformer(nn.Module):
    """Token embedding, ``n_layers`` blocks, final norm and an untied output head."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Non-persistent: derived from args, so checkpoints stay free of them. Under a meta
        # device context these are meta too; init_weights fills them after to_empty.
        rope_cos_se, rope_sin_se = rope_cos_sin(args)
        self.register_buffer("rope_cos", rope_cos_se, persistent=False)
        self.register_buffer("rope_sin", rope_sin_se, persistent=False)

    def forward(self, tokens_bs: torch.Tensor) -> torch.Tensor:
        """Return float32 next-token logits of shape ``(batch, seq, vocab)``."""
        seq_len = tokens_bs.shape[1]
        if seq_len > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds ModelArgs.max_seq_len "
                f"({self.args.max_seq_len}); shorten the input or build with a larger max_seq_len"
            )
        cos_se, sin_se = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        h_bsd = self.tok_embeddings(tokens_bs)
        for layer in self.layers:
            h_bsd = layer(h_bsd, cos_se, sin_se)
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
        _trunc_normal(self.tok_embeddings.weight, init_std, generator)
        out_std = init_std / math.sqrt(2 * self.args.n_layers)
        for layer in self.layers:
            layer.init_weights(init_std, out_std, generator)
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
    """Parameter count. From ``ModelArgs`` it is analytic (no module needed); from a model it sums
    the real tensors (meta tensors count too). ``include_embedding=False`` drops only the token
    embedding table, which is a lookup and costs no FLOPs; the output head stays in."""
    if isinstance(model_or_args, nn.Module):
        total = sum(p.numel() for p in model_or_args.parameters())
        if not include_embedding:
            total -= model_or_args.tok_embeddings.weight.numel()
        return total

    args = model_or_args
    q_width, kv_width = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    attention = args.dim * q_width + 2 * args.dim * kv_width + q_width * args.dim
    feed_forward = 3 * args.dim * args.hidden_dim
    norms = 2 * args.dim
    per_layer = attention + feed_forward + norms
    embedding = args.vocab_size * args.dim
    head = args.dim * args.vocab_size + args.dim  # output projection plus the final norm
    return args.n_layers * per_layer + head + (embedding if include_embedding else 0)


def training_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Model FLOPs for one trained token (forward plus backward), the usual MFU convention.

    ``6 * N`` for the weights (2 forward, 4 backward per parameter per token; ``N`` excludes
    the embedding table but includes the output head) plus ``12 * n_layers * n_heads * head_dim
    * seq_len`` for the two attention matmuls (scores and weighted values). Attention is counted
    in full, as if not causal, matching PaLM's appendix and most published MFU numbers; a
    causal kernel does about half of that work.
    """
    weights = 6 * count_params(args, include_embedding=False)
    attention = 6 * args.n_layers * args.n_heads * args.head_dim * 2 * seq_len
    return float(weights + attention)


__all__ = [
    "PRESETS",
    "ModelArgs",
    "Transformer",
    "build_model",
    "count_params",
    "training_flops_per_token",
]
