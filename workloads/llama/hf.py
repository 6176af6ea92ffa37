"""Load Hugging Face Llama configs and weights into :mod:`workloads.llama.model`.

Llama 3 (``LlamaForCausalLM``): HF stores q/k projections already permuted for the rotate-half
RoPE our model uses, so every tensor copies over unchanged; only the names differ.

Llama 4 text (``Llama4ForCausalLM``): HF rotates *interleaved* channel pairs ``(2i, 2i+1)``, our
model rotate-half pairs ``(i, i + head_dim/2)``; the q/k rows of RoPE layers are permuted on load
so both compute the same scores (QK norm and attention are invariant to a permutation shared by q
and k). HF's fused expert weights ``gate_up_proj [E, D, 2F]`` (gate columns first) are split into our
``w1`` and ``w3 [E, D, F]``; ``down_proj [E, F, D]`` is our ``w2``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from workloads.llama.model import ModelArgs, Transformer

SUPPORTED_ROPE_TYPES = ("default", "llama3")

_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_LLAMA4_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if not k.startswith("mlp.")},
    "feed_forward.gate_proj.weight": "feed_forward.w1.weight",  # dense (non-MoE) layers
    "feed_forward.up_proj.weight": "feed_forward.w3.weight",
    "feed_forward.down_proj.weight": "feed_forward.w2.weight",
    **{name: name for name in (
        "feed_forward.router.weight",
        "feed_forward.shared_expert.gate_proj.weight", "feed_forward.shared_expert.up_proj.weight",
        "feed_forward.shared_expert.down_proj.weight",
    )},
    "feed_forward.experts.gate_up_proj": "feed_forward.experts.w1",  # and w3: split on load
    "feed_forward.experts.down_proj": "feed_forward.experts.w2",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def from_hf_config(hf_config: Any) -> ModelArgs:
    """Translate a transformers ``LlamaConfig`` or ``Llama4TextConfig`` (or the dict in a
    ``config.json``) to ModelArgs.

    Reads RoPE settings from ``rope_parameters`` (transformers 5) or from ``rope_theta`` plus
    ``rope_scaling`` (transformers 4). ``max_seq_len`` becomes ``max_position_embeddings``; use
    ``dataclasses.replace`` to shrink it when the RoPE tables for 128k positions are not needed.
    """
    config = _as_dict(hf_config)
    if "text_config" in config:
        raise ValueError("got a multimodal Llama4Config; pass its text part (config.text_config)")
    is_llama4 = config.get("model_type") == "llama4_text" or "num_local_experts" in config
    for flag in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
        if config.get(flag, False):
            raise ValueError(
                f"HF config has {flag}=True, which this model does not implement (untied output "
                "head, bias-free projections); use a checkpoint with it set to False"
            )
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"HF config hidden_act={config['hidden_act']!r}; only 'silu' is supported")

    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * n_heads != dim:
        raise ValueError(
            f"HF config head_dim={head_dim} differs from hidden_size / num_attention_heads = "
            f"{dim} / {n_heads}; this model derives head_dim from dim and n_heads"
        )

    max_positions = config.get("max_position_embeddings", 8192)
    args = ModelArgs(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        vocab_size=config["vocab_size"],
        ffn_hidden_dim=config["intermediate_size_mlp" if is_llama4 else "intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        max_seq_len=max_positions,
        **_rope_args(config, max_positions),
        **(_llama4_args(config) if is_llama4 else {}),
    )
    args.validate()
    return args


def _llama4_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """Llama 4's attention and MoE settings. HF allows arbitrary per-layer lists; this model
    derives them from two intervals, so lists that no interval produces are rejected."""
    n_layers = config["num_hidden_layers"]
    if config.get("router_jitter_noise", 0.0):
        raise ValueError("HF config router_jitter_noise != 0 is not implemented; set it to 0.0")
    step = config.get("interleave_moe_layer_step", 1)
    moe_layers = config.get("moe_layers")
    if moe_layers is not None and list(moe_layers) != list(range(step - 1, n_layers, step)):
        raise ValueError(f"HF config moe_layers={moe_layers} is not every {step}-th layer; only "
                         "interleave_moe_layer_step spacing is supported")
    interval = config.get("no_rope_layer_interval", 4)
    no_rope_layers = config.get("no_rope_layers")  # 1 = RoPE layer, 0 = NoPE layer (HF's naming)
    derived = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if no_rope_layers and list(no_rope_layers)[:n_layers] != derived:
        raise ValueError(f"HF config no_rope_layers={no_rope_layers} is not a NoPE layer every "
                         f"{interval}-th layer; only no_rope_layer_interval spacing is supported")
    return {
        "nope_layer_interval": interval,
        "attention_chunk_size": config.get("attention_chunk_size"),
        "use_qk_norm": config.get("use_qk_norm", True),
        "attn_temperature_tuning": config.get("attn_temperature_tuning", True),
        "attn_floor_scale": config.get("floor_scale", 8192),
        "attn_scale": config.get("attn_scale", 0.1),
        "n_routed_experts": config["num_local_experts"],
        "moe_top_k": config.get("num_experts_per_tok", 1),
        "interleave_moe_layer_step": step,
        "moe_hidden_dim": config["intermediate_size"],
        "shared_expert": True,
        "router_score_function": "sigmoid",
    }


def _as_dict(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(
        f"expected a transformers LlamaConfig or a config.json dict, got {type(hf_config)}"
    )


def _rope_args(config: Mapping[str, Any], max_positions: int) -> dict[str, Any]:
    # transformers 5 folds rope_theta into rope_parameters; 4.x keeps it top level next to
    # rope_scaling (which is None for unscaled models). Old files spell rope_type as "type".
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"HF config rope_type={rope_type!r} is not supported; "
            f"supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return {"rope_theta": rope_theta, "use_scaled_rope": False}
    return {
        "rope_theta": rope_theta,
        "use_scaled_rope": True,
        "rope_scale_factor": rope["factor"],
        "rope_low_freq_factor": rope["low_freq_factor"],
        "rope_high_freq_factor": rope["high_freq_factor"],
        # HF falls back to max_position_embeddings when the original length is not given.
        "rope_original_max_seq_len": rope.get("original_max_position_embeddings", max_positions),
    }


def _our_name(hf_name: str, llama4: bool) -> str | None:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    match = _LAYER_KEY.fullmatch(hf_name)
    names = _LLAMA4_LAYER_NAMES if llama4 else _LAYER_NAMES
    if match and match.group(2) in names:
        return f"layers.{match.group(1)}.{names[match.group(2)]}"
    return None


def interleaved_to_rotate_half(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder each head's output rows of a q/k projection from interleaved RoPE pairs
    ``(2i, 2i+1)`` to rotate-half pairs ``(i, i + head_dim/2)``."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return weight.unflatten(0, (-1, head_dim))[:, order].flatten(0, 1)


def load_hf_state_dict(model: Transformer, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy an HF ``LlamaForCausalLM`` or ``Llama4ForCausalLM`` state dict into ``model`` in place.

    RoPE ``inv_freq`` buffers are ignored (we recompute them); the experts' balancing bias, which
    HF does not have, is set to zero (HF's routing). Anything else that does not line up -- a key
    missing on either side or a shape that differs -- raises ``ValueError`` listing every problem
    before any weight is touched, so a model is never left half loaded.
    """
    args = model.args  # they say whether the Llama 4 names apply
    llama4 = args.n_routed_experts > 0 or args.nope_layer_interval is not None
    expected = model.state_dict()
    mapped: dict[str, torch.Tensor] = {
        name: torch.zeros_like(tensor) for name, tensor in expected.items() if name.endswith(".expert_bias")
    }
    unexpected: list[str] = []
    for hf_name, tensor in state_dict.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        name = _our_name(hf_name, llama4)
        if name is None or name not in expected:
            unexpected.append(hf_name)
            continue
        layer = _LAYER_KEY.fullmatch(hf_name)
        if (llama4 and layer and name.endswith(("attention.wq.weight", "attention.wk.weight"))
                and args.uses_rope(int(layer.group(1))) and tensor.shape == expected[name].shape):
            tensor = interleaved_to_rotate_half(tensor, args.head_dim)
        if name.endswith(".experts.w1"):  # HF's gate_up_proj: gate columns, then up
            tensor, mapped[name[:-1] + "3"] = tensor.chunk(2, dim=-1)
        mapped[name] = tensor

    missing = sorted(set(expected) - set(mapped))
    mismatched = [
        f"{name}: checkpoint {tuple(tensor.shape)} vs model {tuple(expected[name].shape)}"
        for name, tensor in mapped.items()
        if tensor.shape != expected[name].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing keys (our names): {missing}")
        if "output.weight" in missing:
            problems.append("no lm_head.weight: tied-embedding checkpoints are not supported")
    if unexpected:
        problems.append(f"unexpected keys (HF names): {sorted(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {mismatched}")
    if problems:
        raise ValueError(
            "HF state dict does not fit the model; check that the ModelArgs came from this "
            "checkpoint's config via from_hf_config.\n  " + "\n  ".join(problems)
        )
    model.load_state_dict(mapped, strict=True)


__all__ = ["SUPPORTED_ROPE_TYPES", "from_hf_config", "interleaved_to_rotate_half", "load_hf_state_dict"]
