"""What a mixture-of-experts run reports about its experts' load and their token exchange.

:class:`ExpertLoadLog` keeps, step by step, the routed copies each expert of each MoE layer received and the
seconds and bytes of this rank's all-to-alls (expert parallelism); over the timed steps it gives each layer's
busiest expert over the mean, the tokens dropped and the all-to-all figures.
"""

from __future__ import annotations

from collections import deque

import torch

from workloads.llama.model import ModelArgs

KEPT_STEPS = 4096  # the most recent steps kept


class ExpertLoadLog:
    """Per step: the routed copies per layer and expert, and the time and bytes in this rank's all-to-alls."""

    def __init__(self, args: ModelArgs, batch_size: int, seq_len: int, expert_parallel: bool) -> None:
        self.args, self.batch_size, self.seq_len, self.expert_parallel = args, batch_size, seq_len, expert_parallel
        self._loads: deque[torch.Tensor] = deque(maxlen=KEPT_STEPS)
        self._a2a_seconds: deque[float] = deque(maxlen=KEPT_STEPS)
        self._a2a_bytes: deque[int] = deque(maxlen=KEPT_STEPS)

    def record(self, loads_le: torch.Tensor, a2a_seconds: float, a2a_bytes: int) -> None:
        """One step's loads (left on the device: read once, by :meth:`metrics`) and all-to-all figures."""
        self._loads.append(loads_le)
        self._a2a_seconds.append(a2a_seconds)
        self._a2a_bytes.append(a2a_bytes)

    def metrics(self, timed_steps: int, timed_seconds: float) -> dict[str, float]:
        """Expert load over the timed steps: per MoE layer, the busiest expert's routed copies
        over the mean, taken per step and averaged over the steps (a step waits for its busiest
        expert); ``expert_load_max_over_mean`` is the worst layer. ``tokens_dropped`` counts
        routed copies that reached no expert (dropless routing: 0). All-to-all figures are this
        rank's, over the same steps."""
        steps = min(timed_steps or len(self._loads), len(self._loads))
        if not steps:
            return {}
        loads_tle = torch.stack(list(self._loads)[-steps:]).cpu()
        ratio_tl = loads_tle.amax(dim=-1) / loads_tle.mean(dim=-1)
        per_layer = ratio_tl.mean(dim=0)
        moe_ids = [i for i in range(self.args.n_layers) if self.args.is_moe_layer(i)]
        routed_per_step = self.batch_size * self.seq_len * self.args.moe_top_k * len(moe_ids)
        metrics = {f"expert_load_max_over_mean_layer{i}": float(r) for i, r in zip(moe_ids, per_layer, strict=True)}
        metrics["expert_load_max_over_mean"] = float(per_layer.max())
        metrics["tokens_dropped"] = float(steps * routed_per_step - loads_tle.sum())
        if self.expert_parallel:
            a2a_s = sum(list(self._a2a_seconds)[-steps:])
            metrics["a2a_bytes_per_step"] = sum(list(self._a2a_bytes)[-steps:]) / steps
            metrics["a2a_time_ms_per_step"] = 1e3 * a2a_s / steps
            if timed_steps:
                metrics["a2a_share"] = a2a_s / timed_seconds
        return metrics
