"""MLPerf-format log files, written with ``mlperf_logging.mllog``.

One file per repetition (MLPerf's ``result_<i>.txt``). Each writer has its own ``logging.Logger``
so sweeps and suites in one process never write into each other's files. Keys and their order
follow the MLPerf training rules (see BACKGROUND.md): submission_* → cache_clear → init_start →
hyper-parameters → init_stop → run_start → block/eval events → run_stop (status).
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

from mlperf_logging.mllog import constants as C
from mlperf_logging.mllog.mllog import MLLogger

from harness.config import MLLogConfig
from workloads.base import MLPerfInfo

_CALLER = 2  # frames between mllog and the line that called this writer (mllog adds its own 2)


class MLPerfLogWriter:
    """Writes one MLPerf log file; every method maps to one MLPerf event."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._logger = logging.getLogger(f"cobench.mllog.{uuid.uuid4().hex}")
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        self._handler = logging.FileHandler(path, mode="w", encoding="utf-8")
        self._logger.addHandler(self._handler)
        # stack offset 2: a frame that always exists (deeper offsets walk off the stack at top level)
        self._mllog = MLLogger(logger=self._logger, default_stack_offset=2)
        self.run_stopped = False

    # The call site in each line's metadata (file, lineno) is the caller of these methods: one frame
    # above this class for event/start/end, two for the grouped writers below (``_CALLER``).
    def event(self, key: str, value: Any = None, metadata: dict | None = None, *, _frames: int = 0) -> None:
        self._mllog.event(key=key, value=value, metadata=metadata, stack_offset=_CALLER + _frames)

    def start(self, key: str, value: Any = None, metadata: dict | None = None) -> None:
        self._mllog.start(key=key, value=value, metadata=metadata, stack_offset=_CALLER)

    def end(self, key: str, value: Any = None, metadata: dict | None = None, *, _frames: int = 0) -> None:
        self._mllog.end(key=key, value=value, metadata=metadata, stack_offset=_CALLER + _frames)

    def submission(self, cfg: MLLogConfig, platform_name: str, benchmark: str) -> None:
        for key, value in ((C.SUBMISSION_ORG, cfg.org), (C.SUBMISSION_PLATFORM, platform_name),
                           (C.SUBMISSION_DIVISION, cfg.division), (C.SUBMISSION_STATUS, cfg.status),
                           (C.SUBMISSION_BENCHMARK, benchmark)):
            self.event(key, value, _frames=1)

    def hyperparameters(self, info: MLPerfInfo, seed: int) -> None:
        for key, value in ((C.GLOBAL_BATCH_SIZE, info.global_batch_size),
                           (C.GRADIENT_ACCUMULATION_STEPS, info.gradient_accumulation_steps), (C.SEED, seed),
                           (C.TRAIN_SAMPLES, info.train_samples), (C.EVAL_SAMPLES, info.eval_samples),
                           *info.hyperparameters.items()):
            self.event(key, value, _frames=1)

    def run_stop(self, status: str, samples_count: int) -> None:
        """Exactly one run_stop per log, whatever path ended the run."""
        if self.run_stopped:
            return
        self.run_stopped = True
        self.end(C.RUN_STOP, metadata={C.STATUS: status, C.SAMPLES_COUNT: samples_count}, _frames=1)

    def close(self) -> None:
        self._handler.flush()
        self._logger.removeHandler(self._handler)
        self._handler.close()


def read_mllog(path: Path) -> list[dict[str, Any]]:
    """Parse a log back with mlperf-logging's own parser (what MLPerf's checkers read)."""
    from mlperf_logging.compliance_checker.mlp_parser import parse_file

    loglines, errors = parse_file(str(path), ruleset="6.0.0")
    if errors:
        raise ValueError(f"{path}: {len(errors)} unparsable MLPerf log lines, first: {errors[0]}")
    return [
        {
            "key": line.key,
            "value": line.value["value"],
            "metadata": line.value["metadata"] or {},
            "time_ms": line.timestamp,
        }
        for line in loglines
    ]
