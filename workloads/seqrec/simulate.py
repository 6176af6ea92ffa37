"""Predict compute bubbles at scales the platform does not have, from the measured cost model.

Weak scaling, as data-parallel training grows: every rank keeps its per-rank batch, so ``W``
ranks draw global batches of ``W × per_rank_batch`` histories from the workload's length
distribution. For each batch the simulator partitions it twice (even split, balancer), predicts
each rank's dense time with the fitted :class:`~workloads.seqrec.balance.CostModel` and computes
the bubble fraction ``Σ (t_max − t_rank) ÷ (W · t_max)``. Communication is not modelled: the
prediction is about compute bubbles, the quantity the balancer changes.

The same prediction applied to the partitions a real run used is what the workload compares with
its measured per-rank times: :func:`measured_bubble_metrics` puts the measured bubbles (``bubble_*``)
beside the simulator's (``sim_bubble_*``) for the very same steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from workloads.seqrec.balance import CostModel, bubble_fraction, partition

LengthSampler = Callable[[int, np.random.Generator], np.ndarray]


@dataclass(frozen=True)
class ScalePrediction:
    """Predicted compute bubbles and step times at one world size (means over simulated batches)."""

    world_size: int
    bubble_even: float
    bubble_balanced: float
    step_time_even_s: float  # the slowest rank's predicted dense time
    step_time_balanced_s: float

    @property
    def bubble_reduction(self) -> float:
        """Share of the even split's bubble that balancing removes (1.0: all of it)."""
        return 1.0 - self.bubble_balanced / self.bubble_even if self.bubble_even > 0 else 0.0

    @property
    def throughput_gain(self) -> float:
        """Relative samples/s gain of balancing when the slowest rank's compute sets the pace."""
        return self.step_time_even_s / self.step_time_balanced_s - 1.0


def predict_bubble(cost_model: CostModel, lengths: np.ndarray, parts: Sequence[np.ndarray]) -> float:
    """The bubble fraction ``cost_model`` predicts for one partitioned global batch."""
    return bubble_fraction(cost_model.rank_times(lengths, parts))


def simulate_scaling(
    cost_model: CostModel,
    sample_lengths: LengthSampler,
    world_sizes: Sequence[int],
    per_rank_batch: int,
    method: str,
    batches: int = 4,
    seed: int = 0,
    token_budget: int | None = None,
) -> list[ScalePrediction]:
    """Even split vs ``method`` at each world size; ``token_budget`` is per rank, as in training."""
    if per_rank_batch < 1:
        raise ValueError(f"per_rank_batch must be >= 1, got {per_rank_batch}")
    predictions = []
    for world_size in world_sizes:
        rng = np.random.default_rng([seed, world_size])
        bubbles = {"even": [], "balanced": []}
        step_times = {"even": [], "balanced": []}
        for _ in range(batches):
            lengths = sample_lengths(world_size * per_rank_batch, rng)
            for name, how in (("even", "even"), ("balanced", method)):
                times = cost_model.rank_times(lengths, partition(lengths, cost_model, world_size, how, token_budget))
                bubbles[name].append(bubble_fraction(times))
                step_times[name].append(float(times.max()))
        predictions.append(ScalePrediction(
            world_size=world_size,
            bubble_even=float(np.mean(bubbles["even"])),
            bubble_balanced=float(np.mean(bubbles["balanced"])),
            step_time_even_s=float(np.mean(step_times["even"])),
            step_time_balanced_s=float(np.mean(step_times["balanced"])),
        ))
    return predictions


@dataclass(frozen=True)
class StepRecord:
    """One timed training step as measured on every rank, with the cost model's prediction of it."""

    split: str  # "even" or the balancer's name
    rank_times_s: np.ndarray  # measured dense compute per rank
    predicted_s: np.ndarray  # the cost model's prediction for the same partition
    wall_s: float  # the step as this rank saw it, communication included
    samples: int  # global
    tokens: int  # global


