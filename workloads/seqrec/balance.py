"""Per-sample cost model and the partitioners that balance a global batch across ranks.

Pure functions over numpy arrays (no torch, no torch.distributed): every rank computes the same
partition from the same global batch, and the simulator reuses them for ranks it does not have.

Cost model. The dense compute of one rank in one synchronous step is modelled as::

    t_rank = fixed + Σ_i (a·L_i² + b·L_i + c)        L_i: history length of sample i on the rank

``a`` is the attention term, ``b`` everything per token (projections, FFN, loss), ``c`` the
per-sample part (sampled negatives, bookkeeping) and ``fixed`` what a rank pays per step however
few samples it holds (launches, per-attention-bucket work). Only ``a, b, c`` decide a partition;
``fixed`` matters for bubble fractions, so the simulator keeps it. The coefficients are *fitted to
timings measured on the platform* (:func:`fit_cost_model`, on rank batches from
:func:`calibration_batches`), never assumed: non-negative least squares, judged by its R².

Partitioners (``method``):

- ``greedy``: largest-cost-first onto the least-loaded rank (LPT).
- ``greedy_swap``: LPT, then local search: moves and pairwise swaps between the most and less
  loaded ranks while they lower the maximum.
- ``karmarkar_karp``: the k-way largest differencing method, then the same local search.

:func:`partition` never returns a partition whose most loaded rank is worse than the even split's
on the same cost model (it falls back to the even split if it would be), gives every rank at
least one sample, and keeps each rank's tokens within a budget (memory) or raises
:class:`PartitionError`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

BALANCERS = ("greedy", "greedy_swap", "karmarkar_karp")
METHODS = ("even", *BALANCERS)

# A move or swap must lower the busier rank's load by this fraction of the mean rank load: far below
# timing noise, and it bounds the local search (tiny float-level gains would go on for thousands of rounds).
_MIN_GAIN = 1e-4
# The most loaded rank trades with at most this many of the least loaded ones per round.
_SWAP_PARTNERS = 8


class PartitionError(ValueError):
    """A global batch that cannot be split under the given constraints."""


class CostModelError(ValueError):
    """A cost-model fit that cannot be trusted (non-finite, non-positive or too noisy)."""


@dataclass(frozen=True)
class CostModel:
    """``t_rank = fixed + Σ (a·L² + b·L + c)``; seconds when fitted, tokens for the fallback."""

    a: float
    b: float
    c: float
    fixed: float = 0.0
    source: str = "fit"  # "fit": measured on this platform; "tokens": cost = L (fallback, no unit)
    r2: float = math.nan  # coefficient of determination of the fit on its own measurements

    @classmethod
    def tokens(cls) -> CostModel:
        """The documented fallback: a sample costs its length (no platform measurement)."""
        return cls(a=0.0, b=1.0, c=0.0, fixed=0.0, source="tokens")

    def sample_costs(self, lengths: np.ndarray | Sequence[int]) -> np.ndarray:
        lengths_f = np.asarray(lengths, dtype=np.float64)
        return self.a * lengths_f**2 + self.b * lengths_f + self.c

    def rank_times(self, lengths: np.ndarray | Sequence[int], parts: Sequence[np.ndarray]) -> np.ndarray:
        """Predicted dense compute of each rank for a partition of ``lengths``."""
        costs = self.sample_costs(lengths)
        return np.array([self.fixed + costs[part].sum() for part in parts])


# -- fitting --------------------------------------------------------------------------------------


def cost_features(lengths: np.ndarray | Sequence[int]) -> np.ndarray:
    """One design-matrix row for a rank batch: ``[Σ L², Σ L, n, 1]`` (coefficients a, b, c, fixed)."""
    lengths_f = np.asarray(lengths, dtype=np.float64)
    return np.array([np.sum(lengths_f**2), np.sum(lengths_f), float(lengths_f.size), 1.0])


def calibration_batches(
    sample_lengths: Callable[[int, np.random.Generator], np.ndarray], per_rank_batch: int, max_len: int, seed: int
) -> list[list[int]]:
    """The rank batches to time for a fit: like the ones training will see, drawn from the length
    distribution, of a quarter to twice ``per_rank_batch`` (so per-sample and fixed costs separate);
    half of them get one or two histories of ``max_len`` or ``max_len / 2`` swapped in, so the L²
    term shows.

    Uniform-length batches would be easier to read but wrong: a real rank batch spans several
    attention buckets, whose per-bucket cost a single-length batch never pays.
    """
    rng = np.random.default_rng([seed, 17])
    sizes = (max(1, per_rank_batch // 4), max(1, per_rank_batch // 2), per_rank_batch, 2 * per_rank_batch)
    batches = []
    for repeat in range(4):
        for size in sizes:
            lengths = sample_lengths(size, rng)
            if repeat % 2:
                long = rng.choice([max_len, max(2, max_len // 2)], size=min(size, 2))
                lengths[: long.size] = long
            batches.append(sorted(lengths.tolist(), reverse=True))
    return batches


def _nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ‖x·β − y‖ subject to β ≥ 0, exactly, by trying every support (4 columns: 15 subsets).

    The constrained optimum is the unconstrained fit on its own support, so the best feasible
    subset fit is the optimum. Columns are scaled to unit norm first for conditioning.
    """
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    best, best_sse = np.zeros(x.shape[1]), float(np.sum(y**2))
    for size in range(1, x.shape[1] + 1):
        for support in itertools.combinations(range(x.shape[1]), size):
            cols = list(support)
            beta_s, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
            if np.any(beta_s < 0) or not np.all(np.isfinite(beta_s)):
                continue
            sse = float(np.sum((xs[:, cols] @ beta_s - y) ** 2))
            if sse < best_sse:
                best_sse, best = sse, np.zeros(x.shape[1])
                best[cols] = beta_s
    return best / scale


