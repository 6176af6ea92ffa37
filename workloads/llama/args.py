"""The Llama decoder's shape and numerics (:class:`ModelArgs`), the published presets, and the analytic
parameter and FLOP counts that MFU is computed from (no module needed: they work for 400 B models on a
laptop). The modules themselves are in :mod:`workloads.llama.model`."""

from __future__ import annotations

import math
from dataclasses import dataclass

ROUTER_SCORE_FUNCTIONS = ("sigmoid", "softmax")


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


def count_total_params(args: ModelArgs, include_embedding: bool = True) -> int:
    """Every parameter, every expert included (see :func:`workloads.llama.model.count_params`)."""
    return _count(args, include_embedding, routed_share=1.0)


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
