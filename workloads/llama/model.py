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

from workloads.llama.moe import ROUTER_SCORE_FUNCTIONS, MoE


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
    # -- Llama 4 attention (all off: Llama 3) --
    nope_layer_interval: int | None = None  # every N-th layer is global attention without RoPE
    attention_chunk_size: int | None = None  # RoPE layers attend only within chunks of this size
    use_qk_norm: bool = False  # weightless L2 (RMS) norm of q and k after RoPE, on RoPE layers
    attn_temperature_tuning: bool = False  # NoPE layers: scale q by 1 + attn_scale*log1p(floor((pos+1)/floor))
    attn_floor_scale: int = 8192
    attn_scale: float = 0.1
    # -- Llama 4 mixture of experts (n_routed_experts 0: dense) --
    n_routed_experts: int = 0
    moe_top_k: int = 1
    interleave_moe_layer_step: int = 1  # every N-th layer is MoE (layers N-1, 2N-1, ...)
    moe_hidden_dim: int | None = None  # each expert's (and the shared expert's) SwiGLU width
    shared_expert: bool = True
    router_score_function: str = "sigmoid"  # or "softmax"

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

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.n_routed_experts > 0 and (layer_id + 1) % self.interleave_moe_layer_step == 0

    def uses_rope(self, layer_id: int) -> bool:
        """False on Llama 4's interleaved global NoPE layers."""
        return self.nope_layer_interval is None or (layer_id + 1) % self.nope_layer_interval != 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

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
            if not 0 < self.rope_low_freq_factor <= self.rope_high_freq_factor:
                raise ValueError(
                    "Llama 3 RoPE scaling needs 0 < rope_low_freq_factor <= rope_high_freq_factor, "
                    f"got {self.rope_low_freq_factor} and {self.rope_high_freq_factor}"
                )
        self._validate_llama4()

    def _validate_llama4(self) -> None:
        for name in ("nope_layer_interval", "attention_chunk_size", "attn_floor_scale",
                     "interleave_moe_layer_step", "moe_top_k"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"ModelArgs.{name} must be >= 1, got {value}")
        if self.n_routed_experts < 0:
            raise ValueError(f"ModelArgs.n_routed_experts must be >= 0 (0: dense), got {self.n_routed_experts}")
        if not self.n_routed_experts:
            return
        if self.router_score_function not in ROUTER_SCORE_FUNCTIONS:
            raise ValueError(f"ModelArgs.router_score_function must be one of {ROUTER_SCORE_FUNCTIONS}, "
                             f"got {self.router_score_function!r}")
        if self.moe_top_k > self.n_routed_experts:
            raise ValueError(f"ModelArgs.moe_top_k ({self.moe_top_k}) exceeds n_routed_experts "
                             f"({self.n_routed_experts}): a token cannot pick more experts than exist")
        if self.moe_hidden_dim is None or self.moe_hidden_dim < 1:
            raise ValueError(f"ModelArgs.moe_hidden_dim must be a positive integer for an MoE model, "
                             f"got {self.moe_hidden_dim}")
        # grouped_mm wants every row stride a multiple of 16 bytes (8 bf16 elements)
        for name in ("dim", "moe_hidden_dim"):
            if getattr(self, name) % 8:
                raise ValueError(f"ModelArgs.{name} ({getattr(self, name)}) must be a multiple of 8 in an MoE "
                                 "model: the grouped expert GEMM needs 16-byte aligned rows")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


# "tiny" is a CPU smoke-test size; the llama3_* are Llama 3.1's published shapes (Meta's
# params.json). All keep the scaled-RoPE defaults above, as Llama 3.1 does.
_LLAMA4_ATTENTION = dict(nope_layer_interval=4, attention_chunk_size=8192, use_qk_norm=True,
                         attn_temperature_tuning=True, attn_floor_scale=8192, attn_scale=0.1)
