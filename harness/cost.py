"""What serving costs on a platform: a declared cost model (data in ``conf/platform/*.yaml``) and the
figures it gives from a run's measured throughput.

One host costs ``capex_usd / (amortisation_years * 8766 h)`` plus ``power_w / 1000 * price_per_kwh_usd``
per hour (8766: hours in an average year). A run that reports ``tokens_per_s`` (a serving workload,
e.g. llama_infer: at ``qps_at_slo`` when it searched the capacity) then costs
``host_usd_per_hour / (tokens_per_s * 3600) * 1e6`` per million tokens; with ``hosts_for_target_load``
the fleet for that load costs that many hosts per hour. Nothing here is a constant of the code: an
undeclared cost model (capex and power both 0) gives no cost figures at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

HOURS_PER_YEAR = 8766.0  # 365.25 days


@dataclass
class PlatformCost:
    """One host's cost, declared per platform (``platform.cost``); all zeros: unknown."""

    capex_usd: float = 0.0  # purchase price of one host with its accelerators
    amortisation_years: float = 4.0  # straight-line depreciation period
    power_w: float = 0.0  # average wall power of the host under load
    price_per_kwh_usd: float = 0.0
    source: str = ""  # where the figures come from (quote, data sheet, assumption)

    def __post_init__(self) -> None:
        for key in ("capex_usd", "power_w", "price_per_kwh_usd"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"invalid config 'platform.cost.{key}': got {value}, must be >= 0")
        if not (math.isfinite(self.amortisation_years) and self.amortisation_years > 0):
            raise ValueError(f"invalid config 'platform.cost.amortisation_years': got {self.amortisation_years}, "
                             "must be > 0")

    @property
    def declared(self) -> bool:
        return self.capex_usd > 0 or self.power_w > 0

    def usd_per_hour(self) -> float:
        capex = self.capex_usd / (self.amortisation_years * HOURS_PER_YEAR)
        return capex + self.power_w / 1000 * self.price_per_kwh_usd


def serving_cost_metrics(cost: PlatformCost, metrics: dict[str, float]) -> dict[str, float]:
    """``host_usd_per_hour``, ``cost_per_million_tokens`` and ``fleet_usd_per_hour`` from a run's
    metrics (see the module docstring); empty when the cost is undeclared or nothing was served."""
    tokens_per_s = metrics.get("tokens_per_s", 0.0)
    if not cost.declared or not tokens_per_s > 0:
        return {}
    per_hour = cost.usd_per_hour()
    figures = {"host_usd_per_hour": per_hour, "cost_per_million_tokens": per_hour / (tokens_per_s * 3600) * 1e6}
    if metrics.get("hosts_for_target_load"):
        figures["fleet_usd_per_hour"] = metrics["hosts_for_target_load"] * per_hour
    return figures


Derived = Callable[[dict[str, float]], dict[str, float]]


def with_serving_cost(derived: Derived | None, cost: PlatformCost) -> Derived | None:
    """``derived`` (a run's metrics → more metrics) plus the serving cost figures of ``cost``."""
    if not cost.declared:
        return derived

    def both(metrics: dict[str, float]) -> dict[str, float]:
        figures = derived(metrics) if derived is not None else {}
        return {**figures, **serving_cost_metrics(cost, metrics)}

    return both


__all__ = ["HOURS_PER_YEAR", "PlatformCost", "serving_cost_metrics", "with_serving_cost"]
