"""The replay's own host time per op call, measured as the capture measures the program's.

A replay that spends the program's host time between ops (:mod:`.host_time`) must not count its own
cost of calling each op twice: that cost is measured here on the replay's own generated steps, with
every gap zero, under the profiler against plain runs, and taken out of the gaps it spends.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from workloads.trace_bundle import STEP_ANNOTATION
from workloads.trace_replay.execute import StepRunner
from workloads.trace_replay.host_time import kineto_host_gaps
from workloads.trace_replay.parse import read_kineto


def measure_call_cost(runner: StepRunner, synchronize: Callable[[], None], rounds: int = 12) -> list[float]:
    """The replay's own host time per op call, one figure per measured step (seconds).

    The program's host gaps were measured from its Kineto trace as the time outside its ops, the
    profiler's cost taken out (:func:`.host_time.kineto_host_gaps`); the replay's own time outside its
    ops (the generated code: argument lists, the op binding, slot stores and releases) is measured
    here the same way on its own steps with every gap zero, so the gaps it spends are exactly the
    program's host time it does not already pay. (A fixed per-call figure from a one-argument op
    came out at a third of a real op line's cost and left the replay ~10 % slow.)

    As the capture does: ``rounds`` rounds of profiled steps then plain ones, each block after a
    pass that settles it (the profiler's buffers; the caches after it stops), each profiled step
    set against the plain steps of its own round; the median over every step of every round. (All
    profiled steps after all plain ones, the figure moved 3.7 … 8.3 µs per op between calibrations of
    one replay, a quarter of a BERT step's host time.)
    """
    steps = len(runner.plan.sequence)
    generated = [runner.generated_step(k, no_gap_time=True) for k in range(steps)]

    def run(k: int) -> None:
        with torch.no_grad():
            generated[k][0](runner.tensors.vals)

    per_op: list[float] = []
    with tempfile.TemporaryDirectory(prefix="cobench-calibrate-") as tmp:
        path = Path(tmp) / "trace.json"
        for _ in range(rounds):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for k in range(steps):  # settles the profiler
                    run(k)
                synchronize()
                for k in range(steps):
                    with torch.profiler.record_function(f"{STEP_ANNOTATION}{k}"):
                        run(k)
                    synchronize()
            for k in range(steps):  # settles plain running again
                run(k)
            plain_us: dict[int | None, float] = {}
            for k in range(steps):
                synchronize()
                started = time.perf_counter()
                run(k)
                synchronize()
                plain_us[k] = 1e6 * (time.perf_counter() - started)
            prof.export_chrome_trace(str(path))
            host_us = kineto_host_gaps(read_kineto(path), plain_us)
            per_op += [host_us[k] / max(1, len(runner.plan.sequence[k])) for k in host_us]
    return [1e-6 * v for v in per_op]
