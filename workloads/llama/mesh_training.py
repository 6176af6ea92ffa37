"""Llama training on a device mesh (``workload.parallel`` with tp, pp or dp_replicate above 1).

:class:`MeshTraining` holds this rank's part of the model as :func:`workloads.llama.parallel.build` lays it
out, with its optimiser, and runs what that layout changes about a step: the loss on vocabulary-sharded
logits under tensor parallelism, the pipeline schedule's pass over the microbatches, the gradient clip
across pipeline stages, the evaluation loss that only the last stage computes, and the one warm-up step
whose collectives are timed per mesh dimension (:class:`~workloads.llama.parallel.CommMeter`). A mixture of
experts (:mod:`workloads.llama.expert_mesh`) also has its expert gradients finished after the backward, and
its balancing bias moved and its experts' load logged after each step.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from workloads.base import RunContext
from workloads.device import synchronize
from workloads.llama.config import LlamaConfig
from workloads.llama.expert_load import ExpertLoadLog
from workloads.llama.expert_mesh import data_parallel_groups, finish_grads
from workloads.llama.layout import Layout
from workloads.llama.model import ModelArgs, SkippedLayer
from workloads.llama.moe import update_expert_bias
from workloads.llama.parallel import CommMeter, build, clip_grad_norm

# the share of the measured step that each mesh dimension's collectives took, by the metric's name
COMM_SHARE_NAMES = {"tp": "tp_comm_share", "pp": "pp_bubble_share", "dp": "dp_comm_share", "ep": "ep_comm_share"}


class MeshTraining:
    """This rank's part of the model on the device mesh, its optimiser and learning-rate schedule, and its step."""

    def __init__(self, args: ModelArgs, layout: Layout, ctx: RunContext, config: LlamaConfig,
                 compute_dtype: torch.dtype, lr_factor: Callable[[int], float]) -> None:
        self.layout, self.ctx, self.config, self.compute_dtype = layout, ctx, config, compute_dtype
        # FSDP2 warns when a wrapped module returns a view (the tensor-parallel logits are one: a DTensor's local
        # shard), in case an in-place op follows; only the loss reads them
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPTransformer\) returned a view tensor")
        self.mesh_model = build(args, layout, ctx.device, ctx.seed, config.router_init_skew)
        self.model = self.mesh_model.model
        self.is_moe = args.n_routed_experts > 0
        self.expert_load = ExpertLoadLog(args, config.batch_size, config.seq_len, layout.ep > 1)
        if config.compile:  # block by block, in place: the parameter names (and checkpoints) stay the model's
            for block in self.model.layers:
                if not isinstance(block, SkippedLayer):
                    block.compile()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, betas=(config.beta1, config.beta2),
                                           eps=config.eps, weight_decay=config.weight_decay, foreach=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor)
        self.comm_measured: tuple[CommMeter, float] | None = None  # the measured step's meter and seconds
        self._a2a_seen = (0.0, 0)  # the all-to-all meter's seconds and bytes at the last step's end

    @property
    def counts_samples(self) -> bool:
        """Whether this rank reports its data-parallel slice's samples (one rank per slice does)."""
        return self.mesh_model.counts_samples

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.ctx.device.type, dtype=self.compute_dtype,
                              enabled=self.compute_dtype != torch.float32)

    def _loss_context(self) -> contextlib.AbstractContextManager:
        """Tensor parallelism computes the loss on vocabulary-sharded logits: forward and backward inside
        ``loss_parallel``."""
        if self.layout.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def _loss(self, inputs_bs: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
        if self.layout.tp == 1:
            with self._autocast():  # the output head and the loss in one pass: no logits stored
                return self.model(inputs_bs, targets_bs)
        with self._autocast():
            logits = self.model(inputs_bs)
        return self.mesh_model.loss_fn(logits, targets_bs)

    def _pipeline_loss(self, inputs_bs: torch.Tensor, targets_bs: torch.Tensor, train: bool) -> torch.Tensor:
        """One pass of the pipeline schedule over the batch's microbatches (forward and, to train, backward);
        the batch's mean loss on every stage."""
        mm = self.mesh_model
        losses: list[torch.Tensor] = []
        args = (inputs_bs,) if mm.first_stage else ()
        target = targets_bs if mm.last_stage else None
        with self._autocast(), self._loss_context():
            if train:
                mm.schedule.step(*args, target=target, losses=losses, return_outputs=False)  # only losses kept
            else:
                mm.schedule.eval(*args, target=target, losses=losses)
        loss = (torch.stack([x.detach().float() for x in losses]).mean() if mm.last_stage
                else torch.zeros((), device=self.ctx.device))
        dist.all_reduce(loss, group=mm.group("pp"))  # the last stage's, everywhere
        return loss

    def step(self, inputs_bs: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
        """One optimiser step on the batch; its mean loss."""
        if self.mesh_model.schedule is not None:
            total = self._pipeline_loss(inputs_bs, targets_bs, train=True)
        else:
            micro = self.config.grad_accum_steps
            total = torch.zeros((), device=self.ctx.device)
            for inputs, targets in zip(inputs_bs.chunk(micro), targets_bs.chunk(micro), strict=True):
                with self._loss_context():
                    loss = self._loss(inputs, targets) / micro
                    loss.backward()
                total += loss.detach()
        if self.is_moe:
            finish_grads(self.model, self.mesh_model.expert_params, self.layout.dp)
        clip_grad_norm(self.model.parameters(), self.config.grad_clip, self.mesh_model.group("pp"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.is_moe:
            self._balance_experts()
        return total

    def _balance_experts(self) -> None:
        """The aux-loss-free bias update on the loads summed over the data-parallel ranks (every rank moves the
        same bias), and the step's loads and all-to-all figures logged."""
        meter = self.mesh_model.a2a_meter
        groups = data_parallel_groups(self.mesh_model.mesh, self.layout)
        loads = update_expert_bias(self.model, self.config.moe_bias_update_coeff, groups)
        self.expert_load.record(torch.stack(loads), meter.seconds - self._a2a_seen[0],
                                meter.bytes_sent - self._a2a_seen[1])
        self._a2a_seen = (meter.seconds, meter.bytes_sent)

    def measured_step(self, inputs_bs: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
        """The last warm-up step, its collectives timed per mesh dimension (:class:`CommMeter`): never a timed
        step (the first warm-up step, with its one-time costs, is never measured either)."""
        meter = CommMeter(self.mesh_model.mesh, self.layout, self.ctx.device, self.mesh_model.expert_mesh)
        synchronize(self.ctx.device)
        start = time.perf_counter()
        with meter:
            total = self.step(inputs_bs, targets_bs)
        synchronize(self.ctx.device)
        self.comm_measured = (meter, time.perf_counter() - start)
        return total

    def eval_loss(self, inputs_bs: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor | None:
        """The batch's mean loss; None on a pipeline stage before the last (the loss is counted there only)."""
        if self.mesh_model.schedule is None:
            with self._loss_context():
                return self._loss(inputs_bs, targets_bs)
        loss = self._pipeline_loss(inputs_bs, targets_bs, train=False)
        return loss if self.mesh_model.last_stage else None

    def comm_metrics(self) -> dict[str, float]:
        """Each mesh dimension's share of the measured step and its megabytes; none if no step was measured."""
        if self.comm_measured is None:
            return {}
        meter, step_s = self.comm_measured
        metrics = {}
        for dim, seconds in meter.seconds.items():
            metrics[COMM_SHARE_NAMES[dim]] = seconds / step_s
            metrics[f"{dim}_comm_mb_per_step"] = meter.bytes.get(dim, 0) / 1e6
        return metrics
