"""Llama serving under MLPerf LoadGen: KV cache, continuous batching, TTFT/TPOT, capacity at SLO."""

from workloads.base import declare, lazy_attributes

declare("llama_infer", "workloads.llama_infer.workload",
        "Llama with a KV cache and continuous batching, served under MLPerf LoadGen (Offline, Server, SingleStream)",
        config="workloads.llama_infer.config:LlamaInferConfig")

# the public names, imported on first use: the package itself stays cheap to import
EXPORTS = {
    "workloads.llama_infer.config": ["LlamaInferConfig"],
    "workloads.llama_infer.decoder": ["CachedDecoder", "KVCache"],
    "workloads.llama_infer.engine": ["Request", "ServingEngine", "generate"],
    "workloads.llama_infer.workload": ["LlamaInferWorkload"],
}
__getattr__ = lazy_attributes(__name__, EXPORTS)
__all__ = sorted(name for names in EXPORTS.values() for name in names)
