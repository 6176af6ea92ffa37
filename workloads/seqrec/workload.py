"""The sequence-recommender benchmark: config, sharding, partitioned batches, train/eval steps, bubbles.

The global batch is the unit. Every rank draws the *same* global batches (same seed) and keeps its
own share: the even split (what a plain distributed sampler gives) or the balancer's partition on
the per-sample cost model fitted at set-up (:mod:`workloads.seqrec.balance`). No sample crosses
ranks and every rank knows every partition, so all ranks raise the same error on bad input
instead of hanging in a collective.

Training. Item and action tables live in a TorchRec ``EmbeddingCollection``: one process trains
it unsharded; under ``torchrun`` DMP shards it table-wise and updates it with FBGEMM's fused
Adagrad during backward. The dense part (:class:`~workloads.seqrec.model.NextItemHead`) is
replicated; each rank divides its loss sum by the *global* number of targets and
:class:`DataParallelDense` sums the gradients in one all-reduce, so a step's update is the same
whatever the partition. Steps run through TorchRec's ``TrainPipelineSparseDist`` when
``overlap`` is on (the next batch's input all-to-all is issued before this batch's dense compute
and awaited only when needed), else through ``TrainPipelineBase``.

Bubbles. Every step, each rank's dense compute time (``DenseComputeTimer``) rides along the
gradient all-reduce, so every rank has every rank's time without an extra collective. With
``compare_even`` each global batch is trained twice in a row, once split evenly and once balanced:
both bubble fractions and step times come from the same run, on the same data.

Evaluation: HR@10 and NDCG@10 of the held-out next item, ranked against the whole catalogue, on
histories never trained on. It reads the tables (gathered from their shards) instead of calling
the collection: ``TrainPipelineSparseDist`` has rewritten the sharded collection's forward to
consume the all-to-alls it prefetched, and detaching and re-attaching the pipeline around an
evaluation re-issues the in-flight batch's input all-to-all (a gloo size mismatch, TorchRec 1.8).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward

from workloads.base import (
    MLPerfInfo,
    QualityTarget,
    RunContext,
    ShardedStage,
    StepResult,
    WorkloadBase,
    library_log_to,
    register,
)
from workloads.base import invalid_config as _invalid
from workloads.seqrec.balance import (
    BALANCERS,
    CostModel,
    CostModelError,
    calibration_batches,
    fit_cost_model,
    partition,
)
from workloads.seqrec.data import (
    LENGTH_DISTRIBUTIONS,
    Histories,
    LengthDistribution,
    PlantedPreferences,
    SeqBatch,
    build_batch,
    oracle_quality,
    ranking_quality,
)
from workloads.seqrec.model import (
    PRESETS,
    DataParallelDense,
    DenseComputeTimer,
    NextItemHead,
    SeqRecModel,
    SeqRecShape,
    build_embedding_collection,
    dense_training_flops,
    time_dense_pass,
)
from workloads.seqrec.simulate import (
    ScalePrediction,
    StepRecord,
    measured_bubble_metrics,
    simulate_scaling,
    step_log,
)

logger = logging.getLogger(__name__)

COST_MODELS = ("fit", "tokens")
TOP_K = 10
# hr_at_10_target None: this fraction of the way from chance (k / items) to the planted model's HR@10.
HR_TARGET_FRACTION = 0.5


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
        choices = {"length_distribution": LENGTH_DISTRIBUTIONS, "balancer": BALANCERS, "cost_model": COST_MODELS}
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
        if shape.num_items % self.num_topics:
            raise _invalid("num_topics", f"num_items {shape.num_items} is not a multiple of {self.num_topics}")
        if not self.data_branching < shape.num_items // self.num_topics:
            raise _invalid("data_branching", f"got {self.data_branching}, must be below the items per topic "
                                             f"({shape.num_items // self.num_topics})")
        if self.length_median > shape.max_len:
            raise _invalid("length_median", f"got {self.length_median}, must be <= max_len {shape.max_len}")
        if self.max_tokens_per_rank is not None and self.max_tokens_per_rank < shape.max_len:
            raise _invalid("max_tokens_per_rank", f"got {self.max_tokens_per_rank}: a rank must hold the longest "
                                                  f"history, so at least max_len ({shape.max_len})")

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
        count = self.train_batches if count is None else min(count, self.train_batches)
        return [histories.lengths for histories, _ in self.global_batches(seed, count, stream=0)]


class _Holdable:
    """The rank's batches in a cycle; while ``held``, the last one handed out again and again."""

    def __init__(self, batches: list[Any]):
        self._cycle = itertools.cycle(batches)
        self._last: Any = None
        self.held = False

    def __iter__(self) -> _Holdable:
        return self

    def __next__(self) -> Any:
        if not self.held or self._last is None:
            self._last = next(self._cycle)
        return self._last