def fit_cost_model(
    batches: Sequence[Sequence[int]], times_s: Sequence[float], max_len: int, min_r2: float = 0.8
) -> CostModel:
    """Fit ``fixed + Σ(a·L² + b·L + c)`` to measured dense times of rank batches (least squares, β ≥ 0).

    ``batches[k]`` holds the lengths timed together, ``times_s[k]`` their measured time. Raises
    :class:`CostModelError` when the fit is not usable: too few or non-finite measurements, no
    positive per-sample cost on ``[1, max_len]``, or an R² below ``min_r2``.
    """
    if len(batches) != len(times_s):
        raise CostModelError(f"{len(batches)} measured batches but {len(times_s)} times")
    y = np.asarray(times_s, dtype=np.float64)
    if len(batches) < 4:
        raise CostModelError(f"the cost model has 4 coefficients; {len(batches)} measurements cannot fit it")
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise CostModelError(f"measured times must be finite and positive, got {y.tolist()}")
    x = np.stack([cost_features(lengths) for lengths in batches])
    a, b, c, fixed = _nonnegative_least_squares(x, y)
    residual = y - x @ np.array([a, b, c, fixed])
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(residual**2)) / total if total > 1e-12 * float(np.sum(y**2)) else math.nan
    model = CostModel(float(a), float(b), float(c), float(fixed), source="fit", r2=r2)
    per_sample = model.sample_costs(np.arange(1, max_len + 1))
    if not np.all(np.isfinite(per_sample)) or np.any(per_sample <= 0):
        raise CostModelError(
            f"the fitted per-sample cost is not positive on lengths 1..{max_len} "
            f"(a={a:.3g}, b={b:.3g}, c={c:.3g} s): the timings did not grow with length"
        )
    if not r2 >= min_r2:
        raise CostModelError(
            f"the cost-model fit explains too little of the measured time (R² {r2:.3f} < {min_r2}): "
            f"timings are too noisy on this platform; raise workload.cost_model_repeats or lower "
            f"workload.cost_model_min_r2"
        )
    return model


# -- partitioners ---------------------------------------------------------------------------------


def even_split(num_samples: int, world_size: int) -> list[np.ndarray]:
    """What a plain distributed sampler does: contiguous, equal-count shares in batch order."""
    return [np.asarray(chunk, dtype=np.int64) for chunk in np.array_split(np.arange(num_samples), world_size)]


def greedy_partition(
    costs: np.ndarray, world_size: int, tokens: np.ndarray | None = None, token_budget: int | None = None
) -> list[np.ndarray]:
    """Largest cost first, each onto the least-loaded rank that still has room for its tokens."""
    tokens = np.ones_like(costs) if tokens is None else tokens
    order = np.argsort(-costs, kind="stable")
    heap = [(0.0, rank) for rank in range(world_size)]
    rank_tokens = np.zeros(world_size)
    parts: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        skipped = []
        while heap:
            load, rank = heapq.heappop(heap)
            if token_budget is None or rank_tokens[rank] + tokens[i] <= token_budget:
                break
            skipped.append((load, rank))
        else:
            raise PartitionError(
                f"no rank has room for a sample of {int(tokens[i])} tokens within the budget of "
                f"{token_budget} tokens per rank (largest-first packing); raise workload.max_tokens_per_rank"
            )
        parts[rank].append(int(i))
        rank_tokens[rank] += tokens[i]
        heapq.heappush(heap, (load + float(costs[i]), rank))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return [np.sort(np.asarray(part, dtype=np.int64)) for part in parts]


