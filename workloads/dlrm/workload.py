"""The DLRM-DCNv2 training benchmark: config, sharding, optimiser, train/eval steps, a2a metrics.

Data (``workload.data``): the planted click model of :mod:`workloads.dlrm.data` (default), or MLPerf's
preprocessed Criteo 1TB files read by :mod:`workloads.dlrm.criteo`, checked in the constructor (a bad
file exits 2 before any run exists) and read ahead on a thread.

One process trains the plain TorchRec model (``nn.EmbeddingBag`` tables); under ``torchrun``
the tables are sharded by ``DistributedModelParallel`` following an ``EmbeddingShardingPlanner``
plan restricted to the configured sharding type, the dense part is data-parallel (DDP, inside
DMP), and the pooled embeddings cross ranks in TorchRec's own all-to-all, optionally compressed
by a codec from :mod:`workloads.dlrm.codec_registry`. (A world-size-1 DMP is not an option: TorchRec's
fused optimiser needs a default process group, which a single process does not have.)

Optimiser, as MLPerf's closed DLRM-DCNv2 rules fix it: Adagrad with a constant learning rate,
no warm-up, no decay, no weight decay, zero initial accumulator, eps 1e-8, for the dense part
(``torch.optim.Adagrad``) and the tables (``apply_optimizer_in_backward``: FBGEMM's fused exact
Adagrad when sharded, ``torch.optim.Adagrad`` applied during backward when not).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
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
    unsupported,
)
from workloads.base import invalid_config as _invalid
from workloads.data_source import Prefetcher
from workloads.device import pins_host_memory
from workloads.dlrm import a2a, codec_registry, criteo, stored_arrays  # noqa: F401
from workloads.dlrm.config import DLRMConfig
from workloads.dlrm.data import ClickBatch, SyntheticCriteo, roc_auc
from workloads.dlrm.error_bounded import codec as error_bounded_codec  # noqa: F401 - registers comm_codec=eb
from workloads.dlrm.model import build_dlrm, count_params, dense_training_flops

# auc_target null: this fraction of the way from chance (0.5) to the planted model's own AUC.
AUC_TARGET_FRACTION = 0.85


@register("dlrm", DLRMConfig)
class DLRMWorkload(WorkloadBase):
    """DLRM-DCNv2 training; tables sharded by TorchRec DMP on more than one rank."""

    throughput_unit = "samples/s"

    def __init__(self, config: DLRMConfig, ctx: RunContext):
        self.config, self.ctx = config, ctx
        self.shape = config.shape()
        if self.shape.batch_size % ctx.world_size:
            raise _invalid(
                "batch_size",
                f"{self.shape.batch_size} is not divisible by the world size {ctx.world_size}; "
                f"use a multiple of {ctx.world_size}",
            )
        self.local_batch = self.shape.batch_size // ctx.world_size
        self.source: criteo.CriteoSource | None = None
        if config.data == "criteo_1tb":  # every check of the files happens here, before any run exists
            self.source, self.shape = criteo.open_source(config, self.shape, ctx.rank, ctx.world_size)
        self._stream: Prefetcher[ClickBatch] | None = None
        problem = codec_registry.codec_problem(config.comm_codec, config.codec_options)
        if problem:
            raise _invalid("comm_codec", problem)
        problem = codec_registry.codec_unsupported(config.comm_codec, ctx.device, ctx.world_size)
        if problem:
            raise unsupported("comm_codec", problem)
        self._check_sharding()
        self.a2a_meter = a2a.PooledA2AMeter(ctx.device) if ctx.distributed else None
        self.qcomm_registry: dict[str, Any] | None = None  # the codecs the sharder got
        self.codec_block_size: int | None = None  # fitted to the sharding plan in setup (our codecs)
        self._cursor = 0
        self._previous_loss: torch.Tensor | None = None
        self._step_seconds: list[float] = []  # host time per step (CPU: the whole step), for projections
        self._device_step_seconds: list[float] = []  # the harness's device-timed steps (observe_step_times)
        self._codec_seconds: list[float] = []  # encode + decode work within each training step
        self._exchange_seconds: list[float] = []  # codecs' own size exchange (waiting, like a collective)

    def _check_sharding(self) -> None:
        cfg, ctx, shape = self.config, self.ctx, self.shape
        if cfg.sharding == "row_wise" and ctx.device.type != "cuda":
            raise unsupported(
                "sharding",
                f"row_wise needs CUDA: TorchRec shards EmbeddingBagCollections row-wise only on cuda "
                f"(its output is a reduce-scatter); on {ctx.device.type} use table_wise or column_wise",
            )
        if not ctx.distributed:
            return  # one process trains the unsharded model; sharding has no effect
        world = ctx.world_size
        if cfg.sharding == "table_wise" and shape.num_tables < world:
            raise _invalid(
                "sharding",
                f"table_wise places whole tables, and {shape.num_tables} tables leave ranks of the "
                f"{world} without one; use column_wise, or workload.num_tables >= {world}",
            )
        if cfg.sharding == "column_wise":
            shard_dim, remainder = divmod(shape.embedding_dim, world)
            if remainder or shard_dim % 4:
                raise _invalid(
                    "sharding",
                    f"column_wise splits each table into {world} column shards, whose width must be a "
                    f"multiple of 4 (FBGEMM); embedding_dim {shape.embedding_dim} gives "
                    f"{shape.embedding_dim / world:g}. Use an embedding_dim that is a multiple of {4 * world}",
                )

    # -- set-up ---------------------------------------------------------------------------------

    def setup(self) -> None:
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        cfg, shape = self.config, self.shape
        self.oracle_auc: float | None = None  # real data has no hidden model to compare with
        if self.source is None:
            self.data = SyntheticCriteo(shape.table_rows, shape.multi_hot_sizes, shape.num_dense,
                                        cfg.zipf_exponent, seed=cfg.data_seed)
            self.train_set = self._make_batches(cfg.train_batches, stream=0)
            self.eval_set = self._make_batches(cfg.eval_batches, stream=1)
            oracle_scores = torch.cat([batch.planted_logits for batch in self.eval_set])
            labels = torch.cat([batch.labels for batch in self.eval_set])
            self.oracle_auc = roc_auc(*self._gather(oracle_scores, labels))
        else:  # read ahead on a thread: a step waits only when reading falls behind
            self._stream = Prefetcher(self.source.train_batches, depth=8, name="criteo", transfer=self._to_device,
                                      prepare=self._pin)
        self.model, self.plan = self._build_model()
        dense_params = [p for _, p in in_backward_optimizer_filter(self.model.named_parameters())]
        self.optimizer = torch.optim.Adagrad(dense_params, lr=cfg.lr, eps=cfg.adagrad_eps)
        self._flops = dense_training_flops(shape, self.local_batch)

    @property
    def _to_device(self) -> Callable[[ClickBatch], ClickBatch] | None:
        """Moving a batch to an accelerator, in the step's stream; on the CPU nothing to do (KJT.to costs ~1 ms)."""
        if self.ctx.device.type == "cpu":
            return None
        non_blocking = pins_host_memory(self.ctx.device)  # from pinned memory (the prefetcher's prepare)
        return lambda batch: batch.to(self.ctx.device, non_blocking=non_blocking)

    @property
    def _pin(self) -> Callable[[ClickBatch], ClickBatch] | None:
        """Bound for an accelerator, a batch is pinned on the reading thread, so that its copy is asynchronous."""
        return ClickBatch.pin_memory if pins_host_memory(self.ctx.device) else None

    def _next_batch(self) -> tuple[ClickBatch, float]:
        """The next training batch and the seconds the step waited for it (synthetic: the pool lookup)."""
        if self._stream is not None:
            return self._stream.next()
        started = time.perf_counter()
        batch = self.train_set[self._cursor % len(self.train_set)]
        return batch, time.perf_counter() - started

    def _make_batches(self, count: int, stream: int) -> list[ClickBatch]:
        """Per-rank batches; ``stream`` 1 is held out (never seen in training)."""
        generator = torch.Generator().manual_seed(
            ((self.ctx.seed * 1_000_003 + stream) * 1009 + self.ctx.rank) % 2**63
        )
        return [self.data.batch(self.local_batch, generator).to(self.ctx.device) for _ in range(count)]

    def _build_model(self) -> tuple[nn.Module, Any]:
        ctx = self.ctx
        # Sharded, the tables stay on meta until DMP allocates each rank's own shards.
        model = build_dlrm(self.shape, ctx.device, torch.device("meta") if ctx.distributed else ctx.device)
        # Sharded, DMP's sharder reads this and fuses FBGEMM's exact Adagrad into the lookup kernel's
        # backward; unsharded, torch's Adagrad runs on each table as its gradient is ready.
        apply_optimizer_in_backward(torch.optim.Adagrad, model.sparse_arch.parameters(),
                                    {"lr": self.config.lr, "eps": self.config.adagrad_eps})
        return self._shard(model) if ctx.distributed else (model, None)

    def _shard(self, model: nn.Module) -> tuple[nn.Module, Any]:
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
        from torchrec.distributed.planner.types import HardwareConfig, KernelConfig, TopologyFactory, TrainerConfig
        from torchrec.distributed.types import ShardingEnv

        cfg, ctx, shape = self.config, self.ctx, self.shape
        # Without min_partition the planner keeps column shards >= 128 wide: one shard, i.e. table-wise.
        min_partition = shape.embedding_dim // ctx.world_size if cfg.sharding == "column_wise" else None
        constraints = {
            config.name: ParameterConstraints(
                sharding_types=[cfg.sharding], min_partition=min_partition, pooling_factors=[float(hot)],
            )
            for config, hot in zip(model.sparse_arch.embedding_bag_collection.embedding_bag_configs(),
                                   shape.multi_hot_sizes, strict=True)
        }
        hardware = None
        if ctx.device.type == "cuda":  # the planner's default HBM size is not this GPU's
            hardware = HardwareConfig(hbm_cap_bytes=torch.cuda.get_device_properties(ctx.device).total_memory)
        topology = TopologyFactory.create_topology(
            TrainerConfig(world_size=ctx.world_size), hardware_config=hardware,
            kernel_config=KernelConfig(compute_device=ctx.device.type),
        )
        # Planned without codecs: every codec is compared on the same placement, and our codecs are
        # built once, knowing the rows they will carry (their block divides every rank's width).
        # The planner's tables and the libraries' deprecation notices go to the run's folder.
        with library_log_to(ctx.work_dir / f"sharding_plan_rank{ctx.rank}.log", "torchrec.distributed.planner",
                            "torch.fx._symbolic_trace", "py.warnings"):
            planner = EmbeddingShardingPlanner(
                topology=topology, batch_size=self.local_batch, constraints=constraints, debug=False
            )
            plan = planner.collective_plan(model, [EmbeddingBagCollectionSharder()], ctx.process_group)
            self.plan = plan
            if cfg.comm_codec in codec_registry.CUSTOM_CODECS:
                self.codec_block_size = codec_registry.auto_block_size(math.gcd(*self._dim_per_rank()) or 64)
            self.qcomm_registry = codec_registry.build_qcomm_registry(
                cfg.comm_codec, ctx.device, cfg.codec_options, ctx.process_group, self.codec_block_size
            )
            sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=self.qcomm_registry)
            dmp = DistributedModelParallel(
                model, env=ShardingEnv.from_process_group(ctx.process_group), device=ctx.device, plan=plan,
                sharders=[sharder],
            )
        return dmp, plan

    # -- steps ----------------------------------------------------------------------------------

    def _logits(self, batch: ClickBatch) -> torch.Tensor:
        return self.model(batch.dense, batch.sparse).squeeze(-1)

    def step(self) -> StepResult:
        self.model.train()
        batch, waited = self._next_batch()
        codec_registry.advance_codecs(self.qcomm_registry, self._cursor, self._previous_loss)
        self._cursor += 1
        metered = self.a2a_meter.step() if self.a2a_meter is not None else contextlib.nullcontext()
        started = time.perf_counter()
        codec_before = codec_registry.codec_seconds(self.qcomm_registry)
        self.optimizer.zero_grad(set_to_none=True)
        with metered:  # forward and backward: both pooled-embedding all-to-alls
            loss = F.binary_cross_entropy_with_logits(self._logits(batch), batch.labels)
            loss.backward()  # the tables are updated here, by the fused in-backward Adagrad
        self.optimizer.step()
        self._step_seconds.append(time.perf_counter() - started)
        codec_after = codec_registry.codec_seconds(self.qcomm_registry)
        self._codec_seconds.append(codec_after[0] - codec_before[0])
        self._exchange_seconds.append(codec_after[1] - codec_before[1])
        self._previous_loss = loss.detach()
        return StepResult(samples=self.local_batch, loss=self._previous_loss, data_wait_s=waited)

    def _gather(self, *local: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's 1-D tensors, concatenated in rank order (lengths may differ by rank)."""
        if not self.ctx.distributed:
            return list(local)
        sizes = [torch.zeros(1, dtype=torch.int64, device=local[0].device) for _ in range(self.ctx.world_size)]
        dist.all_gather(sizes, torch.tensor([local[0].numel()], device=local[0].device), group=self.ctx.process_group)
        counts = [int(size) for size in sizes]
        gathered = []
        for tensor in local:
            padded = torch.zeros(max(counts), dtype=tensor.dtype, device=tensor.device)
            padded[: tensor.numel()] = tensor
            parts = [torch.empty_like(padded) for _ in range(self.ctx.world_size)]
            dist.all_gather(parts, padded, group=self.ctx.process_group)
            gathered.append(torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)]))
        return gathered

    def _eval_batches(self) -> Iterator[ClickBatch]:
        if self.source is None:
            yield from self.eval_set
            return
        with Prefetcher(self.source.val_batches, depth=8, name="criteo-eval", transfer=self._to_device,
                        prepare=self._pin) as stream:
            yield from stream

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """AUC and log loss over every rank's held-out batches (gathered, then exact)."""
        self.model.eval()
        logits, labels = [], []
        for batch in self._eval_batches():
            logits.append(self._logits(batch).float())
            labels.append(batch.labels)
        empty = torch.empty(0, device=self.ctx.device)  # a rank may hold no validation rows (fewer than ranks)
        logits, labels = self._gather(torch.cat(logits) if logits else empty, torch.cat(labels) if labels else empty)
        log_loss = F.binary_cross_entropy_with_logits(logits, labels)
        return {"auc": roc_auc(logits.cpu(), labels.cpu()), "log_loss": float(log_loss)}

    # -- what the harness reports ---------------------------------------------------------------

    def flops_per_step(self) -> float:
        return self._flops

    def target_auc(self) -> float:
        if self.config.auc_target is not None:
            return self.config.auc_target
        if self.oracle_auc is None:  # real data: the reference's published target
            return criteo.MLPERF_AUC_TARGET
        return 0.5 + AUC_TARGET_FRACTION * (self.oracle_auc - 0.5)

    def quality_target(self) -> QualityTarget:
        return QualityTarget("auc", self.target_auc(), "max")

    def mlperf_info(self) -> MLPerfInfo:
        cfg = self.config
        if self.source is not None:  # the real sets: one epoch of whole global batches, the validation rows
            samples = {"train_samples": self.source.train_samples, "eval_samples": self.source.val_rows}
        else:
            samples = {"train_samples": cfg.train_batches * self.shape.batch_size,
                       "eval_samples": cfg.eval_batches * self.shape.batch_size}
        return MLPerfInfo(
            "dlrm_dcnv2", self.shape.batch_size, **samples,
            hyperparameters={
                "opt_name": "adagrad",
                "opt_base_learning_rate": cfg.lr,
                "opt_adagrad_learning_rate_decay": 0.0,
                "opt_adagrad_initial_accumulator_value": 0.0,
                "opt_adagrad_epsilon": cfg.adagrad_eps,
                "opt_weight_decay": 0.0,
                "opt_learning_rate_warmup_steps": 0,
                "opt_learning_rate_decay_start_step": 0,
                "opt_learning_rate_decay_steps": 0,
            },
        )

    def _dim_per_rank(self) -> list[int]:
        """Pooled-embedding columns each rank computes, from the sharding plan."""
        dims = [0] * self.ctx.world_size
        for module_plan in self.plan.plan.values():
            for sharding in module_plan.values():
                for shard in sharding.sharding_spec.shards:
                    dims[shard.placement.rank()] += shard.shard_sizes[1]
        return dims

    def root_module(self) -> nn.Module:
        return self.model  # a capture names each op's module scope after it

    def sharded_stage(self) -> ShardedStage:
        """The tables: the KJT's input all-to-alls, the lookups, the pooled embeddings' all-to-all and its
        backward, FBGEMM's fused Adagrad (sharded; unsharded, torch's Adagrad in backward) — on this rank's
        training batches, in the order the steps take them."""
        model = self.model.module if self.ctx.distributed else self.model  # DMP: the model with sharded tables
        batches = itertools.cycle(self.train_set) if self.source is None else None

        def run() -> None:
            batch = next(batches) if batches is not None else self._next_batch()[0]
            model.sparse_arch(batch.sparse).sum().backward()

        return ShardedStage("sparse_arch", run)

    def extra_metrics(self) -> dict[str, float]:
        embedding_params, dense_params = count_params(self.shape)
        metrics = {
            "embedding_params": float(embedding_params),
            "dense_params": float(dense_params),
            "auc_target": self.target_auc(),
        }
        if self.oracle_auc is not None:
            metrics["auc_oracle"] = self.oracle_auc
        if self.a2a_meter is None:
            return metrics
        metrics.update(codec_registry.codec_metrics(self.qcomm_registry))
        if self.codec_block_size:
            metrics["codec_block_size"] = float(self.codec_block_size)
        measured = self.a2a_meter.summary()
        metrics.update(measured)
        if measured and self.config.sharding != "row_wise":
            fp32 = a2a.fp32_a2a_bytes_per_step(
                self._dim_per_rank(), self.ctx.rank, [self.local_batch] * self.ctx.world_size
            )
            metrics["a2a_fp32_bytes_per_step"] = float(fp32)
            metrics["a2a_compression_ratio"] = fp32 / measured["a2a_bytes_per_step"]
            codec_timed = self._codec_seconds[1:] or self._codec_seconds
            if codec_timed and sum(codec_timed) > 0:
                per_step = sum(codec_timed) / len(codec_timed)
                metrics["codec_ms_per_step"] = 1e3 * per_step
                metrics["codec_break_even_gbps"] = a2a.break_even_gbps(fp32 - measured["a2a_bytes_per_step"], per_step)
        # On an accelerator the host's clock around a step measures its launches, not its work: the projection
        # takes the harness's device-timed steps there (synchronised through device events)
        timed = (self._device_step_seconds if self.ctx.is_accelerator and self._device_step_seconds
                 else self._step_seconds[1:] or self._step_seconds)  # the first step pays one-off costs
        if measured and "a2a_wait_ms" in measured and timed:
            step_ms = 1e3 * sum(timed) / len(timed)
            exchange = self._exchange_seconds[1:] or self._exchange_seconds
            exchange_ms = 1e3 * sum(exchange) / len(exchange) if exchange else 0.0
            if exchange_ms:
                metrics["codec_exchange_ms_per_step"] = exchange_ms
            # a codec's size exchange is waiting for the slowest rank, as the all-to-all's wait is: a link
            # replaces both (the codecs' work stays as measured)
            metrics.update(a2a.projected_a2a(measured["a2a_bytes_per_step"], measured["a2a_wait_ms"] + exchange_ms,
                                             step_ms,
                                             self.config.projection_bandwidths_gbps))
        return metrics

    def observe_step_times(self, step_times_s: list[float]) -> None:
        self._device_step_seconds = list(step_times_s)

    def teardown(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
            stored_arrays.close_files()
        for name in ("model", "optimizer", "train_set", "eval_set", "data", "plan"):
            self.__dict__.pop(name, None)
