"""Llama 3-style decoder training benchmark."""

from __future__ import annotations

import importlib
from typing import Any

from workloads.base import declare

declare("llama", "workloads.llama.workload",
        "Llama 3-style decoder, training on a learnable synthetic corpus")

# the public names, imported on first use (the package itself stays cheap to import)
_EXPORTS = {
    "from_hf_config": "workloads.llama.hf",
    "load_hf_state_dict": "workloads.llama.hf",
    "PRESETS": "workloads.llama.model",
    "ModelArgs": "workloads.llama.model",
    "Transformer": "workloads.llama.model",
    "LlamaConfig": "workloads.llama.workload",
    "LlamaWorkload": "workloads.llama.workload",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
