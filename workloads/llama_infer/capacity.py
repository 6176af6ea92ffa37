"""Capacity at SLO: the highest Server load (queries/s) whose LoadGen run is VALID.

A bracket-and-bisect search over whole LoadGen Server runs (each with early stopping on the TTFT
and TPOT 99th percentiles): from the first load, double while VALID or halve while INVALID until the
verdict flips, then bisect between the highest VALID and the lowest INVALID load until the bracket
is within ``tolerance`` or the probe budget is spent. Every probe is a full, separately logged
LoadGen run; the answer is a load that really ran VALID, never an interpolation. (LoadGen's own
``FindPeakPerformance`` mode does a similar search inside one call but logs only its last run.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from workloads.llama_infer.loadgen_sut import LoadGenResult


@dataclass(frozen=True)
class Probe:
    qps: float
    result: LoadGenResult

    @property
    def valid(self) -> bool:
        return self.result.valid


def search_qps_at_slo(run_server: Callable[[float], LoadGenResult], start_qps: float, max_probes: int,
                      min_qps: float, tolerance: float = 0.05) -> tuple[Probe | None, list[Probe]]:
    """The highest VALID probe (None if no load down to ``min_qps`` was VALID) and every probe, in order."""
    probes: list[Probe] = []

    def probe(qps: float) -> Probe:
        done = Probe(qps, run_server(qps))
        probes.append(done)
        return done

    first = probe(start_qps)
    best: Probe | None = first if first.valid else None
    low_invalid: float | None = None if first.valid else start_qps
    # bracket
    while len(probes) < max_probes:
        if best is not None and low_invalid is None:
            step = probe(best.qps * 2)
        elif best is None and low_invalid is not None and low_invalid / 2 >= min_qps:
            step = probe(low_invalid / 2)
        else:
            break
        if step.valid:
            best = step
        else:
            low_invalid = step.qps
    # bisect
    while (len(probes) < max_probes and best is not None and low_invalid is not None
           and (low_invalid - best.qps) / best.qps > tolerance):
        step = probe((best.qps + low_invalid) / 2)
        if step.valid:
            best = step
        else:
            low_invalid = step.qps
    return best, probes


__all__ = ["Probe", "search_qps_at_slo"]
