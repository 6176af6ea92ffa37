"""LoadGen test settings: MLPerf's own constraints (LoadGen's bundled ``mlperf.conf``), scaled.

The latency limits are never typed in here: :func:`official_limits` reads them from the
``mlperf.conf`` compiled into LoadGen for the benchmark mirrored (``llama3_1-8b``: TTFT p99 2000 ms,
TPOT p99 100 ms; ``llama3_1-8b-interactive``: 500 / 30 ms). A model that is not the real size
declares ``latency_scale``, the factor both limits are multiplied by (the tiny CPU model: 0.2,
i.e. 400 ms and 20 ms). Run length is ours to choose (mlperf.conf asks 10 minutes and 13,368
samples of a real submission): at least ``min_queries`` queries, enough for LoadGen's early
stopping to judge the 99th percentiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlperf_loadgen as lg

from workloads.llama_infer.loadgen_sut import SCENARIOS

MLPERF_MODELS = ("llama3_1-8b", "llama3_1-8b-interactive")


@dataclass(frozen=True)
class LatencyLimits:
    """p99 limits a Server run must meet, in ms: MLPerf's, times the declared scale."""

    ttft_ms: float
    tpot_ms: float
    official_ttft_ms: float
    official_tpot_ms: float
    scale: float


def official_limits(mlperf_model: str, scale: float) -> LatencyLimits:
    """The TTFT/TPOT limits of ``mlperf_model``'s Server scenario in LoadGen's bundled mlperf.conf."""
    settings = lg.TestSettings()
    settings.FromConfig("", mlperf_model, "Server", 0)  # conf_type 0: only the bundled mlperf.conf
    if not settings.use_token_latencies:  # LoadGen knows no such model: it fell back to its defaults
        raise ValueError(f"invalid config 'workload.mlperf_model': LoadGen's mlperf.conf has no token-latency "
                         f"limits for {mlperf_model!r}; allowed values: {', '.join(MLPERF_MODELS)}")
    ttft, tpot = settings.ttft_latency / 1e6, settings.tpot_latency / 1e6
    return LatencyLimits(ttft * scale, tpot * scale, ttft, tpot, scale)


@dataclass(frozen=True)
class RunPlan:
    """What one LoadGen test is asked to do."""

    scenario: str
    min_queries: int
    min_duration_ms: int
    server_target_qps: float
    offline_expected_qps: float
    single_stream_expected_latency_ms: float
    sample_count: int


def test_settings(plan: RunPlan, mlperf_model: str, limits: LatencyLimits) -> lg.TestSettings:
    """mlperf.conf's settings for ``mlperf_model`` and ``plan.scenario``, then the run length, load and
    the scaled limits of ``limits``; performance mode (LoadGen's verdict, no accuracy log). The random
    seeds stay mlperf.conf's, so equal configs issue equal queries at equal times on every platform."""
    settings = lg.TestSettings()
    settings.FromConfig("", mlperf_model, plan.scenario, 0)
    settings.scenario = SCENARIOS[plan.scenario]
    settings.mode = lg.TestMode.PerformanceOnly
    settings.use_token_latencies = True
    settings.ttft_latency = round(limits.ttft_ms * 1e6)
    settings.tpot_latency = round(limits.tpot_ms * 1e6)
    settings.min_query_count = plan.min_queries
    settings.min_duration_ms = plan.min_duration_ms
    settings.performance_sample_count_override = plan.sample_count
    settings.server_target_qps = plan.server_target_qps
    settings.offline_expected_qps = plan.offline_expected_qps
    settings.single_stream_expected_latency_ns = round(plan.single_stream_expected_latency_ms * 1e6)
    return settings


__all__ = ["MLPERF_MODELS", "LatencyLimits", "RunPlan", "official_limits", "test_settings"]