def karmarkar_karp_partition(costs: np.ndarray, world_size: int) -> list[np.ndarray]:
    """k-way largest differencing method (Karmarkar–Karp), ignoring any token budget.

    Each sample starts as a k-tuple of rank loads ``(c, 0, …, 0)``; the two tuples with the largest
    spread are merged largest-with-smallest until one remains. Parts are kept as binary trees of
    merged nodes (flattened once at the end), so a merge costs O(k log k), not O(samples).
    """
    n, k = len(costs), world_size
    left = np.full(2 * n, -1, dtype=np.int64)  # node ids < n are samples; larger ids join two nodes
    right = np.full(2 * n, -1, dtype=np.int64)
    next_node = n
    singleton_sums = np.zeros((n, k))
    singleton_sums[:, 0] = costs
    singleton_nodes = np.full((n, k), -1, dtype=np.int64)
    singleton_nodes[:, 0] = np.arange(n)
    heap = [(-float(costs[i]), i, singleton_sums[i], singleton_nodes[i]) for i in range(n)]
    heapq.heapify(heap)
    tiebreak = itertools.count(n)
    while len(heap) > 1:
        _, _, sums_a, nodes_a = heapq.heappop(heap)
        _, _, sums_b, nodes_b = heapq.heappop(heap)
        sums = sums_a + sums_b[::-1]
        nodes_b = nodes_b[::-1]
        nodes = np.where(nodes_a < 0, nodes_b, nodes_a)
        both = (nodes_a >= 0) & (nodes_b >= 0)
        count = int(both.sum())
        if count:
            new = np.arange(next_node, next_node + count)
            left[new], right[new] = nodes_a[both], nodes_b[both]
            nodes[both] = new
            next_node += count
        order = np.argsort(-sums, kind="stable")
        sums, nodes = sums[order], nodes[order]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), next(tiebreak), sums, nodes))
    _, _, _, nodes = heap[0]
    parts = []
    for root in nodes:
        members, stack = [], [int(root)] if root >= 0 else []
        while stack:
            node = stack.pop()
            if node < n:
                members.append(node)
            else:
                stack.extend((int(left[node]), int(right[node])))
        parts.append(np.sort(np.asarray(members, dtype=np.int64)))
    return parts


def refine_by_swaps(
    parts: Sequence[np.ndarray],
    costs: np.ndarray,
    tokens: np.ndarray | None = None,
    token_budget: int | None = None,
    max_rounds: int | None = None,
) -> list[np.ndarray]:
    """Local search: move one sample, or swap two, between the most loaded rank and another.

    Each accepted change lowers the most loaded rank's load without raising the other's above it,
    so the sum of squared loads falls strictly and the search ends. The most loaded rank tries
    the few least loaded ranks as partners, lightest first. A rank is never left empty
    and never pushed over ``token_budget``.
    """
    tokens = np.ones_like(costs) if tokens is None else tokens
    members = [list(part) for part in parts]
    loads = np.array([costs[part].sum() for part in parts], dtype=np.float64)
    rank_tokens = np.array([tokens[part].sum() for part in parts], dtype=np.float64)
    budget = math.inf if token_budget is None else token_budget
    for _ in range(max_rounds if max_rounds is not None else 4 * len(costs) + 16):
        hi = int(np.argmax(loads))
        partners = [int(lo) for lo in np.argsort(loads, kind="stable")[:_SWAP_PARTNERS] if lo != hi]
        if not any(_improve_pair(hi, lo, members, loads, rank_tokens, costs, tokens, budget) for lo in partners):
            break
    return [np.sort(np.asarray(part, dtype=np.int64)) for part in members]


