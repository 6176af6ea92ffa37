"""``workload=llama_infer``'s config: the schema of ``conf/workload/llama_infer.yaml``, the model, the
LoadGen scenario and its load, the requests. Light: importing it imports neither torch nor MLPerf LoadGen
(whose scenario and model names the checks take when a config is checked)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from workloads.base import invalid_config as _invalid
from workloads.llama.args import PRESETS, ModelArgs
from workloads.llama_infer.data import LengthDistribution

DTYPES = ("float32", "bfloat16")  # the torch dtype of that name


@dataclass
class LlamaInferConfig:
    """``workload=llama_infer``. Lengths are in tokens, latencies in ms, loads in queries/s."""

    name: str = "llama_infer"
    preset: str = "tiny"  # a dense preset of workloads.llama (tiny, llama3_8b, ...)
    max_seq_len: int | None = None  # the context (KV cache length); None: the preset's
    dtype: str = "float32"
    scenario: str = "Server"  # Offline | Server | SingleStream
    mlperf_model: str = "llama3_1-8b"  # whose limits in LoadGen's mlperf.conf: llama3_1-8b | llama3_1-8b-interactive
    latency_scale: float = 1.0  # TTFT and TPOT limits = mlperf.conf's x this (a model not the real size)
    max_batch: int = 32  # requests decoded together (continuous batching)
    num_threads: int = 1  # torch intra-op threads while serving (part of the SUT); 0: the platform's
    eos_token_id: int | None = None  # stop a request at this token; None: at its max new tokens only
    samples: int = 600  # requests in the sample library (LoadGen's QSL); a test issues whole multiples of it
    min_queries: int = 600  # per test; early stopping on the p99s needs ~600
    min_duration_ms: int = 0
    server_target_qps: float = 40.0  # Server: Poisson arrivals at this rate (the first probe with find_qps_at_slo)
    offline_expected_qps: float = 100.0  # Offline: LoadGen sizes its one query from this and min_duration_ms
    single_stream_expected_latency_ms: float = 50.0
    vocab_size: int | None = None  # the model's vocabulary; None: the preset's (a tokenizer or file ids may need more)
    # real prompts (prompts.py): a JSON lines file; None: synthetic requests drawn as below
    prompts: str | None = None
    tokenizer: str | None = None  # tokenizer.json or a model folder: encodes the file's text prompts and answers
    truncate_prompts: bool = False  # cut prompts that overflow the context from the left (else: refused)
    # synthetic request lengths, shaped like MLPerf's llama3.1-8b set (data.py); output_max is also the
    # budget of a file's query that gives none
    prompt_mean: int = 96
    prompt_sigma: float = 0.5
    prompt_min: int = 8
    prompt_max: int = 192
    output_min: int = 4
    output_max: int = 48
    data_seed: int = 0
    warmup_requests: int = 64  # served by the engine in setup, before any LoadGen test
    # capacity (Server only)
    find_qps_at_slo: bool = False  # search the highest VALID Server load (capacity.py)
    max_probes: int = 8  # LoadGen Server tests the search may run
    min_qps: float = 0.5  # below this the search gives up: no useful load meets the SLO
    target_load_qps: float = 0.0  # > 0: report the hosts this load needs at qps_at_slo per host

    def __post_init__(self) -> None:
        # MLPerf LoadGen's names: imported when a config is checked
        from workloads.llama_infer.loadgen_sut import SCENARIOS
        from workloads.llama_infer.settings import MLPERF_MODELS

        if self.preset not in PRESETS:
            raise _invalid("preset", f"got {self.preset!r}, allowed values: {', '.join(PRESETS)}")
        if self.scenario not in SCENARIOS:
            raise _invalid("scenario", f"got {self.scenario!r}; LoadGen's LLM scenarios here: {', '.join(SCENARIOS)}")
        if self.mlperf_model not in MLPERF_MODELS:
            raise _invalid("mlperf_model", f"got {self.mlperf_model!r}, allowed values: {', '.join(MLPERF_MODELS)}")
        if self.dtype not in DTYPES:
            raise _invalid("dtype", f"got {self.dtype!r}, allowed values: {', '.join(DTYPES)}")
        for key in ("server_target_qps", "offline_expected_qps", "single_stream_expected_latency_ms",
                    "latency_scale", "min_qps"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise _invalid(key, f"got {value}, must be > 0")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise _invalid("vocab_size", f"got {self.vocab_size}, must be >= 1 (or null: the preset's)")
        if self.tokenizer is not None and self.prompts is None:
            raise _invalid("tokenizer", "the tokenizer encodes the prompts of workload.prompts, which is not set: add "
                           "workload.prompts=<file.jsonl>, or drop workload.tokenizer to serve synthetic requests")
        for key in ("max_batch", "samples", "min_queries", "max_probes"):
            if getattr(self, key) < 1:
                raise _invalid(key, f"got {getattr(self, key)}, must be >= 1")
        for key in ("min_duration_ms", "warmup_requests", "num_threads"):
            if getattr(self, key) < 0:
                raise _invalid(key, f"got {getattr(self, key)}, must be >= 0")
        if self.target_load_qps < 0:
            raise _invalid("target_load_qps", f"got {self.target_load_qps}, must be >= 0 (0: none)")
        if self.find_qps_at_slo and self.scenario != "Server":
            raise _invalid("find_qps_at_slo", f"capacity at SLO is a Server search; got scenario={self.scenario}, "
                           "add workload.scenario=Server")
        if self.target_load_qps and not self.find_qps_at_slo:
            raise _invalid("target_load_qps", "hosts for a load come from qps_at_slo: add find_qps_at_slo=true")

    def model_args(self) -> ModelArgs:
        overrides = {"max_seq_len": self.max_seq_len, "vocab_size": self.vocab_size}
        return dataclasses.replace(PRESETS[self.preset], **{k: v for k, v in overrides.items() if v is not None})

    def lengths(self) -> LengthDistribution:
        return LengthDistribution(self.prompt_mean, self.prompt_sigma, self.prompt_min, self.prompt_max,
                                  self.output_min, self.output_max)


__all__ = ["DTYPES", "LlamaInferConfig"]
