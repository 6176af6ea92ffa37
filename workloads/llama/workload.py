"""The Llama training benchmark: its config checked, its parts composed, its train/eval steps and its report.

Before any set-up the workload checks the config against the world size and the layout; set-up then composes
the batches (:mod:`workloads.llama.feed`) with the model, either on one rank or data-parallel over all ranks
(:mod:`workloads.llama.data_parallel`; MoE experts split by :mod:`workloads.llama.expert_parallel`) or on a
device mesh (:mod:`workloads.llama.mesh_training`; MoE experts over ep and tp by
:mod:`workloads.llama.expert_mesh`), and its optimiser and learning-rate schedule. A MoE run reports its experts'
load (:mod:`workloads.llama.expert_load`).

By default (``workload.data=synthetic``) training data is a planted Markov chain
(``data.MarkovTokenSource``), so the loss really falls and "eval loss ≤ target" is a meaningful,
MLPerf-style quality target; the training set is a fixed pool of pre-generated batches on the device
(cycled like epochs), so step time measures the model, not a synthetic data generator. Real text
(``workload.data=c4|megatron``, ``workloads/llama/sources.py``) is read, tokenized and packed on a
background thread; every step reports how long it waited for its batch.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import nn

from workloads.base import MLPerfInfo, QualityTarget, RunContext, StepResult, WorkloadBase, register
from workloads.base import invalid_config as _invalid
from workloads.device import bf16_supported
from workloads.llama.config import LlamaConfig
from workloads.llama.data_parallel import clip_gradients, wrap_data_parallel
from workloads.llama.expert_load import ExpertLoadLog
from workloads.llama.expert_parallel import AllToAllMeter, shard_experts
from workloads.llama.feed import TrainingFeed
from workloads.llama.layout import resolve_layout
from workloads.llama.mesh_training import MeshTraining
from workloads.llama.model import build_model, count_active_params, count_params, training_flops_per_token
from workloads.llama.moe import moe_aux_loss, skew_routers, update_expert_bias
from workloads.llama.parallel import apply_activation_checkpointing
from workloads.llama.sources import TextSource, open_text_source


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
        if self.is_moe and cfg.moe_aux_loss_weight:
            raise _invalid("moe_aux_loss_weight", f"the layout {layout.describe()}: the Switch-style auxiliary "
                                                  "loss is added on one rank or under the flat expert parallelism "
                                                  "only; set it to 0 (the bias update balances the experts)")
        if self.is_moe and cfg.compile:
            raise _invalid("compile", f"the layout {layout.describe()} with the MoE preset {cfg.preset!r}: "
                                      "torch.compile is not applied to a mixture of experts on a device mesh; "
                                      "set workload.compile=false")
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
        self.feed = TrainingFeed(cfg, ctx, self.text, self.args.vocab_size, self.local_batch, self.data_rank)
        self.entropy_rate = self.feed.entropy_rate
        self._timed_steps, self._timed_seconds = 0, 0.0
        self.mesh: MeshTraining | None = None
        if self.on_mesh:  # the model as workload.parallel lays it out (workloads/llama/mesh_training.py)
            self.mesh = MeshTraining(self.args, self.layout, ctx, cfg, self.compute_dtype, self._lr_factor)
            self.raw_model = self.model = self.mesh.model
            self.optimizer, self.scheduler = self.mesh.optimizer, self.mesh.scheduler
            self.expert_load = self.mesh.expert_load
            return
        self._setup_flat()

    def _setup_flat(self) -> None:
        """The model on one rank or data-parallel over all of them (workloads/llama/data_parallel.py), the
        experts split over the ranks under expert parallelism, and its optimiser."""
        cfg, ctx = self.config, self.ctx
        model = build_model(self.args, ctx.device, seed=ctx.seed)
        if cfg.router_init_skew:
            skew_routers(model, cfg.router_init_skew, seed=ctx.seed)
        if self.layout.activation_checkpointing:
            apply_activation_checkpointing(model)
        self.a2a_meter = AllToAllMeter(ctx.device)
        self.expert_param_names: list[str] = []
        if self.expert_parallel:
            # the token exchange gets its own group, so it never queues behind DDP's all-reduces
            self.ep_group = dist.new_group(list(range(ctx.world_size)))
            self.expert_param_names = shard_experts(model, self.ep_group, self.a2a_meter)
        self.raw_model = model
        self.model = wrap_data_parallel(model, self.parallelism, ctx, self.expert_param_names)
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
        self.expert_load = ExpertLoadLog(self.args, cfg.batch_size, cfg.seq_len, self.expert_parallel)

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

    def step(self) -> StepResult:
        self.model.train()
        (inputs_bs, targets_bs), waited_s = self.feed.next(self._cursor)
        self._cursor += 1
        if self.mesh is not None:  # one rank per data-parallel slice counts its samples (the harness sums the ranks')
            if self.ctx.distributed and self.ctx.warmup_steps >= 2 and self._cursor == self.ctx.warmup_steps:
                total = self.mesh.measured_step(inputs_bs, targets_bs)
            else:
                total = self.mesh.step(inputs_bs, targets_bs)
            counted = self.local_batch if self.mesh.counts_samples else 0
            return StepResult(samples=counted, tokens=counted * self.config.seq_len, loss=total, data_wait_s=waited_s)
        micro = self.config.grad_accum_steps
        total = torch.zeros((), device=self.ctx.device)
        a2a_seconds, a2a_bytes = self.a2a_meter.seconds, self.a2a_meter.bytes_sent
        for inputs, targets in zip(inputs_bs.chunk(micro), targets_bs.chunk(micro), strict=True):
            loss = self._train_loss(inputs, targets) / micro
            loss.backward()
            total += loss.detach()
        clip_gradients(self.model, self.raw_model, self.expert_param_names, self.config.grad_clip, self.ctx)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.is_moe:
            groups = [self.ctx.process_group] if self.ctx.distributed else []
            loads = update_expert_bias(self.raw_model, self.config.moe_bias_update_coeff, groups)
            self.expert_load.record(torch.stack(loads), self.a2a_meter.seconds - a2a_seconds,
                                    self.a2a_meter.bytes_sent - a2a_bytes)
        return StepResult(samples=self.local_batch, tokens=self.local_batch * self.config.seq_len, loss=total,
                          data_wait_s=waited_s)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss per evaluated token over all ranks' evaluation sequences (ranks may hold unequal shares)."""
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        for inputs, targets in self.feed.eval_set:
            if self.mesh is not None:
                loss = self.mesh.eval_loss(inputs, targets)
                if loss is None:  # a pipeline stage before the last: the loss is the last stage's, counted there
                    continue
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
            metrics.update(self.expert_load.metrics(self._timed_steps, self._timed_seconds))
        if self.mesh is not None:
            metrics.update(self.mesh.comm_metrics())
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
        if "feed" in self.__dict__:
            self.feed.close()
        for name in ("model", "raw_model", "optimizer", "scheduler", "mesh", "feed"):
            self.__dict__.pop(name, None)
