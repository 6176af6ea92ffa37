"""The Llama training benchmark: config, data, optimiser and the train/eval steps.

By default (``workload.data=synthetic``) training data is a planted Markov chain
(``data.MarkovTokenSource``), so the loss really falls and "eval loss ≤ target" is a meaningful,
MLPerf-style quality target; the training set is a fixed pool of pre-generated batches on the device
(cycled like epochs), so step time measures the model, not a synthetic data generator. Real text
(``workload.data=c4|megatron``, ``workloads/llama/sources.py``) is read, tokenized and packed on a
background thread; every step reports how long it waited for its batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
import warnings
from collections import deque
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from workloads.base import MLPerfInfo, QualityTarget, RunContext, StepResult, WorkloadBase, register
from workloads.base import invalid_config as _invalid
from workloads.data_source import Prefetcher
from workloads.device import bf16_supported, pin, pins_host_memory, synchronize
from workloads.llama.config import LlamaConfig
from workloads.llama.data import MarkovTokenSource
from workloads.llama.expert_parallel import AllToAllMeter, shard_experts
from workloads.llama.layout import resolve_layout
from workloads.llama.model import (
    SkippedLayer,
    build_model,
    count_active_params,
    count_params,
    training_flops_per_token,
)
from workloads.llama.moe import moe_aux_loss, moe_layers, update_expert_bias
from workloads.llama.parallel import CommMeter, apply_activation_checkpointing, build, clip_grad_norm
from workloads.llama.sources import TextSource, open_text_source

HANDOVER = 8  # real data: batches taken from the prefetch thread at a time


@register("llama", LlamaConfig)
class LlamaWorkload(WorkloadBase):
    """Data-parallel training of a Llama 3-style decoder (DDP or FSDP2 on more than one rank)."""

    throughput_unit = "tokens/s"

    def __init__(self, config: LlamaConfig, ctx: RunContext):
        flat = config.parallel.tp == 1 and config.parallel.pp == 1 and config.parallel.dp_replicate == 1
        if flat and config.batch_size % ctx.world_size:
            raise _invalid(
                "batch_size",
                f"{config.batch_size} is not divisible by the world size {ctx.world_size}; "
                f"use a multiple of {ctx.world_size}",
            )
        self.args = config.model_args()
        # checked before any set-up: a layout that cannot work exits 2 naming its numbers (workloads/llama/layout.py)
        self.layout = resolve_layout(config.parallel, ctx.world_size, self.args, config.batch_size, config.seq_len,
                                     config.grad_accum_steps)
        self.on_mesh = self.layout.on_mesh
        self.local_batch = config.batch_size // self.layout.dp  # the data-parallel slice's sequences
        self.data_rank = self.layout.dp_rank(ctx.rank)
        if self.local_batch % config.grad_accum_steps:
            raise _invalid(
                "grad_accum_steps",
                f"the per-rank batch {self.local_batch} is not divisible by {config.grad_accum_steps}",
            )
        self.config, self.ctx = config, ctx
        self.is_moe = self.args.n_routed_experts > 0
        self._check_mesh_options()
        self.expert_parallel = ctx.distributed and self.is_moe and config.expert_parallel and not self.on_mesh
        if self.expert_parallel and self.args.n_routed_experts % ctx.world_size:
            raise _invalid(
                "expert_parallel",
                f"{self.args.n_routed_experts} experts cannot be shared evenly by {ctx.world_size} ranks; "
                f"use a rank count that divides {self.args.n_routed_experts} or set workload.expert_parallel=false",
            )
        if self.expert_parallel and config.parallelism == "fsdp2":
            raise _invalid(
                "parallelism",
                "fsdp2 does not combine with expert parallelism here (the dense part runs under DDP); "
                "use workload.parallelism=ddp (or auto), or workload.expert_parallel=false",
            )
        # auto: bf16 autocast on an accelerator with native bf16 (CUDA from Ampere, ROCm CDNA2+, XPU, ...);
        # float32 on the CPU and on a GPU without it (emulated bf16 would run far below its float32 speed)
        use_bf16 = config.dtype == "bfloat16" or (config.dtype == "auto" and ctx.is_accelerator
                                                  and bf16_supported(ctx.device))
        self.compute_dtype = torch.bfloat16 if use_bf16 else torch.float32
        self.parallelism = self._choose_parallelism()
        self._cursor = 0
        # a real source is opened and checked here, before any run exists: bad input exits 2. Ranks of one
        # data-parallel slice (tensor and pipeline peers) read the same data.
        self.text: TextSource | None = None
        if config.data != "synthetic":
            data_ctx = dataclasses.replace(ctx, rank=self.data_rank, world_size=self.layout.dp)
            self.text = open_text_source(config, data_ctx, self.local_batch, self.args.vocab_size)

    def _check_mesh_options(self) -> None:
        """What the device-mesh layouts (tensor, pipeline, replicated-shard parallelism) do not combine with."""
        cfg, layout = self.config, self.layout
        if not self.on_mesh:
            if layout.ep > 1 and layout.ep != self.ctx.world_size:
                raise _invalid("parallel.ep", f"ep {layout.ep} with {self.ctx.world_size} ranks: without tp, pp or "
                                              "dp_replicate the experts are split over every rank (ep = world size)")
            return
        if cfg.parallelism == "ddp":
            raise _invalid("parallelism", f"ddp with the layout {layout.describe()}: its data-parallel ranks use "
                                          "FSDP2 (HSDP with dp_replicate); set workload.parallelism=auto or fsdp2")
        if self.is_moe:
            raise _invalid("parallel", f"the layout {layout.describe()} with the MoE preset {cfg.preset!r}: MoE "
                                       "presets split their experts over data-parallel ranks (workload.expert_parallel)"
                                       "; use tp = pp = dp_replicate = 1 for them")
        if self.ctx.fault_tolerance is not None:
            raise _invalid("parallel", f"the layout {layout.describe()} under torchft (ft=torchft): fault-tolerant "
                                       "replica groups train with FSDP2 or DDP over all their ranks")

    def _choose_parallelism(self) -> str:
        if self.on_mesh:
            return "mesh"
        if not self.ctx.distributed:
            return "none"
        if self.expert_parallel:
            return "ep+ddp"
        if self.config.parallelism == "auto":
            try:
                from torch.distributed.fsdp import fully_shard  # noqa: F401
            except ImportError:
                return "ddp"
            return "fsdp2"
        return self.config.parallelism

    # -- set-up ---------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg, ctx = self.config, self.ctx
        self.prefetcher: Prefetcher | None = None
        if self.text is not None:
            self.entropy_rate = None
            windows = torch.from_numpy(self.text.eval_windows.astype("int64")).to(ctx.device)
            self.eval_set = [(w[:, :-1], w[:, 1:]) for w in windows.split(self.local_batch)]
            # handed over HANDOVER batches at a time: taking an item from the thread can wait for the interpreter
            # to switch threads even when it is ready, so that wait is paid once per HANDOVER steps
            # bound for a GPU, batches are pinned on the reading thread: the step's copy is then asynchronous
            pinned = pins_host_memory(ctx.device)
            self.prefetcher = Prefetcher(lambda: _groups(self.text.make_batches(), HANDOVER),
                                         depth=max(1, cfg.prefetch_batches // HANDOVER), name="llama",
                                         transfer=lambda group: [tuple(t.to(ctx.device, non_blocking=True)
                                                                       for t in batch) for batch in group],
                                         prepare=(lambda group: [tuple(pin(t) for t in batch) for batch in group])
                                         if pinned else None)
            self._ready: deque = deque()
        else:
            self.source = MarkovTokenSource(self.args.vocab_size, seed=cfg.data_seed, branching=cfg.data_branching)
            self.entropy_rate = self.source.entropy_rate()
            # replica groups of a fault-tolerant job each train on their own data (their gradients are averaged)
            replica = ctx.fault_tolerance.replica if ctx.fault_tolerance is not None else None
            self.train_set = self._make_batches(cfg.train_batches, stream=0 if replica is None else 2 + replica)
            self.eval_set = self._make_batches(cfg.eval_batches, stream=1)
        if self.on_mesh:
            self._setup_mesh()
            return
        model = build_model(self.args, ctx.device, seed=ctx.seed)
        if cfg.router_init_skew:
            _skew_routers(model, cfg.router_init_skew, seed=ctx.seed)
        if self.layout.activation_checkpointing:
            apply_activation_checkpointing(model)
        self.a2a_meter = AllToAllMeter(ctx.device)
        self.expert_param_names: list[str] = []
        if self.expert_parallel:
            # the token exchange gets its own group, so it never queues behind DDP's all-reduces
            self.ep_group = dist.new_group(list(range(ctx.world_size)))
            self.expert_param_names = shard_experts(model, self.ep_group, self.a2a_meter)
        self.raw_model = model
        self.model = self._parallelize(model)
        if cfg.compile:
            self.model = torch.compile(self.model)
        # fused AdamW: one kernel for all parameters' updates (CPU and CUDA kernels in torch >= 2.4);
        # FSDP2's sharded DTensor parameters take the multi-tensor (foreach) path
        fused = self.parallelism != "fsdp2"
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
            weight_decay=cfg.weight_decay, fused=fused, foreach=None if fused else True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        if ctx.fault_tolerance is not None:  # torchft across replica groups: workloads/fault_tolerance.py
            self.model, self.optimizer = ctx.fault_tolerance.attach(self.model, self.optimizer, self._training_state,
                                                                    self._load_training_state)
        self._loads: deque[torch.Tensor] = deque(maxlen=4096)  # per step: routed copies per layer and expert
        self._a2a_seconds: deque[float] = deque(maxlen=4096)  # per step: time in the all-to-alls
        self._a2a_bytes: deque[int] = deque(maxlen=4096)
        self._timed_steps = 0

    def _setup_mesh(self) -> None:
        """The model as ``workload.parallel`` lays it out (workloads/llama/parallel.py), and its optimiser."""
        cfg = self.config
        self.a2a_meter = AllToAllMeter(self.ctx.device)
        self.expert_param_names = []
        # FSDP2 warns when a wrapped module returns a view (the tensor-parallel logits are one: a DTensor's local
        # shard), in case an in-place op follows; only the loss reads them
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPTransformer\) returned a view tensor")
        self.mesh_model = build(self.args, self.layout, self.ctx.device, self.ctx.seed)
        self.raw_model = self.model = self.mesh_model.model
        if cfg.compile:  # block by block, in place: the parameter names (and checkpoints) stay the model's
            for block in self.model.layers:
                if not isinstance(block, SkippedLayer):
                    block.compile()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                           eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self._loads, self._a2a_seconds, self._a2a_bytes = deque(maxlen=1), deque(maxlen=1), deque(maxlen=1)
        self._timed_steps = 0

    def _make_batches(self, count: int, stream: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's slices of the global batches; ``stream`` 1 is held out (never seen in
        training). Every rank draws the same global batches, so N ranks train on exactly the
        data one rank would, and their losses can be compared."""
        generator = torch.Generator().manual_seed(((self.ctx.seed * 1_000_003 + stream) * 1009) % 2**63)
        mine = slice(self.data_rank * self.local_batch, (self.data_rank + 1) * self.local_batch)
        batches = []
        for _ in range(count):
            inputs, targets = self.source.batch(self.config.batch_size, self.config.seq_len, generator)
            batches.append((inputs[mine].to(self.ctx.device), targets[mine].to(self.ctx.device)))
        return batches

    def _parallelize(self, model: nn.Module) -> nn.Module:
        if self.parallelism == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.ctx.device.index] if self.ctx.is_accelerator else None
            # no buffer broadcast before every forward (DDP's default): MoE's expert counters are each rank's
            # own (see ep+ddp below), and the dense model's only buffers are the constant RoPE tables
            # (rope_cos, rope_sin), whose broadcast is a collective per step that changes nothing (3.9 ms of a
            # 2-rank CPU step here) and that TorchRec's DDP wrapper (DLRM, seqrec) does not make either
            return DistributedDataParallel(model, device_ids=device_ids, process_group=self.ctx.process_group,
                                           forward_sync_buffers=False)
        if self.parallelism == "ep+ddp":
            from torch.nn.parallel import DistributedDataParallel

            # the rank-local experts are not replicas: DDP must not average them
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, self.expert_param_names)
            device_ids = [self.ctx.device.index] if self.ctx.is_accelerator else None
            # buffers are synced once at start, then stay per rank: the expert counters differ by
            # design, and the bias moves alike everywhere (it follows the all-reduced loads)
            return DistributedDataParallel(model, device_ids=device_ids, process_group=self.ctx.process_group,
                                           forward_sync_buffers=False)
        if self.parallelism == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for block in model.layers:
                fully_shard(block)
            fully_shard(model)
        return model

    def _training_state(self) -> dict:
        """All a restarted replica (healing from a peer) or job (from a checkpoint) needs to go on exactly."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "cursor": self._cursor}

    def _load_training_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._cursor = state["cursor"]

    def _lr_factor(self, step: int) -> float:
        cfg = self.config
        if step < cfg.lr_warmup_steps:
            return (step + 1) / (cfg.lr_warmup_steps + 1)
        progress = min(1.0, (step - cfg.lr_warmup_steps) / cfg.lr_decay_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return cfg.end_lr_ratio + (1 - cfg.end_lr_ratio) * cosine

    # -- steps ----------------------------------------------------------------------------------

    def _loss(self, inputs_bs: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
        autocast = torch.autocast(self.ctx.device.type, dtype=self.compute_dtype,
                                  enabled=self.compute_dtype != torch.float32)
        with autocast:  # the output head and the loss in one pass: no logits stored (workloads/llama/loss.py)
            return self.model(inputs_bs, targets_bs)

    def _train_loss(self, inputs_bs: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
        loss = self._loss(inputs_bs, targets_bs)
        aux = moe_aux_loss(self.raw_model) if self.config.moe_aux_loss_weight else None
        return loss if aux is None else loss + aux

    def _loss_context(self) -> contextlib.AbstractContextManager:
        """Tensor parallelism computes the loss on vocabulary-sharded logits: forward and backward inside
        ``loss_parallel``."""
        if self.on_mesh and self.layout.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def _mesh_loss(self, inputs_bs: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
        if self.layout.tp == 1:
            return self._loss(inputs_bs, targets_bs)
        autocast = torch.autocast(self.ctx.device.type, dtype=self.compute_dtype,
                                  enabled=self.compute_dtype != torch.float32)
        with autocast:
            logits = self.model(inputs_bs)
        return self.mesh_model.loss_fn(logits, targets_bs)

    def _pipeline_loss(self, inputs_bs: torch.Tensor, targets_bs: torch.Tensor, train: bool) -> torch.Tensor:
        """One pass of the pipeline schedule over the batch's microbatches (forward and, to train, backward);
        the batch's mean loss on every stage."""
        mm = self.mesh_model
        losses: list[torch.Tensor] = []
        args = (inputs_bs,) if mm.first_stage else ()
        target = targets_bs if mm.last_stage else None
        autocast = torch.autocast(self.ctx.device.type, dtype=self.compute_dtype,
                                  enabled=self.compute_dtype != torch.float32)
        with autocast, self._loss_context():
            if train:
                mm.schedule.step(*args, target=target, losses=losses, return_outputs=False)  # only losses kept
            else:
                mm.schedule.eval(*args, target=target, losses=losses)
        loss = (torch.stack([x.detach().float() for x in losses]).mean() if mm.last_stage
                else torch.zeros((), device=self.ctx.device))
        dist.all_reduce(loss, group=mm.group("pp"))  # the last stage's, everywhere
        return loss

    def _mesh_step(self, inputs_bs: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
        if self.mesh_model.schedule is not None:
            total = self._pipeline_loss(inputs_bs, targets_bs, train=True)
        else:
            micro = self.config.grad_accum_steps
            total = torch.zeros((), device=self.ctx.device)
            for inputs, targets in zip(inputs_bs.chunk(micro), targets_bs.chunk(micro), strict=True):
                with self._loss_context():
                    loss = self._mesh_loss(inputs, targets) / micro
                    loss.backward()
                total += loss.detach()
        clip_grad_norm(self.model.parameters(), self.config.grad_clip, self.mesh_model.group("pp"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def _measured_mesh_step(self, inputs_bs: torch.Tensor, targets_bs: torch.Tensor) -> torch.Tensor:
        """The last warm-up step, its collectives timed per mesh dimension (:class:`CommMeter`): never a timed
        step (the first warm-up step, with its one-time costs, is never measured either)."""
        meter = CommMeter(self.mesh_model.mesh, self.layout, self.ctx.device)
        synchronize(self.ctx.device)
        start = time.perf_counter()
        with meter:
            total = self._mesh_step(inputs_bs, targets_bs)
        synchronize(self.ctx.device)
        self._comm_measured = (meter, time.perf_counter() - start)
        return total

    def _clip_gradients(self) -> None:
        """Clip to ``grad_clip`` by the norm of the *whole* model's gradient: under expert
        parallelism each rank holds only its experts' gradients, so their squared norms are summed
        over the ranks. The experts' gradients are also averaged like DDP's: each is the sum of
        every rank's contribution (they arrive through the all-to-all's backward)."""
        if not self.expert_parallel:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
            return
        named = dict(self.raw_model.named_parameters())
        experts = [named[name] for name in self.expert_param_names if named[name].grad is not None]
        for param in experts:
            param.grad.div_(self.ctx.world_size)
        dense = [p for name, p in named.items() if name not in set(self.expert_param_names) and p.grad is not None]
        dense_sq = nn.utils.get_total_norm([p.grad for p in dense]) ** 2
        expert_sq = nn.utils.get_total_norm([p.grad for p in experts]) ** 2
        dist.all_reduce(expert_sq, group=self.ctx.process_group)
        total = (dense_sq + expert_sq).sqrt()
        nn.utils.clip_grads_with_norm_(dense + experts, self.config.grad_clip, total)

    def _next_batch(self) -> tuple[tuple[torch.Tensor, torch.Tensor], float]:
        """The step's batch and the seconds it waited for it (for the synthetic pool: the lookup)."""
        if self.prefetcher is not None:
            start = time.perf_counter()
            if not self._ready:  # a reader's error (a file gone bad) ends the run here, with its reason
                self._ready.extend(self.prefetcher.next()[0])
            return self._ready.popleft(), time.perf_counter() - start
        start = time.perf_counter()
        batch = self.train_set[self._cursor % len(self.train_set)]
        return batch, time.perf_counter() - start

    def step(self) -> StepResult:
        self.model.train()
        (inputs_bs, targets_bs), waited_s = self._next_batch()
        self._cursor += 1
        if self.on_mesh:  # one rank per data-parallel slice counts its samples (the harness sums the ranks')
            if self.ctx.distributed and self.ctx.warmup_steps >= 2 and self._cursor == self.ctx.warmup_steps:
                total = self._measured_mesh_step(inputs_bs, targets_bs)
            else:
                total = self._mesh_step(inputs_bs, targets_bs)
            counted = self.local_batch if self.mesh_model.counts_samples else 0
            return StepResult(samples=counted, tokens=counted * self.config.seq_len, loss=total, data_wait_s=waited_s)
        micro = self.config.grad_accum_steps
        total = torch.zeros((), device=self.ctx.device)
        a2a_seconds, a2a_bytes = self.a2a_meter.seconds, self.a2a_meter.bytes_sent
        for inputs, targets in zip(inputs_bs.chunk(micro), targets_bs.chunk(micro), strict=True):
            loss = self._train_loss(inputs, targets) / micro
            loss.backward()
            total += loss.detach()
        self._clip_gradients()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.is_moe:
            group = self.ctx.process_group if self.ctx.distributed else None
            loads = update_expert_bias(self.raw_model, self.config.moe_bias_update_coeff, group)
            self._loads.append(torch.stack(loads))  # stays on the device: read once, by extra_metrics
            self._a2a_seconds.append(self.a2a_meter.seconds - a2a_seconds)
            self._a2a_bytes.append(self.a2a_meter.bytes_sent - a2a_bytes)
        return StepResult(samples=self.local_batch, tokens=self.local_batch * self.config.seq_len, loss=total,
                          data_wait_s=waited_s)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss per evaluated token over all ranks' evaluation sequences (ranks may hold unequal shares)."""
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        for inputs, targets in self.eval_set:
            if self.on_mesh and self.mesh_model.schedule is not None:
                if not self.mesh_model.last_stage:  # the loss is the last stage's: counted there only
                    self._pipeline_loss(inputs, targets, train=False)
                    continue
                loss = self._pipeline_loss(inputs, targets, train=False)
            elif self.on_mesh:
                with self._loss_context():
                    loss = self._mesh_loss(inputs, targets)
            else:
                loss = self._loss(inputs, targets)
            sums[0] += loss.double() * targets.numel()
            sums[1] += targets.numel()
        if self.ctx.distributed:
            dist.all_reduce(sums, group=self.ctx.process_group)
        return {"eval_loss": float(sums[0] / sums[1])}

    # -- what the harness reports ---------------------------------------------------------------

    def flops_per_step(self) -> float:
        """This rank's share of the model's FLOPs (the harness sums the ranks'): its data-parallel slice's,
        divided among the slice's tensor and pipeline ranks, so the model's FLOPs count once, whatever the layout."""
        slice_flops = training_flops_per_token(self.args, self.config.seq_len) * self.local_batch * self.config.seq_len
        return slice_flops / (self.layout.tp * self.layout.pp)

    def target_eval_loss(self) -> float:
        if self.text is not None:
            return self.text.target
        if self.config.eval_loss_target is not None:
            return self.config.eval_loss_target
        floor = self.entropy_rate
        return floor + 0.5 * (math.log(self.args.vocab_size) - floor)

    def quality_target(self) -> QualityTarget:
        return QualityTarget("eval_loss", self.target_eval_loss(), "min")

    def mlperf_info(self) -> MLPerfInfo:
        cfg = self.config
        train, evaluated = cfg.train_batches * cfg.batch_size, cfg.eval_batches * cfg.batch_size
        if self.text is not None:  # a C4 stream's length is unknown: train_batches global batches stand for it
            train, evaluated = self.text.train_sequences or train, self.text.eval_sequences
        return MLPerfInfo(
            self._mlperf_benchmark(), cfg.batch_size, train, evaluated,
            gradient_accumulation_steps=cfg.grad_accum_steps,
            hyperparameters={
                "opt_name": "adamw",
                "opt_base_learning_rate": cfg.lr,
                "opt_end_learning_rate": cfg.lr * cfg.end_lr_ratio,
                "opt_learning_rate_warmup_steps": cfg.lr_warmup_steps,
                "opt_learning_rate_decay_steps": cfg.lr_decay_steps,
                "opt_adamw_beta_1": cfg.beta1,
                "opt_adamw_beta_2": cfg.beta2,
                "opt_adamw_epsilon": cfg.eps,
                "opt_adamw_weight_decay": cfg.weight_decay,
                "opt_gradient_clip_norm": cfg.grad_clip,
                "max_sequence_length": cfg.seq_len,
            },
        )

    def _mlperf_benchmark(self) -> str:
        """MLPerf's name for the benchmark this run mirrors: Llama 3.1 8B pretraining (405B with its recipe); the
        Llama 4-style MoE mirrors none (MLPerf Training has no MoE LLM benchmark), so its logs carry a name of
        its own that no MLPerf ruleset claims."""
        if self.is_moe:
            return "llama4_moe"
        return "llama31_405b" if self.config.data_recipe == "mlperf_llama31_405b" else "llama31_8b"

    def root_module(self) -> nn.Module:
        return self.raw_model  # a capture names each op's module scope after it

    def observe_step_times(self, step_times_s: list[float]) -> None:
        self._timed_steps = len(step_times_s)
        self._timed_seconds = sum(step_times_s)

    def extra_metrics(self) -> dict[str, float]:
        metrics = {
            "model_params": float(count_params(self.args)),
            "active_params": float(count_active_params(self.args)),
            "eval_loss_target": self.target_eval_loss(),
        }
        if self.entropy_rate is not None:
            metrics["data_entropy_nats"] = self.entropy_rate
        if self.is_moe:
            metrics.update(self._moe_metrics())
        if getattr(self, "_comm_measured", None) is not None:
            meter, step_s = self._comm_measured
            names = {"tp": "tp_comm_share", "pp": "pp_bubble_share", "dp": "dp_comm_share"}
            for dim, seconds in meter.seconds.items():
                metrics[names[dim]] = seconds / step_s
                metrics[f"{dim}_comm_mb_per_step"] = meter.bytes.get(dim, 0) / 1e6
        return metrics

    def _moe_metrics(self) -> dict[str, float]:
        """Expert load over the timed steps: per MoE layer, the busiest expert's routed copies
        over the mean, taken per step and averaged over the steps (a step waits for its busiest
        expert); ``expert_load_max_over_mean`` is the worst layer. ``tokens_dropped`` counts
        routed copies that reached no expert (dropless routing: 0). All-to-all figures are this
        rank's, over the same steps."""
        steps = min(self._timed_steps or len(self._loads), len(self._loads))
        if not steps:
            return {}
        loads_tle = torch.stack(list(self._loads)[-steps:]).cpu()
        ratio_tl = loads_tle.amax(dim=-1) / loads_tle.mean(dim=-1)
        per_layer = ratio_tl.mean(dim=0)
        moe_ids = [i for i in range(self.args.n_layers) if self.args.is_moe_layer(i)]
        routed_per_step = self.config.batch_size * self.config.seq_len * self.args.moe_top_k * len(moe_ids)
        metrics = {f"expert_load_max_over_mean_layer{i}": float(r) for i, r in zip(moe_ids, per_layer, strict=True)}
        metrics["expert_load_max_over_mean"] = float(per_layer.max())
        metrics["tokens_dropped"] = float(steps * routed_per_step - loads_tle.sum())
        if self.expert_parallel:
            a2a_s = sum(list(self._a2a_seconds)[-steps:])
            metrics["a2a_bytes_per_step"] = sum(list(self._a2a_bytes)[-steps:]) / steps
            metrics["a2a_time_ms_per_step"] = 1e3 * a2a_s / steps
            if self._timed_steps:
                metrics["a2a_share"] = a2a_s / self._timed_seconds
        return metrics

    def run_tags(self) -> dict[str, str]:
        layout = {"layout": self.layout.describe()} if self.ctx.distributed else {}
        if self.text is None:
            return {"data": "synthetic", **layout}
        tags = {f"data_{k}" if k != "data" else k: v for k, v in self.text.details.items()}
        tags.update(layout)
        tags["eval_loss_target_from"] = self.text.target_from
        if self.text.recipe is not None:  # the harness's runner.eval_interval (steps) sets the evaluation points
            tags["data_recipe"] = self.config.data_recipe
            tags["recipe_eval_every_sequences"] = str(self.text.recipe.eval_every_sequences)
        return tags

    def teardown(self) -> None:
        if getattr(self, "prefetcher", None) is not None:
            self.prefetcher.close()
        for name in ("model", "raw_model", "optimizer", "scheduler", "train_set", "eval_set", "prefetcher"):
            self.__dict__.pop(name, None)


def _groups(items: Iterator, size: int) -> Iterator[list]:
    """``items`` in lists of ``size`` (the last may be shorter)."""
    while group := list(itertools.islice(items, size)):
        yield group


@torch.no_grad()
def _skew_routers(model: nn.Module, skew: float, seed: int) -> None:
    """Tilt every router towards few experts: blend its weights with a rank-one matrix
    ``a_e * u`` (one shared direction ``u``, expert strengths ``a_e`` spread from -1 to 1), so the
    top-1 choice mostly depends on which side of ``u`` a token lies, and the experts at the ends
    of ``a`` get most tokens. ``skew`` is the blend's weight of the tilt."""
    generator = torch.Generator().manual_seed(seed + 17)
    for layer in moe_layers(model):
        weight = layer.router.weight
        direction_d = torch.randn(weight.shape[1], generator=generator)
        strength_x = torch.linspace(-1.0, 1.0, weight.shape[0])
        tilt = torch.outer(strength_x, direction_d).to(weight)
        tilt *= weight.norm() / tilt.norm()  # as strong as the initial weights
        weight.mul_(1 - skew).add_(skew * tilt)
