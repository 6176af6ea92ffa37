"""The sequence recommender's model as it trains: its embedding tables on one process or sharded over the ranks.

:func:`build_model` builds the model with Adagrad fused into the tables' backward; under ``torchrun``
TorchRec's planner shards the item and action tables table-wise and ``DistributedModelParallel`` wraps
the model (no DDP: :class:`~workloads.seqrec.model.DataParallelDense` sums the dense gradients).
:func:`make_train_pipeline` picks TorchRec's train pipeline, and :func:`full_table` gathers a whole table
back from its shards for evaluation.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward

from workloads.base import RunContext, library_log_to
from workloads.seqrec.config import SeqRecShape
from workloads.seqrec.model import (
    DataParallelDense,
    DenseComputeTimer,
    NextItemHead,
    SeqRecModel,
    build_embedding_collection,
)


def build_model(shape: SeqRecShape, temperature: float, timer: DenseComputeTimer, embedding_lr: float,
                ctx: RunContext) -> tuple[nn.Module, NextItemHead]:
    """The model as trained (its tables sharded when distributed) and its dense head, the same on every rank."""
    torch.manual_seed(ctx.seed)  # the same dense initialisation on every rank
    head = NextItemHead(shape, temperature, timer).to(ctx.device)
    embedding_device = torch.device("meta") if ctx.distributed else ctx.device
    model = SeqRecModel(build_embedding_collection(shape, embedding_device), head)
    apply_optimizer_in_backward(torch.optim.Adagrad, model.embeddings.parameters(), {"lr": embedding_lr})
    if not ctx.distributed:
        return model, head
    for param in head.parameters():  # identical replicas, whatever the ranks' RNG history
        dist.broadcast(param.data, src=0, group=ctx.process_group)
    return _shard(model, ctx), head


def _shard(model: SeqRecModel, ctx: RunContext) -> nn.Module:
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
    from torchrec.distributed.types import ShardingEnv

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


def make_train_pipeline(model: nn.Module, dense: DataParallelDense, ctx: RunContext, overlap: bool) -> Any:
    """TorchRec's ``TrainPipelineSparseDist`` when distributed with ``overlap``, else ``TrainPipelineBase``."""
    from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

    if ctx.distributed and overlap:
        return TrainPipelineSparseDist(model, dense, ctx.device)
    return TrainPipelineBase(model, dense, ctx.device)


def full_table(model: nn.Module, name: str, ctx: RunContext) -> torch.Tensor:
    """A whole embedding table on every rank (gathered from its shards when sharded)."""
    if not ctx.distributed:
        return model.embeddings.embeddings[name].weight.detach()
    with warnings.catch_warnings():  # TorchRec 1.8's state_dict still hands out ShardedTensors
        warnings.simplefilter("ignore", FutureWarning)
        sharded = model.module.embeddings.state_dict()[f"embeddings.{name}.weight"]
        full = torch.empty(sharded.size(), device=ctx.device)
        sharded.gather(dst=0, out=full if ctx.rank == 0 else None)
    dist.broadcast(full, src=0, group=ctx.process_group)
    return full