_LLAMA4_TRUNK = dict(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, vocab_size=202048,
                     ffn_hidden_dim=16384, moe_hidden_dim=8192, moe_top_k=1, rope_theta=500000.0,
                     rope_scale_factor=16.0, rope_low_freq_factor=1.0, rope_high_freq_factor=1.0,
                     max_seq_len=131072)
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
    # Llama 4 on CPU: every feature on at a size a CPU trains in seconds. With seq_len 64 the
    # RoPE layers (0-2) attend in chunks of 32; layer 3 is global NoPE with temperature tuning
    # active (floor 16, not 8192); layers 1 and 3 are MoE (8 experts, top-1 + shared).
    "tiny_moe": ModelArgs(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_hidden_dim=128,
        max_seq_len=256, **{**_LLAMA4_ATTENTION, "attention_chunk_size": 32, "attn_floor_scale": 16},
        n_routed_experts=8, moe_top_k=1, interleave_moe_layer_step=2, moe_hidden_dim=64,
    ),
    # transformers' Llama4TextConfig defaults (Scout: 16 experts top-1 + shared, MoE every layer)
    "llama4_scout": ModelArgs(**_LLAMA4_TRUNK, **_LLAMA4_ATTENTION, n_routed_experts=16),
    # ... with 128 experts on every 2nd layer (Maverick); its checkpoint has no QK norm
    "llama4_maverick": ModelArgs(**_LLAMA4_TRUNK, **{**_LLAMA4_ATTENTION, "use_qk_norm": False},
                                 n_routed_experts=128, interleave_moe_layer_step=2),
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
        q_bhse = self.wq(x_bsd).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k_bgse = self.wk(x_bsd).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v_bgse = self.wv(x_bsd).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
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
    after every real token of its block, so causality keeps it out of their results.
    """
    b, h, s, e = q_bhse.shape
    pad = -s % chunk
    if pad:
        q_bhse, k_bgse, v_bgse = (F.pad(t, (0, 0, 0, pad)) for t in (q_bhse, k_bgse, v_bgse))
    n = (s + pad) // chunk

    def blocks(t: torch.Tensor) -> torch.Tensor:  # (b, heads, n*c, e) -> (b, n, heads, c, e)
        return t.unflatten(2, (n, chunk)).transpose(1, 2)

    out_bnhce = F.scaled_dot_product_attention(
        blocks(q_bhse), blocks(k_bgse), blocks(v_bgse), is_causal=True, enable_gqa=True
    )
    return out_bnhce.transpose(1, 2).flatten(2, 3)[:, :, :s]


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


class Transformer(nn.Module):
    """Token embedding, ``n_layers`` blocks, final norm and an untied output head."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
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
    """Parameter count (every expert included). From ``ModelArgs`` it is analytic (no module
    needed); from a model it sums the real tensors (meta tensors count too).
    ``include_embedding=False`` drops only the token embedding table, which is a lookup and costs
    no FLOPs; the output head stays in."""
    if isinstance(model_or_args, nn.Module):
        total = sum(p.numel() for p in model_or_args.parameters())
        if not include_embedding:
            total -= model_or_args.tok_embeddings.weight.numel()
        return total
    return _count(model_or_args, include_embedding, routed_share=1.0)


def count_active_params(args: ModelArgs, include_embedding: bool = True) -> int:
    """Parameters one token passes through: attention, dense layers, routers, shared experts and
    ``top_k / n_routed_experts`` of the routed experts (all of them for a dense model)."""
    share = args.moe_top_k / args.n_routed_experts if args.n_routed_experts else 1.0
    return _count(args, include_embedding, routed_share=share)


def _count(args: ModelArgs, include_embedding: bool, routed_share: float) -> int:
    q_width, kv_width = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    attention = args.dim * q_width + 2 * args.dim * kv_width + q_width * args.dim
    norms = 2 * args.dim
    dense_ffn = 3 * args.dim * args.hidden_dim
    total = 0.0
    for layer_id in range(args.n_layers):
        total += attention + norms
        if args.is_moe_layer(layer_id):
            expert = 3 * args.dim * args.moe_hidden_dim
            total += args.dim * args.n_routed_experts  # router
            total += expert if args.shared_expert else 0
            total += routed_share * args.n_routed_experts * expert
        else:
            total += dense_ffn
    embedding = args.vocab_size * args.dim
    head = args.dim * args.vocab_size + args.dim  # output projection plus the final norm
    return round(total + head + (embedding if include_embedding else 0))


def training_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Model FLOPs for one trained token (forward plus backward), the usual MFU convention.

    ``6 * N_active`` for the weights (2 forward, 4 backward per parameter per token), where
    ``N_active`` (:func:`count_active_params`, embedding table excluded, output head included)
    is attention + dense feed-forwards + routers + shared experts + ``top_k / n_routed_experts``
    of the routed experts -- for a dense model simply every parameter. Plus, per layer,
    ``12 * n_heads * head_dim * span`` for the two attention matmuls (scores and weighted
    values), where ``span`` is ``seq_len``, or ``min(seq_len, attention_chunk_size)`` on chunked
    (local) RoPE layers. Attention is counted in full, as if not causal, matching PaLM's
    appendix and most published MFU numbers; a causal kernel does about half of that work.
    Routing's own work (top-k, sort, gather/scatter) is not counted: it is not model FLOPs.
    """
    weights = 6 * count_active_params(args, include_embedding=False)
    attention = 0
    for layer_id in range(args.n_layers):
        span = seq_len
        if args.attention_chunk_size is not None and args.uses_rope(layer_id):
            span = min(seq_len, args.attention_chunk_size)
        attention += 6 * args.n_heads * args.head_dim * 2 * span
    return float(weights + attention)


__all__ = [
    "PRESETS",
    "ModelArgs",
    "Transformer",
    "build_model",
    "count_active_params",
    "count_params",
    "training_flops_per_token",
]
