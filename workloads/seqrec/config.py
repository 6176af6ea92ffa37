"""``workload=seqrec``'s config: the model (a preset and overrides), the batches, the balancer, the data source.

The schema of ``conf/workload/seqrec.yaml``; a bad value fails here, naming its key, before anything runs.
With ``data=synthetic`` the planted preference model writes every history (its fields are checked);
with ``data=movielens`` the ratings file at ``data_path`` does (:mod:`workloads.seqrec.movielens`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from workloads.base import invalid_config as _invalid
from workloads.seqrec.balance import BALANCERS
from workloads.seqrec.data import LENGTH_DISTRIBUTIONS, Histories, LengthDistribution, PlantedPreferences
from workloads.seqrec.movielens import MovieLensSource, load_ratings


@dataclass(frozen=True)
class SeqRecShape:
    num_items: int
    num_actions: int
    embedding_dim: int
    num_layers: int
    num_heads: int
    max_len: int
    num_negatives: int  # sampled negatives per history (shared by its positions)

    def validate(self) -> None:
        for key in ("num_items", "num_actions", "embedding_dim", "num_layers", "num_heads", "max_len", "num_negatives"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.embedding_dim % self.num_heads:
            raise ValueError(f"embedding_dim {self.embedding_dim} is not divisible by num_heads {self.num_heads}")
        if self.max_len < 2:
            raise ValueError(f"max_len must be >= 2 (one interaction to read, one to predict), got {self.max_len}")


PRESETS = {
    # CPU: a step of 32 histories in a few tens of milliseconds
    "tiny": SeqRecShape(num_items=500, num_actions=3, embedding_dim=32, num_layers=2, num_heads=2, max_len=512,
                        num_negatives=64),
    # accelerators: SASRec/HSTU-scale sequences
    "base": SeqRecShape(num_items=100_000, num_actions=3, embedding_dim=256, num_layers=4, num_heads=4, max_len=1024,
                        num_negatives=512),
}


COST_MODELS = ("fit", "tokens")
DATA_SOURCES = ("synthetic", "movielens")


@dataclass
class SeqRecConfig:
    """``workload=seqrec``. Model fields left ``None`` take the preset's value."""

    name: str = "seqrec"
    preset: str = "tiny"
    num_items: int | None = None
    num_actions: int | None = None
    embedding_dim: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    max_len: int | None = None
    num_negatives: int | None = None
    batch_size: int = 32  # global: histories per step, across all ranks
    length_distribution: str = "lognormal"
    length_median: float = 16.0  # lognormal
    length_sigma: float = 1.5  # lognormal; with the tiny preset lengths span 2 .. 512
    length_zipf_exponent: float = 1.2  # zipf
    lr: float = 3e-3  # AdamW, dense part
    embedding_lr: float = 0.5  # Adagrad, tables (fused into backward)
    weight_decay: float = 0.0
    temperature: float = 0.2  # sampled softmax over cosine similarities
    balance: bool = True  # with >1 rank: train on the balancer's partition (False: the even split)
    balancer: str = "karmarkar_karp"
    compare_even: bool = True  # with >1 rank and balance: also train each batch split evenly, to compare
    overlap: bool = True  # with >1 rank: TrainPipelineSparseDist (else TrainPipelineBase)
    max_tokens_per_rank: int | None = None  # None: ceil(batch_size / world) * max_len
    cost_model: str = "fit"
    cost_model_min_r2: float = 0.8
    cost_model_repeats: int = 3
    stats_skip_steps: int = 3  # first steps left out of bubble statistics (the harness's warm-up)
    simulate_world_sizes: list[int] = field(default_factory=lambda: [8, 16, 32, 64, 128, 256])
    simulate_batches: int = 4  # 0: no simulation
    data_seed: int = 0
    num_topics: int = 10
    data_branching: int = 4
    data_follow_prob: float = 0.9
    train_batches: int = 32
    eval_batches: int = 4
    hr_at_10_target: float | None = None
    data: str = "synthetic"  # synthetic (the planted model) | movielens (workload.data_path)
    data_path: str | None = None  # movielens: ratings.dat / ratings.csv, or the folder holding it

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise _invalid("preset", f"got {self.preset!r}, allowed values: {', '.join(PRESETS)}")
        for key in ("batch_size", "cost_model_repeats", "train_batches", "eval_batches", "num_topics",
                    "data_branching"):
            if getattr(self, key) < 1:
                raise _invalid(key, f"got {getattr(self, key)}, must be >= 1")
        for key in ("stats_skip_steps", "simulate_batches", "data_seed"):
            if getattr(self, key) < 0:
                raise _invalid(key, f"got {getattr(self, key)}, must be >= 0")
        choices = {"length_distribution": LENGTH_DISTRIBUTIONS, "balancer": BALANCERS, "cost_model": COST_MODELS,
                   "data": DATA_SOURCES}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise _invalid(key, f"got {getattr(self, key)!r}, allowed values: {', '.join(allowed)}")
        for key in ("length_median", "length_sigma", "length_zipf_exponent", "lr", "embedding_lr", "temperature"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise _invalid(key, f"got {value}, must be a positive number")
        if not 0 <= self.weight_decay < 1:
            raise _invalid("weight_decay", f"got {self.weight_decay}, must be in [0, 1)")
        if not 0 <= self.data_follow_prob <= 1:
            raise _invalid("data_follow_prob", f"got {self.data_follow_prob}, must be in [0, 1]")
        if not 0 < self.cost_model_min_r2 <= 1:
            raise _invalid("cost_model_min_r2", f"got {self.cost_model_min_r2}, must be in (0, 1]")
        if any(size < 1 for size in self.simulate_world_sizes):
            raise _invalid("simulate_world_sizes", f"got {list(self.simulate_world_sizes)}, sizes must be >= 1")
        shape = self.shape()
        try:
            shape.validate()
        except ValueError as err:
            raise ValueError(f"invalid config 'workload' (model from preset {self.preset!r}): {err}") from err
        if self.max_tokens_per_rank is not None and self.max_tokens_per_rank < shape.max_len:
            raise _invalid("max_tokens_per_rank", f"got {self.max_tokens_per_rank}: a rank must hold the longest "
                                                  f"history, so at least max_len ({shape.max_len})")
        if self.data_path is not None and self.data == "synthetic":
            raise _invalid("data_path", "is read with workload.data=movielens only; set that, or drop data_path")
        if self.data != "synthetic":  # the rest configures the planted model
            return
        if shape.num_items % self.num_topics:
            raise _invalid("num_topics", f"num_items {shape.num_items} is not a multiple of {self.num_topics}")
        if not self.data_branching < shape.num_items // self.num_topics:
            raise _invalid("data_branching", f"got {self.data_branching}, must be below the items per topic "
                                             f"({shape.num_items // self.num_topics})")
        if self.length_median > shape.max_len:
            raise _invalid("length_median", f"got {self.length_median}, must be <= max_len {shape.max_len}")

    def shape(self) -> SeqRecShape:
        keys = ("num_items", "num_actions", "embedding_dim", "num_layers", "num_heads", "max_len", "num_negatives")
        overrides = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        return replace(PRESETS[self.preset], **overrides)

    def lengths(self) -> LengthDistribution:
        return LengthDistribution(self.length_distribution, self.shape().max_len, median=self.length_median,
                                  sigma=self.length_sigma, zipf_exponent=self.length_zipf_exponent)

    def preferences(self) -> PlantedPreferences:
        shape = self.shape()
        return PlantedPreferences(shape.num_items, shape.num_actions, self.num_topics, self.data_branching,
                                  self.data_follow_prob, seed=self.data_seed)

    def global_batches(self, seed: int, count: int, stream: int,
                       preferences: PlantedPreferences | None = None) -> list[tuple[Histories, np.ndarray]]:
        """The same global batches on every rank (and in what-if prediction, which reads the lengths of the
        batches a changed configuration trains on): histories and their sampled negatives."""
        preferences = preferences or self.preferences()
        rng, lengths, shape = np.random.default_rng([seed, stream]), self.lengths(), self.shape()
        batches = []
        for _ in range(count):
            sizes = lengths.sample(self.batch_size, rng)
            histories = preferences.histories(sizes, rng)
            negatives = rng.integers(shape.num_items, size=(sizes.size, shape.num_negatives))
            batches.append((histories, negatives))
        return batches

    def train_lengths(self, seed: int, count: int | None = None) -> list[np.ndarray]:
        """The history lengths of a run's training batches (run seed ``seed``), in the order it trains them
        (the first ``count`` of them)."""
        if self.data == "movielens":  # an unbounded schedule: epochs of shuffled users
            source = MovieLensSource(load_ratings(self.data_path), self.shape().max_len)
            count = self.train_batches if count is None else count
            return [source.train_lengths[source.batch_users(seed, i, self.batch_size)] for i in range(count)]
        count = self.train_batches if count is None else min(count, self.train_batches)
        return [histories.lengths for histories, _ in self.global_batches(seed, count, stream=0)]