def _mean(values: list[float]) -> float:
    return float(np.mean(values))


def measured_bubble_metrics(records: Sequence[StepRecord], trained: str, compare_even: bool) -> dict[str, float]:
    """Bubble, throughput and simulator-fidelity figures over ``records`` (see the metric names).

    ``trained`` names the split the run trains on; with ``compare_even`` the records also hold
    even-split steps of the same global batches, and the even-vs-balanced figures are added.
    """
    main = [r for r in records if r.split == trained]
    if not main:
        return {}
    metrics = {
        "tokens_per_s": sum(r.tokens for r in records) / sum(r.wall_s for r in records),
        **{f"compute_time_ms_rank{rank}": 1e3 * _mean([r.rank_times_s[rank] for r in main])
           for rank in range(main[0].rank_times_s.size)},
    }
    if main[0].rank_times_s.size < 2:
        return metrics  # one rank: nothing to wait for
    measured = [bubble_fraction(r.rank_times_s) for r in main]
    metrics["bubble_fraction"] = _mean(measured)
    metrics["bubble_fraction_p50"] = float(np.median(measured))
    metrics["sim_bubble_fraction"] = _mean([bubble_fraction(r.predicted_s) for r in main])
    predicted_all = np.concatenate([r.predicted_s for r in records])
    measured_all = np.concatenate([r.rank_times_s for r in records])
    metrics["sim_rank_time_error_pct"] = 100 * float(np.mean(np.abs(predicted_all - measured_all) / measured_all))
    even = [r for r in records if r.split == "even"]
    if not (compare_even and even and trained != "even"):
        return metrics
    measured_even = [bubble_fraction(r.rank_times_s) for r in even]
    metrics["bubble_fraction_even"] = _mean(measured_even)
    metrics["bubble_fraction_even_p50"] = float(np.median(measured_even))
    metrics["sim_bubble_fraction_even"] = _mean([bubble_fraction(r.predicted_s) for r in even])
    if metrics["bubble_fraction_even"] > 0:
        metrics["bubble_reduction"] = 1 - metrics["bubble_fraction"] / metrics["bubble_fraction_even"]
    if metrics["sim_bubble_fraction_even"] > 0:
        metrics["sim_bubble_reduction"] = 1 - metrics["sim_bubble_fraction"] / metrics["sim_bubble_fraction_even"]
    rate_main = sum(r.samples for r in main) / sum(r.wall_s for r in main)
    rate_even = sum(r.samples for r in even) / sum(r.wall_s for r in even)
    metrics["samples_per_s_balanced"], metrics["samples_per_s_even"] = rate_main, rate_even
    metrics["throughput_gain"] = rate_main / rate_even - 1
    slowest_even, slowest_main = (_mean([r.rank_times_s.max() for r in rs]) for rs in (even, main))
    metrics["compute_critical_path_gain"] = slowest_even / slowest_main - 1
    return metrics


def step_log(records: Sequence[StepRecord], predictions: Sequence[ScalePrediction]) -> dict[str, Any]:
    """Per-step detail (each rank's measured and predicted time, bubbles) and the scale predictions."""
    steps = [
        {"split": r.split, "rank_compute_ms": (1e3 * r.rank_times_s).round(4).tolist(),
         "predicted_ms": (1e3 * r.predicted_s).round(4).tolist(), "bubble": bubble_fraction(r.rank_times_s),
         "predicted_bubble": bubble_fraction(r.predicted_s), "wall_ms": 1e3 * r.wall_s,
         "samples": r.samples, "tokens": r.tokens}
        for r in records
    ]
    scales = [{"world_size": p.world_size, "bubble_even": p.bubble_even, "bubble_balanced": p.bubble_balanced,
               "bubble_reduction": p.bubble_reduction, "throughput_gain": p.throughput_gain} for p in predictions]
    return {"steps": steps, "simulation": scales}