def _improve_pair(
    hi: int,
    lo: int,
    members: list[list[int]],
    loads: np.ndarray,
    rank_tokens: np.ndarray,
    costs: np.ndarray,
    tokens: np.ndarray,
    budget: float,
) -> bool:
    """Apply the best move or swap from rank ``hi`` to rank ``lo``; False if none lowers ``hi``."""
    gap = loads[hi] - loads[lo]
    min_gain = _MIN_GAIN * float(loads.mean())
    if gap < 2 * min_gain:
        return False
    from_hi = np.asarray(members[hi])
    # candidates: swap (i from hi, j from lo) or move (j = -1: nothing comes back)
    to_lo = np.asarray(members[lo] + [-1])
    c_hi, c_lo = costs[from_hi][:, None], np.where(to_lo >= 0, costs[to_lo], 0.0)[None, :]
    t_hi, t_lo = tokens[from_hi][:, None], np.where(to_lo >= 0, tokens[to_lo], 0.0)[None, :]
    delta = c_hi - c_lo  # load leaving hi (and arriving at lo); the pair's maximum falls by min(δ, gap − δ)
    feasible = (delta >= min_gain) & (delta <= gap - min_gain)
    feasible &= rank_tokens[lo] + t_hi - t_lo <= budget
    feasible &= rank_tokens[hi] - t_hi + t_lo <= budget
    if len(from_hi) == 1:
        feasible[:, -1] = False  # a move would leave hi empty
    if not feasible.any():
        return False
    # the best change brings the two loads closest together
    score = np.where(feasible, np.abs(gap - 2 * delta), np.inf)
    i_idx, j_idx = np.unravel_index(int(np.argmin(score)), score.shape)
    i, j = int(from_hi[i_idx]), int(to_lo[j_idx])
    members[hi].remove(i)
    members[lo].append(i)
    if j >= 0:
        members[lo].remove(j)
        members[hi].append(j)
    moved = float(delta[i_idx, j_idx])
    loads[hi] -= moved
    loads[lo] += moved
    moved_tokens = float(t_hi[i_idx, 0] - t_lo[0, j_idx])
    rank_tokens[hi] -= moved_tokens
    rank_tokens[lo] += moved_tokens
    return True


def partition(
    lengths: np.ndarray | Sequence[int],
    cost_model: CostModel,
    world_size: int,
    method: str = "karmarkar_karp",
    token_budget: int | None = None,
) -> list[np.ndarray]:
    """Split one global batch into ``world_size`` rank shares (sample indices, sorted).

    ``even`` is the baseline and ignores ``token_budget``. A balancer's result is replaced by the
    even split when that is no worse on ``cost_model`` and within the budget. Raises
    :class:`PartitionError` when the batch cannot give every rank a sample or a balanced split
    cannot respect ``token_budget``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown partition method {method!r}; allowed values: {', '.join(METHODS)}")
    lengths_i = np.asarray(lengths, dtype=np.int64)
    if lengths_i.size < world_size:
        raise PartitionError(
            f"a global batch of {lengths_i.size} samples cannot give each of {world_size} ranks a sample; "
            f"use a batch of at least {world_size}"
        )
    even = even_split(lengths_i.size, world_size)
    if method == "even":
        return even
    if token_budget is not None and int(lengths_i.max()) > token_budget:
        raise PartitionError(
            f"a history of {int(lengths_i.max())} tokens exceeds the budget of {token_budget} tokens per rank; "
            f"raise workload.max_tokens_per_rank to at least max_len"
        )
    costs = cost_model.sample_costs(lengths_i)
    tokens = lengths_i.astype(np.float64)
    parts = None
    if method == "karmarkar_karp":
        parts = karmarkar_karp_partition(costs, world_size)
        if any(part.size == 0 for part in parts) or (
            token_budget is not None and max(tokens[part].sum() for part in parts) > token_budget
        ):
            parts = None  # an empty rank or over budget: start from the budget-aware greedy instead
    if parts is None:
        parts = greedy_partition(costs, world_size, tokens, token_budget)
    if method != "greedy":
        parts = refine_by_swaps(parts, costs, tokens, token_budget)
    even_fits = token_budget is None or max(tokens[part].sum() for part in even) <= token_budget
    if even_fits and max(costs[p].sum() for p in even) <= max(costs[p].sum() for p in parts):
        return even
    return parts


def bubble_fraction(rank_times: np.ndarray | Sequence[float]) -> float:
    """Σ_ranks (t_max − t_rank) ÷ (n · t_max): the share of rank-time spent waiting for the slowest."""
    times = np.asarray(rank_times, dtype=np.float64)
    t_max = float(times.max())
    if times.size < 2 or t_max <= 0:
        return 0.0
    return float(np.sum(t_max - times) / (times.size * t_max))
