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

import json
import math
import shutil
import statistics
import time

import torch

from workloads.base import MLPerfInfo, QualityTarget, RunContext, StepResult, WorkloadBase, register, unsupported
from workloads.base import invalid_config as _invalid
from workloads.llama.model import build_model
from workloads.llama_infer.capacity import search_qps_at_slo
from workloads.llama_infer.config import LlamaInferConfig
from workloads.llama_infer.data import RequestSet, synthetic_requests
from workloads.llama_infer.decoder import CachedDecoder, check_servable
from workloads.llama_infer.engine import Request, ServingEngine, generate
from workloads.llama_infer.loadgen_sut import LOG_DETAIL, LOG_SUMMARY, LoadGenResult, LoadGenSUT
from workloads.llama_infer.prompts import PromptSet, load_prompts
from workloads.llama_infer.settings import RunPlan, official_limits, test_settings


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
        self.compute_dtype = getattr(torch, config.dtype)
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


__all__ = ["LlamaInferWorkload"]
