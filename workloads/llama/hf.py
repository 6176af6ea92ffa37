"""Load Hugging Face Llama configs and weights into :mod:`workloads.llama.model`.

HF stores q/k projections already permuted for the rotate-half RoPE our model uses, so every
tensor copies over unchanged; only the names differ.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from workloads.llama.model import ModelArgs

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
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def from_hf_config(hf_config: Any) -> ModelArgs:
    """Translate a transformers ``LlamaConfig`` (or the dict in a ``config.json``) to ModelArgs.

    Reads RoPE settings from ``rope_parameters`` (transformers 5) or from ``rope_theta`` plus
    ``rope_scaling`` (transformers 4). ``max_seq_len`` becomes ``max_position_embeddings``; use
    ``dataclasses.replace`` to shrink it when the RoPE tables for 128k positions are not needed.
    """
    config = _as_dict(hf_config)
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
        ffn_hidden_dim=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        max_seq_len=max_positions,
        **_rope_args(config, max_positions),
    )
    args.validate()
    return args


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


def _our_name(hf_name: str) -> str | None:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    match = _LAYER_KEY.fullmatch(hf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def load_hf_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy an HF ``LlamaForCausalLM`` state dict into ``model`` in place.

    RoPE ``inv_freq`` buffers are ignored (we recompute them). Anything else that does not line
    up -- a key missing on either side or a shape that differs -- raises ``ValueError`` listing
    every problem before any weight is touched, so a model is never left half loaded.
    """
    expected = model.state_dict()
    mapped: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for hf_name, tensor in state_dict.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        name = _our_name(hf_name)
        if name is None or name not in expected:
            unexpected.append(hf_name)
        else:
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


__all__ = ["SUPPORTED_ROPE_TYPES", "from_hf_config", "load_hf_state_dict"]
