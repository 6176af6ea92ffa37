"""Llama 3-style decoder training benchmark."""

from workloads.llama.hf import from_hf_config, load_hf_state_dict
from workloads.llama.model import PRESETS, ModelArgs, Transformer
from workloads.llama.workload import LlamaConfig, LlamaWorkload

__all__ = [
    "PRESETS",
    "LlamaConfig",
    "LlamaWorkload",
    "ModelArgs",
    "Transformer",
    "from_hf_config",
    "load_hf_state_dict",
]
