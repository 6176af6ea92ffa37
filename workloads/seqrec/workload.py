"""The sequence-recommender benchmark: its data, model, batch schedule and cost model composed; steps, bubbles.

Data (``workload.data``). ``synthetic``: histories from the planted preference model, a fixed set of
``train_batches`` global batches built at set-up and cycled (:class:`~workloads.seqrec.feed.BatchPool`).
``movielens``: a ratings file parsed and checked when the workload is built
(:mod:`workloads.seqrec.movielens`), then epochs of shuffled users (seeded), each rank's share of every
global batch built on a background thread (:class:`~workloads.seqrec.feed.BatchStream`). Either way a
step reports how long it waited for its batch.

The global batch is the unit. Every rank draws the *same* global batches (same seed) and keeps its
own share: the even split (what a plain distributed sampler gives) or the balancer's partition on
the per-sample cost model fitted at set-up (:mod:`workloads.seqrec.balance`; the schedule:
:mod:`workloads.seqrec.schedule`). No sample crosses ranks and every rank knows every partition, so all
ranks raise the same error on bad input instead of hanging in a collective.

Training. Item and action tables live in a TorchRec ``EmbeddingCollection``: one process trains
it unsharded; under ``torchrun`` DMP shards it table-wise and updates it with FBGEMM's fused
Adagrad during backward (:mod:`workloads.seqrec.sharding`). The dense part
(:class:`~workloads.seqrec.model.NextItemHead`) is replicated; each rank divides its loss sum by the
*global* number of targets and :class:`DataParallelDense` sums the gradients in one all-reduce, so a
step's update is the same whatever the partition. Steps run through TorchRec's
``TrainPipelineSparseDist`` when ``overlap`` is on (the next batch's input all-to-all is issued
before this batch's dense compute and awaited only when needed), else through ``TrainPipelineBase``.

Bubbles. Every step, each rank's dense compute time (``DenseComputeTimer``) rides along the
gradient all-reduce, so every rank has every rank's time without an extra collective. With
``compare_even`` each global batch is trained twice in a row, once split evenly and once balanced:
both bubble fractions and step times come from the same run, on the same data.

Evaluation: HR@10 and NDCG@10 of the held-out next item, ranked against the whole catalogue: on
histories never trained on (synthetic), or every user's last item (MovieLens; ``val_``: the
second-to-last), the ranks taking disjoint users. It reads the tables (gathered from their shards)
instead of calling the collection: ``TrainPipelineSparseDist`` has rewritten the sharded collection's forward to
consume the all-to-alls it prefetched, and detaching and re-attaching the pipeline around an
evaluation re-issues the in-flight batch's input all-to-all (a gloo size mismatch, TorchRec 1.8).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from workloads.base import (
    MLPerfInfo,
    QualityTarget,
    RunContext,
    ShardedStage,
    StepResult,
    WorkloadBase,
    register,
)
from workloads.base import invalid_config as _invalid
from workloads.data_source import DataError, rank_shard
from workloads.seqrec.balance import CostModel, CostModelError, calibration_batches, fit_cost_model
from workloads.seqrec.config import SeqRecConfig
from workloads.seqrec.data import Histories, oracle_quality
from workloads.seqrec.feed import BatchPool, BatchStream, EvalSet
from workloads.seqrec.model import DataParallelDense, DenseComputeTimer, dense_training_flops, time_dense_pass
from workloads.seqrec.movielens import NUM_ACTIONS, MovieLensSource, load_ratings
from workloads.seqrec.schedule import MovieLensSchedule, RankSplit, synthetic_rank_batch, synthetic_schedule
from workloads.seqrec.sharding import build_model, full_table, make_train_pipeline
from workloads.seqrec.simulate import (
    ScalePrediction,
    StepRecord,
    measured_bubble_metrics,
    simulate_scaling,
    step_log,
)

logger = logging.getLogger(__name__)

TOP_K = 10
# hr_at_10_target None: this fraction of the way from chance (k / items) to the planted model's HR@10;
# on MovieLens this multiple of ranking by popularity's HR@10 (see target_hr)
HR_TARGET_FRACTION = 0.5
POPULARITY_MULTIPLE = 2.0


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
        self.sample_lengths = self.length_distribution.sample
        self.source: MovieLensSource | None = None
        if config.data == "movielens":  # the whole file is parsed and checked here, before any run exists
            self.source = self._open_movielens()
            self.sample_lengths = self.source.sample_lengths
        even_share = math.ceil(config.batch_size / ctx.world_size)
        self.token_budget = config.max_tokens_per_rank or even_share * self.shape.max_len  # even split's worst case
        self.balancing = config.balance and ctx.distributed
        self.comparing = self.balancing and config.compare_even
        self.records: list[StepRecord] = []
        self.scale_predictions: list[ScalePrediction] = []
        self.cost_model_error: str | None = None
        self._steps = 0

    def _open_movielens(self) -> MovieLensSource:
        cfg = self.config
        source = MovieLensSource(load_ratings(cfg.data_path), self.shape.max_len)
        items = source.ratings.num_items
        if cfg.num_items is not None and cfg.num_items < items:
            raise DataError(f"'workload.num_items' {cfg.num_items} is below the {items} items of {source.describe()}; "
                            "leave it null to take the data's")
        if cfg.num_actions is not None and cfg.num_actions < NUM_ACTIONS:
            raise DataError(f"'workload.num_actions' {cfg.num_actions}: MovieLens ratings become {NUM_ACTIONS} "
                            "actions (1-5 stars); leave it null")
        if source.num_users < cfg.batch_size:
            raise DataError(f"{source.describe()}: fewer users than workload.batch_size={cfg.batch_size}; "
                            "lower batch_size or give the whole file")
        self.shape = replace(self.shape, num_items=cfg.num_items or items, num_actions=cfg.num_actions or NUM_ACTIONS)
        self.popularity_hr, self.popularity_ndcg = source.popularity_quality(TOP_K)
        logger.info("seqrec: %s", source.describe())
        return source

    # -- set-up ---------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg, ctx = self.config, self.ctx
        self.preferences = cfg.preferences() if self.source is None else None
        self.timer = DenseComputeTimer(ctx.device)
        # the model as trained: its tables sharded over the ranks when distributed (workloads/seqrec/sharding.py)
        self.model, self.head = build_model(self.shape, cfg.temperature, self.timer, cfg.embedding_lr, ctx)
        dense_optimizer = torch.optim.AdamW(self.head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.dense = DataParallelDense(self.head, dense_optimizer, ctx)
        self.cost_model = self._fit_cost_model()
        split = RankSplit(self.cost_model, ctx.world_size, cfg.balancer if self.balancing else None, self.comparing,
                          self.token_budget)
        if self.source is None:
            self.train_set = self._global_batches(cfg.train_batches, stream=0)
            self.schedule = synthetic_schedule(self.train_set, split)
            self.rank_batches = [synthetic_rank_batch(self.train_set, entry, ctx.rank, i, self.shape.max_len,
                                                      ctx.device) for i, entry in enumerate(self.schedule)]
            self._make_eval_set()
            self._batch_iter: BatchPool | BatchStream = BatchPool(self.rank_batches)
        else:
            self.movielens = MovieLensSchedule(self.source, split, ctx.seed, ctx.rank, cfg.batch_size, self.shape)
            # the first train_batches global batches stand for the stream in FLOPs, shares and the sharded stage
            self.schedule = [e for k in range(cfg.train_batches) for e in self.movielens.plan(k)]
            self.rank_batches = []
            self._make_movielens_eval_sets()
            self._batch_iter = BatchStream(self.movielens.stream, ctx.device)
        if ctx.rank == 0 and cfg.simulate_batches:
            self.scale_predictions = simulate_scaling(
                self.cost_model, self.sample_lengths, cfg.simulate_world_sizes,
                per_rank_batch=max(1, cfg.batch_size // ctx.world_size), method=cfg.balancer,
                batches=cfg.simulate_batches, seed=cfg.data_seed, token_budget=self.token_budget,
            )
        self.pipeline = make_train_pipeline(self.model, self.dense, ctx, cfg.overlap)

    # -- cost model -----------------------------------------------------------------------------

    def _fit_cost_model(self) -> CostModel:
        """Measure, average over ranks (so every rank fits the same model), fit; fall back to tokens."""
        cfg, ctx = self.config, self.ctx
        if cfg.cost_model == "tokens":
            return CostModel.tokens()
        local = max(1, cfg.batch_size // ctx.world_size)
        batches = calibration_batches(self.sample_lengths, local, self.shape.max_len, cfg.data_seed)
        time_dense_pass(self.head, batches[-1], self.shape, 1)  # first-call allocations stay out of the fit
        measured = [time_dense_pass(self.head, b, self.shape, cfg.cost_model_repeats) for b in batches]
        times = torch.tensor(measured, dtype=torch.float64)
        if ctx.distributed:  # reduced on the run's device: nccl reduces no CPU tensors
            times = times.to(ctx.device)
            dist.all_reduce(times, group=ctx.process_group)
            times = times.cpu() / ctx.world_size
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
        self.eval_sets = {"": EvalSet.of(prefixes.select(mine), targets[mine], int(targets.size), self.ctx.device)}

    def _make_movielens_eval_sets(self) -> None:
        """Every user's test (last item, the headline ``hr_at_10``) and validation (second-to-last, ``val_``)
        targets; the ranks evaluate disjoint users."""
        users = np.asarray(rank_shard(self.source.num_users, self.ctx.rank, self.ctx.world_size), dtype=np.int64)
        self.eval_sets = {prefix: EvalSet.of(*self.source.eval_set(which, users), self.source.num_users,
                                             self.ctx.device)
                          for prefix, which in (("", "test"), ("val_", "validation"))}

    # -- steps ----------------------------------------------------------------------------------

    def hold_batch(self, hold: bool) -> None:
        """A capture's op-by-op timed steps then run the traced step's length buckets. ``TrainPipelineBase``
        (one process, or ``overlap`` off) trains the batch it took at the step before: the one handed out
        last, repeated from then on. (``TrainPipelineSparseDist`` runs a batch further ahead: its first held
        step still trains the batch before.)"""
        self._batch_iter.held = hold

    def step(self) -> StepResult:
        start = time.perf_counter()
        self._batch_iter.waited_s = 0.0
        output = self.pipeline.progress(self._batch_iter)
        wall_s = time.perf_counter() - start
        feed = self._batch_iter
        entry = feed.entry(output.index) if isinstance(feed, BatchStream) else self.schedule[output.index]
        self._steps += 1
        if self._steps > self.config.stats_skip_steps:
            self.records.append(StepRecord(
                split=entry.split, rank_times_s=self.dense.rank_times_s.copy(),
                predicted_s=self.cost_model.rank_times(entry.lengths, entry.parts), wall_s=wall_s,
                samples=int(entry.lengths.size), tokens=int(entry.lengths.sum()),
            ))
        loss = self.dense.loss_sum / entry.num_targets
        return StepResult(samples=output.samples, tokens=output.tokens, loss=loss, data_wait_s=feed.waited_s)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """HR@10 and NDCG@10 over all ranks' held-out histories, against the whole catalogue."""
        items_nd, actions_ad = full_table(self.model, "item", self.ctx), full_table(self.model, "action", self.ctx)
        catalogue_nd = torch.nn.functional.normalize(items_nd, dim=-1)

        def user_vectors(items: torch.Tensor, actions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return self.head.user_vectors(items_nd[items], actions_ad[actions], lengths)

        self.head.eval()
        try:
            sums = [s for eval_set in self.eval_sets.values() for s in eval_set.ranked_sums(user_vectors, catalogue_nd,
                                                                                             TOP_K)]
        finally:
            self.head.train()
        totals = torch.tensor(sums, dtype=torch.float64, device=self.ctx.device)
        if self.ctx.distributed:
            dist.all_reduce(totals, group=self.ctx.process_group)
        quality = {}
        for i, (prefix, eval_set) in enumerate(self.eval_sets.items()):
            quality[f"{prefix}hr_at_10"] = float(totals[2 * i]) / eval_set.count
            quality[f"{prefix}ndcg_at_10"] = float(totals[2 * i + 1]) / eval_set.count
        return quality

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
        if self.source is not None:  # beat ranking by popularity clearly: twice its HR@10, at most halfway to 1
            return min(POPULARITY_MULTIPLE * self.popularity_hr, (1 + self.popularity_hr) / 2)
        chance = TOP_K / self.shape.num_items
        return chance + HR_TARGET_FRACTION * (self.oracle_hr - chance)

    def quality_target(self) -> QualityTarget:
        return QualityTarget("hr_at_10", self.target_hr(), "max")

    def mlperf_info(self) -> MLPerfInfo:
        cfg = self.config
        if self.source is not None:  # an epoch is every user's training history; every user is evaluated
            train_samples, eval_samples = [self.source.num_users] * 2
        else:
            train_samples, eval_samples = cfg.train_batches * cfg.batch_size, cfg.eval_batches * cfg.batch_size
        return MLPerfInfo(
            "seqrec", cfg.batch_size, train_samples, eval_samples,
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
        batches = itertools.cycle(self.rank_batches or [self.movielens.rank_batch(entry, i).to(self.ctx.device)
                                                        for i, entry in enumerate(self.schedule)])

        def run() -> None:
            looked_up = model.embeddings(next(batches).features)
            looked_up = looked_up.wait() if hasattr(looked_up, "wait") else looked_up  # sharded: an awaitable
            sum(jagged.values().sum() for jagged in looked_up.values()).backward()

        return ShardedStage("embeddings", run)

    def extra_metrics(self) -> dict[str, float]:
        baseline = ("oracle", self.oracle_hr, self.oracle_ndcg) if self.source is None else (
            "popularity", self.popularity_hr, self.popularity_ndcg)
        metrics: dict[str, float] = {
            f"{baseline[0]}_hr_at_10": baseline[1],
            f"{baseline[0]}_ndcg_at_10": baseline[2],
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
        if isinstance(self.__dict__.get("_batch_iter"), BatchStream):
            self._batch_iter.close()
        for name in ("pipeline", "model", "head", "dense", "train_set", "rank_batches", "_batch_iter"):
            self.__dict__.pop(name, None)