@dataclass(frozen=True)
class ScheduledBatch:
    """One entry of the run's batch schedule: a global batch and how it was split."""

    global_index: int
    split: str
    lengths: np.ndarray  # the global batch's history lengths
    parts: list[np.ndarray]
    num_targets: int


@register("seqrec", SeqRecConfig)
class SeqRecWorkload(WorkloadBase):
    """A SASRec-style next-item recommender; balanced partitions of every global batch across ranks."""

    throughput_unit = "samples/s"

    def __init__(self, config: SeqRecConfig, ctx: RunContext):
        if config.batch_size < ctx.world_size:
            raise _invalid(
                "batch_size",
                f"{config.batch_size} cannot give each of the {ctx.world_size} ranks a history; "
                f"use at least {ctx.world_size}",
            )
        self.config, self.ctx = config, ctx
        self.shape = config.shape()
        self.length_distribution = config.lengths()
        even_share = math.ceil(config.batch_size / ctx.world_size)
        self.token_budget = config.max_tokens_per_rank or even_share * self.shape.max_len  # even split's worst case
        self.balancing = config.balance and ctx.distributed
        self.comparing = self.balancing and config.compare_even
        self.records: list[StepRecord] = []
        self.scale_predictions: list[ScalePrediction] = []
        self.cost_model_error: str | None = None
        self._steps = 0

    # -- set-up ---------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg, ctx = self.config, self.ctx
        self.preferences = cfg.preferences()
        self.timer = DenseComputeTimer(ctx.device)
        self.model, self.head = self._build_model()
        dense_optimizer = torch.optim.AdamW(self.head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.dense = DataParallelDense(self.head, dense_optimizer, ctx)
        self.cost_model = self._fit_cost_model()
        self.schedule = self._make_schedule()
        self.rank_batches = [self._rank_batch(entry, i) for i, entry in enumerate(self.schedule)]
        self._make_eval_set()
        if ctx.rank == 0 and cfg.simulate_batches:
            self.scale_predictions = simulate_scaling(
                self.cost_model, self.length_distribution.sample, cfg.simulate_world_sizes,
                per_rank_batch=max(1, cfg.batch_size // ctx.world_size), method=cfg.balancer,
                batches=cfg.simulate_batches, seed=cfg.data_seed, token_budget=self.token_budget,
            )
        self.pipeline = self._make_pipeline()
        self._batch_iter = _Holdable(self.rank_batches)

    def _build_model(self) -> tuple[nn.Module, NextItemHead]:
        ctx = self.ctx
        torch.manual_seed(ctx.seed)  # the same dense initialisation on every rank
        head = NextItemHead(self.shape, self.config.temperature, self.timer).to(ctx.device)
        embedding_device = torch.device("meta") if ctx.distributed else ctx.device
        model = SeqRecModel(build_embedding_collection(self.shape, embedding_device), head)
        apply_optimizer_in_backward(torch.optim.Adagrad, model.embeddings.parameters(),
                                    {"lr": self.config.embedding_lr})
        if not ctx.distributed:
            return model, head
        for param in head.parameters():  # identical replicas, whatever the ranks' RNG history
            dist.broadcast(param.data, src=0, group=ctx.process_group)
        return self._shard(model), head

    def _shard(self, model: SeqRecModel) -> nn.Module:
        from torchrec.distributed.embedding import EmbeddingCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
        from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
        from torchrec.distributed.types import ShardingEnv

        ctx = self.ctx
        sharder = EmbeddingCollectionSharder()
        topology = TopologyFactory.create_topology(
            TrainerConfig(world_size=ctx.world_size), kernel_config=KernelConfig(compute_device=ctx.device.type)
        )
        constraints = {name: ParameterConstraints(sharding_types=["table_wise"]) for name in ("item", "action")}
        # the planner's tables and the libraries' set-up notices go to the run's folder
        with library_log_to(ctx.work_dir / f"sharding_plan_rank{ctx.rank}.log", "torchrec.distributed.planner",
                            "torch.fx._symbolic_trace", "py.warnings"):
            planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints, debug=False)
            plan = planner.collective_plan(model, [sharder], ctx.process_group)
            # No DDP: the dense gradients are summed by DataParallelDense (the loss is pre-divided globally).
            return DistributedModelParallel(
                model, env=ShardingEnv.from_process_group(ctx.process_group), device=ctx.device, plan=plan,
                sharders=[sharder], init_data_parallel=False,
            )

    def _make_pipeline(self) -> Any:
        from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

        if self.ctx.distributed and self.config.overlap:
            return TrainPipelineSparseDist(self.model, self.dense, self.ctx.device)
        return TrainPipelineBase(self.model, self.dense, self.ctx.device)

    # -- cost model -----------------------------------------------------------------------------

    def _fit_cost_model(self) -> CostModel:
        """Measure, average over ranks (so every rank fits the same model), fit; fall back to tokens."""
        cfg, ctx = self.config, self.ctx
        if cfg.cost_model == "tokens":
            return CostModel.tokens()
        local = max(1, cfg.batch_size // ctx.world_size)
        batches = calibration_batches(self.length_distribution.sample, local, self.shape.max_len, cfg.data_seed)
        time_dense_pass(self.head, batches[-1], self.shape, 1)  # first-call allocations stay out of the fit
        measured = [time_dense_pass(self.head, b, self.shape, cfg.cost_model_repeats) for b in batches]
        times = torch.tensor(measured, dtype=torch.float64)
        if ctx.distributed:
            dist.all_reduce(times, group=ctx.process_group)
            times /= ctx.world_size
        try:
            return fit_cost_model(batches, times.tolist(), self.shape.max_len, cfg.cost_model_min_r2)
        except CostModelError as err:
            self.cost_model_error = str(err)
            # the seed tells repetitions apart (repetition i runs seed + i; MLflow holds repetition 0's figures)
            logger.warning("seqrec (seed %d): cost-model fit rejected (%s); balancing on tokens instead (cost = L)",
                           self.ctx.seed, err)
            return CostModel.tokens()

    # -- data -----------------------------------------------------------------------------------

    def _global_batches(self, count: int, stream: int) -> list[tuple[Histories, np.ndarray]]:
        return self.config.global_batches(self.ctx.seed, count, stream, self.preferences)

    def _make_schedule(self) -> list[ScheduledBatch]:
        cfg, world = self.config, self.ctx.world_size
        self.train_set = self._global_batches(cfg.train_batches, stream=0)
        schedule = []
        for index, (histories, _) in enumerate(self.train_set):
            lengths = histories.lengths
            targets = int(lengths.sum()) - lengths.size
            splits = []
            if not self.balancing or self.comparing:
                splits.append(("even", partition(lengths, self.cost_model, world, "even")))
            if self.balancing:
                balanced = partition(lengths, self.cost_model, world, cfg.balancer, self.token_budget)
                splits.append((cfg.balancer, balanced))
            schedule += [ScheduledBatch(index, split, lengths, parts, targets) for split, parts in splits]
        return schedule

    def _rank_batch(self, entry: ScheduledBatch, index: int) -> SeqBatch:
        histories, negatives = self.train_set[entry.global_index]
        mine = entry.parts[self.ctx.rank]
        return build_batch(histories.select(mine), negatives[mine], entry.num_targets, entry.split, index,
                           self.shape.max_len).to(self.ctx.device)

    def _make_eval_set(self) -> None:
        """Held-out histories (stream 1): all but the last interaction in, the last item to rank."""
        held_out = self._global_batches(self.config.eval_batches, stream=1)
        histories = Histories(
            np.concatenate([h.lengths for h, _ in held_out]), np.concatenate([h.items for h, _ in held_out]),
            np.concatenate([h.actions for h, _ in held_out]), np.concatenate([h.topic_weights for h, _ in held_out]),
        )
        prefixes, targets = histories.split_last()
        self.oracle_hr, self.oracle_ndcg = oracle_quality(self.preferences, prefixes, targets, TOP_K)
        mine = np.array_split(np.arange(targets.size), self.ctx.world_size)[self.ctx.rank]
        local = prefixes.select(mine)
        device = self.ctx.device
        self.eval_items = torch.from_numpy(local.items).to(device)
        self.eval_actions = torch.from_numpy(local.actions).to(device)
        self.eval_lengths = torch.from_numpy(local.lengths).to(device)
        self.eval_targets = torch.from_numpy(targets[mine]).to(device)
        self.eval_count = int(targets.size)

    # -- steps ----------------------------------------------------------------------------------

    def hold_batch(self, hold: bool) -> None:
        """A capture's op-by-op timed steps then run the traced step's length buckets. ``TrainPipelineBase``
        (one process, or ``overlap`` off) trains the batch it took at the step before: the one handed out
        last, repeated from then on. (``TrainPipelineSparseDist`` runs a batch further ahead: its first held
        step still trains the batch before.)"""
        self._batch_iter.held = hold

    def step(self) -> StepResult:
        start = time.perf_counter()
        output = self.pipeline.progress(self._batch_iter)
        wall_s = time.perf_counter() - start
        entry = self.schedule[output.index]
        self._steps += 1
        if self._steps > self.config.stats_skip_steps:
            self.records.append(StepRecord(
                split=entry.split, rank_times_s=self.dense.rank_times_s.copy(),
                predicted_s=self.cost_model.rank_times(entry.lengths, entry.parts), wall_s=wall_s,
                samples=int(entry.lengths.size), tokens=int(entry.lengths.sum()),
            ))
        loss = self.dense.loss_sum / entry.num_targets
        return StepResult(samples=output.samples, tokens=output.tokens, loss=loss)

    def _full_table(self, name: str) -> torch.Tensor:
        """A whole embedding table on every rank (gathered from its shards when sharded)."""
        if not self.ctx.distributed:
            return self.model.embeddings.embeddings[name].weight.detach()
        with warnings.catch_warnings():  # TorchRec 1.8's state_dict still hands out ShardedTensors
            warnings.simplefilter("ignore", FutureWarning)
            sharded = self.model.module.embeddings.state_dict()[f"embeddings.{name}.weight"]
            full = torch.empty(sharded.size(), device=self.ctx.device)
            sharded.gather(dst=0, out=full if self.ctx.rank == 0 else None)
        dist.broadcast(full, src=0, group=self.ctx.process_group)
        return full

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """HR@10 and NDCG@10 over all ranks' held-out histories, against the whole catalogue."""
        items_nd, actions_ad = self._full_table("item"), self._full_table("action")
        catalogue_nd = torch.nn.functional.normalize(items_nd, dim=-1)
        self.head.eval()
        try:
            users_bd = self.head.user_vectors(items_nd[self.eval_items], actions_ad[self.eval_actions],
                                              self.eval_lengths)
        finally:
            self.head.train()
        scores_bn = users_bd @ catalogue_nd.T
        target_scores = scores_bn.gather(1, self.eval_targets[:, None])
        greater = (scores_bn > target_scores).sum(dim=1).cpu().numpy()
        hits, ndcg = ranking_quality(greater, np.ones_like(greater), TOP_K)
        totals = torch.tensor([hits.sum(), ndcg.sum()], dtype=torch.float64, device=self.ctx.device)
        if self.ctx.distributed:
            dist.all_reduce(totals, group=self.ctx.process_group)
        return {"hr_at_10": float(totals[0]) / self.eval_count, "ndcg_at_10": float(totals[1]) / self.eval_count}

    # -- what the harness reports ---------------------------------------------------------------

    def flops_per_step(self) -> float:
        """This rank's dense matmul FLOPs, averaged over the batch schedule."""
        return float(np.mean([
            dense_training_flops(self.shape, entry.lengths[entry.parts[self.ctx.rank]].tolist())
            for entry in self.schedule
        ]))

    def target_hr(self) -> float:
        if self.config.hr_at_10_target is not None:
            return self.config.hr_at_10_target
        chance = TOP_K / self.shape.num_items
        return chance + HR_TARGET_FRACTION * (self.oracle_hr - chance)

    def quality_target(self) -> QualityTarget:
        return QualityTarget("hr_at_10", self.target_hr(), "max")

    def mlperf_info(self) -> MLPerfInfo:
        cfg = self.config
        return MLPerfInfo.of_batches(
            "seqrec", cfg.batch_size, cfg.train_batches, cfg.eval_batches,
            hyperparameters={
                "opt_name": "adamw",
                "opt_base_learning_rate": cfg.lr,
                "opt_adamw_weight_decay": cfg.weight_decay,
                "max_sequence_length": self.shape.max_len,
            },
        )

    def root_module(self) -> nn.Module:
        return self.model  # a capture names each op's module scope after it

    def sharded_stage(self) -> ShardedStage:
        """The item and action tables: the KJT's input all-to-alls, the sequence lookups, the embeddings'
        all-to-all and its backward, the tables' fused Adagrad — on this rank's batches, in the schedule's
        order (the balancer's split of each global batch)."""
        model = self.model.module if self.ctx.distributed else self.model  # DMP: the model with sharded tables
        batches = itertools.cycle(self.rank_batches)

        def run() -> None:
            looked_up = model.embeddings(next(batches).features)
            looked_up = looked_up.wait() if hasattr(looked_up, "wait") else looked_up  # sharded: an awaitable
            sum(jagged.values().sum() for jagged in looked_up.values()).backward()

        return ShardedStage("embeddings", run)

    def extra_metrics(self) -> dict[str, float]:
        metrics: dict[str, float] = {
            "oracle_hr_at_10": self.oracle_hr,
            "oracle_ndcg_at_10": self.oracle_ndcg,
            "hr_at_10_target": self.target_hr(),
            "cost_model_fitted": float(self.cost_model.source == "fit"),
            "cost_model_r2": self.cost_model.r2,
        }
        scale = 1e6 if self.cost_model.source == "fit" else 1.0  # µs; the token fallback has no unit
        for coefficient in ("a", "b", "c", "fixed"):
            metrics[f"cost_model_{coefficient}_us"] = getattr(self.cost_model, coefficient) * scale
        trained = self.config.balancer if self.balancing else "even"
        shares = [e.lengths[part].sum() for e in self.schedule if e.split == trained for part in e.parts]
        metrics["max_rank_tokens"] = float(max(shares))  # memory: the busiest rank's share, within the budget
        metrics["token_budget_per_rank"] = float(self.token_budget)
        bubbles = measured_bubble_metrics(self.records, trained, self.comparing)
        if self.cost_model.source != "fit":  # predicted token counts cannot be compared with seconds
            bubbles.pop("sim_rank_time_error_pct", None)
        metrics.update(bubbles)
        for prediction in self.scale_predictions:
            world = prediction.world_size
            metrics[f"sim_bubble_even_at_{world}"] = prediction.bubble_even
            metrics[f"sim_bubble_balanced_at_{world}"] = prediction.bubble_balanced
            metrics[f"sim_bubble_reduction_at_{world}"] = prediction.bubble_reduction
            metrics[f"sim_throughput_gain_at_{world}"] = prediction.throughput_gain
        if self.ctx.rank == 0:
            self._write_step_log()
        return {k: v for k, v in metrics.items() if math.isfinite(v)}

    def _write_step_log(self) -> None:
        """Per-step detail and the fitted cost model, as a run artifact (the harness logs the folder)."""
        cost = self.cost_model
        payload = {
            "cost_model": {"a": cost.a, "b": cost.b, "c": cost.c, "fixed": cost.fixed, "source": cost.source,
                           "r2": cost.r2, "error": self.cost_model_error},
            **step_log(self.records, self.scale_predictions),
        }
        path = self.ctx.work_dir / f"seqrec_steps_seed{self.ctx.seed}.json"
        path.write_text(json.dumps(payload, indent=1))

    def teardown(self) -> None:
        for name in ("pipeline", "model", "head", "dense", "train_set", "rank_batches", "_batch_iter"):
            self.__dict__.pop(name, None)

