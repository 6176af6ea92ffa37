"""``workload=llama_infer``: our Llama served under MLPerf LoadGen (Offline, Server, SingleStream).

How an inference benchmark fits the step-based protocol: **one harness step is one whole LoadGen
test** (or, with ``find_qps_at_slo``, one capacity search: a series of Server tests). LoadGen owns the
clock inside a step (query arrivals, TTFT, TPOT, percentiles) and the verdict; the harness's step
time is only the wall time of that test. Warming up is the workload's own business and happens in
:meth:`LlamaInferWorkload.setup`, before any test: ``warmup_requests`` requests go through the
engine (every kernel and buffer size touched once), then the unloaded TTFT and TPOT are measured to
refuse an SLO no load can meet. ``conf/workload/llama_infer.yaml`` therefore sets the runner to no
warm-up steps and one step; ``runner.steps=N`` runs N tests (figures: the last; verdict: all).

LoadGen's VALID/INVALID is the run's verdict: it is the workload's quality target
(``result_valid >= 1``), so ``quality_target_reached`` and the MLPerf log's ``run_stop`` status carry
it. LoadGen's summary and detail logs are written to the run folder, whose files the harness records
as the run's artifacts.

The sample library (LoadGen's QSL) is synthetic by default (``data.py``) or the queries of a prompts
file (``workload.prompts``, ``prompts.py``), read, checked and tokenized in the constructor — a bad file
stops the command before any run exists — and held in memory, as MLPerf's QSL holds its tokenized set;
its performance sample count is the file's query count. A step's data wait (``data_wait_ms_p50``) is
the median, over the test's completed queries, of the time the engine spent getting a query's prompt
tokens onto the device once it took the query up (assembling the prefill batch and copying it): the
serving counterpart of a training step waiting for its batch. Time a query spends queued behind
other work is not data wait; LoadGen's TTFT counts it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import statistics
import time
from dataclasses import dataclass

import torch

from workloads.base import MLPerfInfo, QualityTarget, RunContext, StepResult, WorkloadBase, register, unsupported
from workloads.base import invalid_config as _invalid
from workloads.llama.model import PRESETS, ModelArgs, build_model
from workloads.llama_infer.capacity import search_qps_at_slo
from workloads.llama_infer.data import LengthDistribution, RequestSet, synthetic_requests
from workloads.llama_infer.decoder import CachedDecoder, check_servable
from workloads.llama_infer.engine import Request, ServingEngine, generate
from workloads.llama_infer.loadgen_sut import LOG_DETAIL, LOG_SUMMARY, SCENARIOS, LoadGenResult, LoadGenSUT
from workloads.llama_infer.prompts import PromptSet, load_prompts
from workloads.llama_infer.settings import MLPERF_MODELS, RunPlan, official_limits, test_settings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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


@register("llama_infer", LlamaInferConfig)
class LlamaInferWorkload(WorkloadBase):
    """Llama with a KV cache and continuous batching, driven by MLPerf LoadGen."""

    throughput_unit = "tokens/s"

    def __init__(self, config: LlamaInferConfig, ctx: RunContext):
        if ctx.distributed:
            raise unsupported("scenario", "one process serves the model; run it without torchrun")
        self.config, self.ctx = config, ctx
        self.args = config.model_args()
        try:
            self.args.validate()
            check_servable(self.args)
        except ValueError as err:
            raise _invalid("preset", str(err)) from err
        # the sample library: a prompts file is read, checked and tokenized here, so a bad file stops the
        # command before any run exists; synthetic requests are drawn in setup
        self.prompt_set: PromptSet | None = None
        if config.prompts is not None:
            if not 1 <= config.output_max < self.args.max_seq_len:
                raise _invalid("output_max", f"got {config.output_max}: the new-token budget of a prompt that gives "
                               f"none must be >= 1 and below the context of {self.args.max_seq_len} tokens")
            self.prompt_set = load_prompts(config.prompts, config.tokenizer, self.args.vocab_size,
                                           self.args.max_seq_len, config.output_max, config.truncate_prompts)
        else:
            config.lengths().validate(self.args.max_seq_len)
        if config.eos_token_id is not None and not 0 <= config.eos_token_id < self.args.vocab_size:
            raise _invalid("eos_token_id", f"got {config.eos_token_id}, must be a token id below the vocabulary "
                           f"size {self.args.vocab_size} (or null)")
        self.limits = official_limits(config.mlperf_model, config.latency_scale)
        self.compute_dtype = DTYPES[config.dtype]
        self.results: list[LoadGenResult] = []
        self.qps_at_slo: float | None = None
        self.server_qps: float | None = None

    # -- set-up: model, engine, data, warm-up, feasibility --
    def setup(self) -> None:
        cfg = self.config
        self._threads_before = torch.get_num_threads()
        if cfg.num_threads:  # a small model's decode step is too short to share among threads
            torch.set_num_threads(cfg.num_threads)
        model = build_model(self.args, self.ctx.device, self.ctx.seed).to(self.compute_dtype)
        self.model = model
        if self.prompt_set is None:
            self.requests = synthetic_requests(cfg.samples, cfg.lengths(), self.args.vocab_size, cfg.data_seed)
            warm = synthetic_requests(cfg.warmup_requests, cfg.lengths(), self.args.vocab_size, cfg.data_seed + 1)
            self.longest_prompt, self.largest_budget = cfg.prompt_max, cfg.output_max  # the distribution's bounds
        else:
            self.requests = self.prompt_set.requests
            picks = [i % len(self.requests) for i in range(cfg.warmup_requests)]  # the file's own shapes
            warm = RequestSet([self.requests.prompts[i] for i in picks],
                              [self.requests.max_new_tokens[i] for i in picks])
            self.longest_prompt, self.largest_budget = self.requests.longest_prompt, self.requests.largest_budget
        # the cache holds the longest prompt with the largest budget (from different queries, maybe)
        cache_len = min(self.longest_prompt + self.largest_budget, self.args.max_seq_len)
        self.engine = ServingEngine(CachedDecoder(model), cfg.max_batch, cache_len, cfg.eos_token_id)
        for prompt, budget in zip(warm.prompts, warm.max_new_tokens, strict=True):
            self.engine.submit(Request(-1, prompt, budget))
        while not self.engine.idle:
            self.engine.step()
        self.unloaded_ttft_ms, self.unloaded_tpot_ms = self._unloaded_latencies()
        self._check_slo_reachable()

    def _unloaded_latencies(self) -> tuple[float, float]:
        """Median time (ms) to the first token of one longest prompt, and per further token, alone."""
        prompt = [1] * self.longest_prompt
        new_tokens = min(self.largest_budget, self.engine.max_len - self.longest_prompt + 1)
        first_token_s, per_token_s = [], []
        for _ in range(3):
            start = time.perf_counter()
            generate(self.engine, [prompt], 1)
            first_token_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            generate(self.engine, [prompt], new_tokens)
            per_token_s.append((time.perf_counter() - start - first_token_s[-1]) / max(new_tokens - 1, 1))
        return 1e3 * statistics.median(first_token_s), 1e3 * statistics.median(per_token_s)

    def _check_slo_reachable(self) -> None:
        """An SLO that even one request alone cannot meet fails here, before LoadGen starts."""
        if self.config.scenario == "Offline":
            return  # Offline has no latency limit
        limits, problems = self.limits, []
        if self.unloaded_ttft_ms > limits.ttft_ms:
            problems.append(f"TTFT limit {limits.ttft_ms:.3g} ms < {self.unloaded_ttft_ms:.3g} ms to the first token "
                            f"of one {self.longest_prompt}-token prompt alone")
        if self.unloaded_tpot_ms > limits.tpot_ms:
            problems.append(f"TPOT limit {limits.tpot_ms:.3g} ms < {self.unloaded_tpot_ms:.3g} ms per token of one "
                            "request alone")
        if problems:
            need = max(self.unloaded_ttft_ms / limits.official_ttft_ms, self.unloaded_tpot_ms / limits.official_tpot_ms)
            raise ValueError(
                f"the SLO cannot be met at any load on this platform: {'; '.join(problems)} "
                f"({self.config.mlperf_model} limits x latency_scale {limits.scale:g}). Raise workload.latency_scale "
                f"to at least {1.5 * need:.3g}, pick a smaller model or shorter prompts ("
                + ("a prompts file of shorter prompts" if self.prompt_set else "workload.prompt_max") + ")")

    # -- one step: one LoadGen test (or one capacity search) --
    def _plan(self, scenario: str, server_qps: float) -> RunPlan:
        cfg = self.config
        return RunPlan(scenario, cfg.min_queries, cfg.min_duration_ms, server_qps, cfg.offline_expected_qps,
                       cfg.single_stream_expected_latency_ms, len(self.requests))

    def _run_test(self, plan: RunPlan, label: str) -> LoadGenResult:
        settings = test_settings(plan, self.config.mlperf_model, self.limits)
        return LoadGenSUT(self.engine, self.requests).run(settings, self.ctx.work_dir / "loadgen" / label)

    def step(self) -> StepResult:
        cfg, n = self.config, len(self.results)
        if cfg.find_qps_at_slo:
            result = self._search_capacity(f"step{n}")
        else:
            self.server_qps = cfg.server_target_qps if cfg.scenario == "Server" else None
            result = self._run_test(self._plan(cfg.scenario, cfg.server_target_qps), f"step{n}_{cfg.scenario}")
        for name in (LOG_SUMMARY, LOG_DETAIL):  # files in the run folder become the run's artifacts
            shutil.copyfile(result.log_dir / name, self.ctx.work_dir / name)
        self.results.append(result)
        wait_s = None if result.data_wait_ms_p50 is None else result.data_wait_ms_p50 / 1e3
        return StepResult(samples=result.completed_samples, tokens=result.completed_tokens, data_wait_s=wait_s)

    def _search_capacity(self, label: str) -> LoadGenResult:
        cfg = self.config

        def run_server(qps: float) -> LoadGenResult:
            return self._run_test(self._plan("Server", qps), f"{label}_server_{qps:.4g}qps")

        best, probes = search_qps_at_slo(run_server, cfg.server_target_qps, cfg.max_probes, cfg.min_qps)
        table = [{"qps": p.qps, "valid": p.valid, "ttft_ms_p99": p.result.ttft_ms_p99,
                  "tpot_ms_p99": p.result.tpot_ms_p99, "tokens_per_s": p.result.tokens_per_s,
                  "log_dir": str(p.result.log_dir.relative_to(self.ctx.work_dir))} for p in probes]
        (self.ctx.work_dir / "qps_at_slo_probes.json").write_text(json.dumps(table, indent=2))
        if best is None:
            raise RuntimeError(
                f"no Server load met the SLO (TTFT p99 <= {self.limits.ttft_ms:.4g} ms, TPOT p99 <= "
                f"{self.limits.tpot_ms:.4g} ms): probes at {[round(p.qps, 3) for p in probes]} queries/s were all "
                f"INVALID (see qps_at_slo_probes.json); lower workload.server_target_qps or min_qps, or raise "
                "workload.latency_scale")
        self.qps_at_slo = self.server_qps = best.qps
        return best.result

    def teardown(self) -> None:
        if hasattr(self, "_threads_before"):
            torch.set_num_threads(self._threads_before)

    # -- results --
    def quality_target(self) -> QualityTarget:
        return QualityTarget("result_valid", 1.0, mode="max")

    def evaluate(self) -> dict[str, float]:
        return {"result_valid": float(bool(self.results) and all(r.valid for r in self.results))}

    def extra_metrics(self) -> dict[str, float]:
        if not self.results:
            return {}
        last = self.results[-1]
        metrics = {
            "tokens_per_s": last.tokens_per_s,
            "samples_per_s": last.samples_per_s,
            "completed_tokens": float(last.completed_tokens),
            "latency_ms_p50": last.latency_ms_p50,
            "latency_ms_p90": last.latency_ms_p90,
            "latency_ms_p99": last.latency_ms_p99,
            "ttft_limit_ms": self.limits.ttft_ms,
            "tpot_limit_ms": self.limits.tpot_ms,
            "unloaded_ttft_ms": self.unloaded_ttft_ms,
            "unloaded_tpot_ms": self.unloaded_tpot_ms,
            **self.evaluate(),
        }
        for key in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99"):
            value = getattr(last, key)
            if value is not None:
                metrics[key] = value
        if self.prompt_set is not None:
            metrics["prompts_truncated"] = float(self.prompt_set.truncated)
        if self.server_qps is not None:
            metrics["server_qps"] = self.server_qps
        if self.qps_at_slo is not None:
            metrics["qps_at_slo"] = self.qps_at_slo
            if self.config.target_load_qps:
                metrics["hosts_for_target_load"] = float(math.ceil(self.config.target_load_qps / self.qps_at_slo))
        return metrics

    def mlperf_info(self) -> MLPerfInfo:
        samples = self.config.samples if self.prompt_set is None else len(self.prompt_set.requests)
        return MLPerfInfo("llama3_1-8b", self.config.max_batch, samples, 0,
                          hyperparameters={"scenario": self.config.scenario})

    def run_tags(self) -> dict[str, str]:
        return {"scenario": self.config.scenario, "mlperf_model": self.config.mlperf_model}

    def root_module(self) -> torch.nn.Module | None:
        return getattr(self, "model", None)


__all__ = ["LlamaInferConfig", "LlamaInferWorkload"]
