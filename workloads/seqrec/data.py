"""Synthetic user histories: heavy-tailed lengths, written by a planted preference model.

Lengths. Real histories differ in length by orders of magnitude; :class:`LengthDistribution`
draws them log-normal (``median``, ``sigma``) or Zipf (``P(L) ∝ L^-s``), between ``min_len`` and
``max_len``. Log-normal lengths above ``max_len`` are *capped* (a production system keeps the most
recent ``max_len`` interactions), so the top length carries the tail's mass; Zipf is truncated
and renormalised.

Preferences. :class:`PlantedPreferences` is the hidden process behind every history, so
next-item prediction is learnable and its ceiling is known. Items belong to topics; every item
has a few likely successors in its own topic; each user has a sparse taste over topics. After an
interaction with action ``a`` (0 = weakest, e.g. skip … strongest, e.g. like) the next item is a
successor of the last one with probability ``follow_prob · (a + 1) / num_actions``, else a fresh
item from a topic drawn from the user's taste. A model must read both the items and the actions.

Batches. A rank's share of a global batch becomes a :class:`SeqBatch`: one ``KeyedJaggedTensor``
with the histories' item ids and actions (jagged, no padding) and each history's sampled
negatives, ready for TorchRec's ``EmbeddingCollection`` and its train pipelines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

LENGTH_DISTRIBUTIONS = ("lognormal", "zipf")
FEATURES = ("item_ids", "actions", "negatives")
MIN_HISTORY = 2  # one interaction to read, one to predict


def validate_lengths(lengths: np.ndarray | Sequence[int], max_len: int) -> None:
    """Raise ValueError for histories the model cannot take (too short to predict, or too long)."""
    lengths_i = np.asarray(lengths, dtype=np.int64)
    if lengths_i.size == 0:
        raise ValueError("a batch holds no history")
    short = np.flatnonzero(lengths_i < MIN_HISTORY)
    if short.size:
        raise ValueError(
            f"history {int(short[0])} has {int(lengths_i[short[0]])} interactions: a history needs at least "
            f"{MIN_HISTORY} (one to read, one to predict); drop empty and single-item histories"
        )
    long = np.flatnonzero(lengths_i > max_len)
    if long.size:
        raise ValueError(
            f"history {int(long[0])} has {int(lengths_i[long[0]])} interactions, above workload.max_len="
            f"{max_len}: keep each user's most recent max_len interactions, or raise max_len"
        )


@dataclass(frozen=True)
class LengthDistribution:
    """History lengths between ``min_len`` and ``max_len``; see the module docstring."""

    kind: str
    max_len: int
    min_len: int = MIN_HISTORY
    median: float = 16.0  # lognormal
    sigma: float = 1.0  # lognormal
    zipf_exponent: float = 1.2  # zipf

    def pmf(self) -> np.ndarray:
        """``P(L = l)`` for ``l = 0 … max_len`` (zero below ``min_len``)."""
        lengths = np.arange(self.max_len + 1, dtype=np.float64)
        pmf = np.zeros(self.max_len + 1)
        inside = slice(self.min_len, self.max_len + 1)
        if self.kind == "zipf":
            pmf[inside] = lengths[inside] ** -self.zipf_exponent
            return pmf / pmf.sum()
        mu = math.log(self.median)

        def cdf(x: float) -> float:
            return 0.5 * (1 + math.erf((math.log(x) - mu) / (self.sigma * math.sqrt(2))))

        edges = [0.0] + [cdf(n + 0.5) for n in range(self.min_len, self.max_len)] + [1.0]
        pmf[inside] = np.diff(edges)  # everything below rounds up to min_len, above is capped
        return pmf

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.choice(self.max_len + 1, size=n, p=self.pmf()).astype(np.int64)

    def mean(self) -> float:
        return float(np.dot(np.arange(self.max_len + 1), self.pmf()))


@dataclass(frozen=True)
class Histories:
    """Histories in jagged form: ``items``/``actions`` concatenated, ``lengths`` per user."""

    lengths: np.ndarray  # [U]
    items: np.ndarray  # [Σ L]
    actions: np.ndarray  # [Σ L]
    topic_weights: np.ndarray  # [U, K]: each user's hidden taste (for the oracle)

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths)])

    def select(self, indices: np.ndarray | Sequence[int]) -> Histories:
        """The histories at ``indices``, in that order."""
        offsets = self.offsets
        idx = np.asarray(indices, dtype=np.int64)
        take = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in idx]) if idx.size else np.array([], int)
        return Histories(self.lengths[idx], self.items[take], self.actions[take], self.topic_weights[idx])

    def split_last(self) -> tuple[Histories, np.ndarray]:
        """(every history without its last interaction, the last items): the held-out targets."""
        last = self.offsets[1:] - 1
        keep = np.ones(self.items.size, dtype=bool)
        keep[last] = False
        prefix = Histories(self.lengths - 1, self.items[keep], self.actions[keep], self.topic_weights)
        return prefix, self.items[last]


class PlantedPreferences:
    """The hidden process that writes every history (module docstring)."""

    def __init__(
        self,
        num_items: int,
        num_actions: int,
        num_topics: int,
        branching: int,
        follow_prob: float,
        topic_concentration: float = 0.3,
        seed: int = 0,
    ):
        if num_items % num_topics:
            raise ValueError(f"num_items {num_items} must be a multiple of num_topics {num_topics}")
        self.items_per_topic = num_items // num_topics
        if not 1 <= branching < self.items_per_topic:
            raise ValueError(f"branching {branching} must be in [1, items per topic {self.items_per_topic})")
        self.num_items, self.num_actions, self.num_topics = num_items, num_actions, num_topics
        self.branching, self.topic_concentration = branching, topic_concentration
        rng = np.random.default_rng(seed)
        # item i is the (i // K)-th item of topic i % K; successors stay in the topic
        self.item_topic = np.arange(num_items) % num_topics
        offsets = rng.integers(1, self.items_per_topic, size=(num_items, branching))
        while True:  # distinct successors per item: redraw rows with repeats
            sorted_rows = np.sort(offsets, axis=1)
            repeated = np.flatnonzero((sorted_rows[:, 1:] == sorted_rows[:, :-1]).any(axis=1))
            if repeated.size == 0:
                break
            offsets[repeated] = rng.integers(1, self.items_per_topic, size=(repeated.size, branching))
        position = np.arange(num_items) // num_topics
        self.successors = self.item_topic[:, None] + num_topics * ((position[:, None] + offsets) % self.items_per_topic)
        self.follow_by_action = follow_prob * (np.arange(num_actions) + 1) / num_actions

    def _fresh_items(self, cumulative_taste: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        users = cumulative_taste.shape[0]
        topics = np.minimum((rng.random(users)[:, None] > cumulative_taste).sum(axis=1), self.num_topics - 1)
        return topics + self.num_topics * rng.integers(self.items_per_topic, size=users)

    def histories(self, lengths: np.ndarray, rng: np.random.Generator) -> Histories:
        """One history per entry of ``lengths``, all users advanced together one interaction at a time."""
        lengths = np.asarray(lengths, dtype=np.int64)
        users, longest = lengths.size, int(lengths.max())
        taste = rng.dirichlet(np.full(self.num_topics, self.topic_concentration), size=users)
        cumulative = np.cumsum(taste, axis=1)
        items = np.empty((users, longest), dtype=np.int64)
        actions = rng.integers(self.num_actions, size=(users, longest))
        items[:, 0] = self._fresh_items(cumulative, rng)
        for t in range(1, longest):
            follow = rng.random(users) < self.follow_by_action[actions[:, t - 1]]
            successor = self.successors[items[:, t - 1], rng.integers(self.branching, size=users)]
            items[:, t] = np.where(follow, successor, self._fresh_items(cumulative, rng))
        present = np.arange(longest)[None, :] < lengths[:, None]
        return Histories(lengths, items[present], actions[present], taste)

    def next_item_probs(self, prefixes: Histories) -> np.ndarray:
        """``P(next item | history)`` under the planted model, ``[users, num_items]``."""
        last = prefixes.offsets[1:] - 1
        last_items, last_actions = prefixes.items[last], prefixes.actions[last]
        follow = self.follow_by_action[last_actions]
        probs = (1 - follow)[:, None] * prefixes.topic_weights[:, self.item_topic] / self.items_per_topic
        rows = np.arange(last.size)[:, None]
        probs[rows, self.successors[last_items]] += follow[:, None] / self.branching
        return probs


def ranking_quality(greater: np.ndarray, ties: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Per-user hit@k and NDCG@k of a target ranked below ``greater`` items and level with ``ties``.

    ``ties`` counts the target itself; the target's position is uniform among its ties (expected
    values, so an oracle with tied scores is neither flattered nor punished).
    """
    greater = np.asarray(greater, dtype=np.float64)
    ties = np.asarray(ties, dtype=np.float64)
    hits = np.clip(k - greater, 0, ties) / ties
    positions = np.arange(k, dtype=np.float64)
    gains = 1.0 / np.log2(positions + 2)
    inside = (positions[None, :] >= greater[:, None]) & (positions[None, :] < (greater + ties)[:, None])
    ndcg = (inside * gains[None, :]).sum(axis=1) / ties
    return hits, ndcg


def oracle_quality(
    preferences: PlantedPreferences, prefixes: Histories, targets: np.ndarray, k: int = 10
) -> tuple[float, float]:
    """HR@k and NDCG@k of the planted model itself: the ceiling a learned model approaches."""
    probs = preferences.next_item_probs(prefixes)
    target_probs = probs[np.arange(targets.size), targets][:, None]
    hits, ndcg = ranking_quality((probs > target_probs).sum(axis=1), (probs == target_probs).sum(axis=1), k)
    return float(hits.mean()), float(ndcg.mean())
