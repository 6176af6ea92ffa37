"""Llama 3-style decoder training benchmark."""

from workloads.base import declare, declare_planner, declare_preparer, lazy_attributes

declare("llama", "workloads.llama.workload",
        "Llama 3-style decoder, training on a learnable synthetic corpus, C4 or Megatron indexed data",
        config="workloads.llama.config:LlamaConfig")
declare_preparer("c4", "workloads.llama.prepare",
                 "C4 JSON shards (allenai/c4 en) -> a Megatron indexed dataset PREFIX.bin/.idx, tokenized once")
declare_planner("llama", "workloads.llama.plan")

# the public names, imported on first use: the package itself stays cheap to import
EXPORTS = {
    "workloads.llama.config": ["LlamaConfig"],
    "workloads.llama.hf": ["from_hf_config", "load_hf_state_dict"],
    "workloads.llama.model": ["PRESETS", "ModelArgs", "Transformer"],
    "workloads.llama.workload": ["LlamaWorkload"],
}
__getattr__ = lazy_attributes(__name__, EXPORTS)
__all__ = sorted(name for names in EXPORTS.values() for name in names)
