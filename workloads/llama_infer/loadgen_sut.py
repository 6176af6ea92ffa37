"""The system under test for MLPerf LoadGen: LoadGen owns time and the verdict, the SUT only answers.

LoadGen's issue callback hands query samples to the :class:`~workloads.llama_infer.engine.ServingEngine`
(it only queues them); a serving thread runs engine iterations while there is work and answers each
query twice, as LoadGen's token-latency mode wants: ``FirstTokenComplete`` with the first token, then
``QuerySamplesComplete`` with every generated token and their count. TTFT, TPOT, the percentiles,
early stopping and VALID/INVALID are LoadGen's, read back from its ``mlperf_log_detail.txt``.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import threading
from dataclasses import dataclass
from pathlib import Path

import mlperf_loadgen as lg
import numpy as np

from workloads.llama_infer.data import RequestSet
from workloads.llama_infer.engine import Request, ServingEngine

SCENARIOS = {"Offline": lg.TestScenario.Offline, "Server": lg.TestScenario.Server,
             "SingleStream": lg.TestScenario.SingleStream}
LOG_SUMMARY, LOG_DETAIL = "mlperf_log_summary.txt", "mlperf_log_detail.txt"


@dataclass(frozen=True)
class LoadGenResult:
    """One LoadGen test's figures (from its detail log) plus the tokens this SUT completed."""

    scenario: str
    valid: bool
    samples_per_s: float
    completed_samples: int
    completed_tokens: int
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    tpot_ms_p50: float | None
    tpot_ms_p99: float | None
    latency_ms_p50: float
    latency_ms_p90: float
    latency_ms_p99: float
    log_dir: Path
    # median over the completed queries of the time the engine waited to have a query's prompt tokens on
    # the device (Request.data_wait_s); None: no query completed
    data_wait_ms_p50: float | None = None

    @property
    def tokens_per_s(self) -> float:
        """Completed tokens per second of LoadGen's measured duration (samples/s × tokens per sample)."""
        if not self.completed_samples:
            return 0.0
        return self.samples_per_s * self.completed_tokens / self.completed_samples


class LoadGenSUT:
    """Serves LoadGen's queries with ``engine`` on a thread of its own (see the module docstring)."""

    def __init__(self, engine: ServingEngine, requests: RequestSet):
        self.engine, self.requests = engine, requests
        engine.on_first_token, engine.on_finish = self._first_token, self._finished
        self.completed_samples = self.completed_tokens = 0
        self.data_waits_s: list[float] = []
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="llama-infer-sut", daemon=True)

    # -- LoadGen callbacks (LoadGen's threads) --
    def issue_queries(self, samples: list) -> None:
        for sample in samples:
            self.engine.submit(Request(sample.id, self.requests.prompts[sample.index],
                                       self.requests.max_new_tokens[sample.index]))

    def flush_queries(self) -> None:
        pass  # every query is served as soon as it arrives

    # -- engine callbacks (the serving thread) --
    def _first_token(self, request: Request) -> None:
        token = np.array(request.tokens[:1], dtype=np.int32)
        lg.FirstTokenComplete([lg.QuerySampleResponse(request.request_id, token.ctypes.data, token.nbytes)])

    def _finished(self, request: Request) -> None:
        tokens = np.array(request.tokens, dtype=np.int32)
        response = lg.QuerySampleResponse(request.request_id, tokens.ctypes.data, tokens.nbytes, len(tokens))
        lg.QuerySamplesComplete([response])
        self.completed_samples += 1
        self.completed_tokens += len(tokens)
        if request.data_wait_s is not None:
            self.data_waits_s.append(request.data_wait_s)

    def _serve(self) -> None:
        try:
            while True:
                with self.engine.work:
                    while self.engine.idle and not self._stop:
                        self.engine.work.wait()
                    if self._stop and self.engine.idle:
                        return
                self.engine.step()
        except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread by run()
            self._error = err

    def run(self, settings: lg.TestSettings, log_dir: Path) -> LoadGenResult:
        """One LoadGen test against this SUT; its logs go to ``log_dir``."""
        log_dir.mkdir(parents=True, exist_ok=True)
        log_settings = lg.LogSettings()
        log_settings.log_output.outdir = str(log_dir)
        log_settings.log_output.copy_summary_to_stdout = False
        log_settings.enable_trace = False
        sut = lg.ConstructSUT(self.issue_queries, self.flush_queries)
        n = len(self.requests)  # as MLPerf's QSL: every sample is a performance sample
        qsl = lg.ConstructQSL(n, n, lambda _: None, lambda _: None)  # the samples live in memory already
        self._thread.start()
        try:
            lg.StartTestWithLogSettings(sut, qsl, settings, log_settings)
        finally:
            with self.engine.work:
                self._stop = True
                self.engine.work.notify()
            self._thread.join()
            self.engine.on_first_token = self.engine.on_finish = None  # this SUT's test is over
            lg.DestroyQSL(qsl)
            lg.DestroySUT(sut)
        if self._error is not None:
            raise RuntimeError(f"the serving thread failed: {self._error!r}") from self._error
        result = read_detail_log(log_dir, self.completed_samples, self.completed_tokens)
        if self.data_waits_s:
            result = dataclasses.replace(result, data_wait_ms_p50=1e3 * statistics.median(self.data_waits_s))
        return result


def detail_log_entries(path: Path) -> dict[str, object]:
    """``key → value`` of every ``:::MLLOG`` line of a LoadGen detail log (the last one wins)."""
    entries: dict[str, object] = {}
    for line in path.read_text().splitlines():
        if line.startswith(":::MLLOG"):
            record = json.loads(line.removeprefix(":::MLLOG"))
            entries[record["key"]] = record["value"]
    return entries


def read_detail_log(log_dir: Path, completed_samples: int, completed_tokens: int) -> LoadGenResult:
    entries = detail_log_entries(log_dir / LOG_DETAIL)

    def ms(key: str) -> float | None:
        value = entries.get(key)
        return None if value is None else float(value) / 1e6

    scenario = str(entries["effective_scenario"])
    samples_key = "result_samples_per_second" if scenario == "Offline" else "result_completed_samples_per_sec"
    if samples_key not in entries:  # SingleStream reports latencies; its rate is queries over the run
        samples_key = "result_qps_with_loadgen_overhead"
    return LoadGenResult(
        scenario=scenario,
        valid=entries.get("result_validity") == "VALID",
        samples_per_s=float(entries.get(samples_key, 0.0)),
        completed_samples=completed_samples,
        completed_tokens=completed_tokens,
        ttft_ms_p50=ms("result_first_token_50.00_percentile_latency_ns"),
        ttft_ms_p99=ms("result_first_token_99.00_percentile_latency_ns"),
        tpot_ms_p50=ms("result_time_per_output_token_50.00_percentile_ns"),
        tpot_ms_p99=ms("result_time_per_output_token_99.00_percentile_ns"),
        latency_ms_p50=ms("result_50.00_percentile_latency_ns") or 0.0,
        latency_ms_p90=ms("result_90.00_percentile_latency_ns") or 0.0,
        latency_ms_p99=ms("result_99.00_percentile_latency_ns") or 0.0,
        log_dir=log_dir,
    )


__all__ = ["LOG_DETAIL", "LOG_SUMMARY", "SCENARIOS", "LoadGenResult", "LoadGenSUT", "read_detail_log"]
