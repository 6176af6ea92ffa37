"""The Llama training benchmark: config, data, optimiser and the train/eval steps.

Training data is a planted Markov chain (``data.MarkovTokenSource``), so the loss really falls
and "eval loss ≤ target" is a meaningful, MLPerf-style quality target. The training set is a
fixed pool of pre-generated batches on the device (cycled like epochs), so step time measures
the model, not a synthetic data generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workloads.base import MLPerfInfo, QualityTarget, RunContext, StepResult, WorkloadBase, register
from workloads.base import invalid_config as _invalid
from workloads.llama.data import MarkovTokenSource
from workloads.llama.model import PRESETS, ModelArgs, build_model, count_params, training_flops_per_token

DTYPES = ("auto", "float32", "bfloat16")
PARALLELISMS = ("auto", "ddp", "fsdp2")


@dataclass
class LlamaConfig:
    """``workload=llama``. Model fields left ``None`` take the preset's value."""

    name: str = "llama"
    preset: str = "tiny"
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    vocab_size: int | None = None
    batch_size: int = 8  # global: sequences per optimiser step, across all ranks
    seq_len: int = 64
    grad_accum_steps: int = 1
    lr: float = 3e-3
    end_lr_ratio: float = 0.1  # the cosine decays to lr * end_lr_ratio
    lr_warmup_steps: int = 10
    lr_decay_steps: int = 200  # cosine horizon after warm-up; the lr then stays at its end value
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    dtype: str = "auto"  # auto: bfloat16 autocast on accelerators, float32 on CPU
    parallelism: str = "auto"  # with >1 rank. auto: fsdp2 where torch has it, else ddp
    data_seed: int = 0  # the planted chain; fixed so every run learns the same task
    data_branching: int = 4  # likely successors per token: lower = easier task
    train_batches: int = 64  # size of the training set, in global batches
    eval_batches: int = 4
    eval_loss_target: float | None = None  # None: halfway from ln(vocab) to the entropy rate

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise _invalid("preset", f"got {self.preset!r}, allowed values: {', '.join(PRESETS)}")
        for key in ("batch_size", "seq_len", "grad_accum_steps", "train_batches", "eval_batches",
                    "data_branching", "lr_decay_steps"):
            if getattr(self, key) < 1:
                raise _invalid(key, f"got {getattr(self, key)}, must be >= 1")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise _invalid("lr", f"got {self.lr}, must be a positive number")
        if not 0 <= self.end_lr_ratio <= 1:
            raise _invalid("end_lr_ratio", f"got {self.end_lr_ratio}, must be in [0, 1]")
        if self.lr_warmup_steps < 0:
            raise _invalid("lr_warmup_steps", f"got {self.lr_warmup_steps}, must be >= 0")
        if self.dtype not in DTYPES:
            raise _invalid("dtype", f"got {self.dtype!r}, allowed values: {', '.join(DTYPES)}")
        if self.parallelism not in PARALLELISMS:
            raise _invalid("parallelism", f"got {self.parallelism!r}, allowed values: {', '.join(PARALLELISMS)}")
        args = self.model_args()
        try:
            args.validate()
        except ValueError as err:
            raise ValueError(f"invalid config 'workload' (model from preset {self.preset!r}): {err}") from err
        if self.seq_len > args.max_seq_len:
            raise _invalid("seq_len", f"got {self.seq_len}, the model supports at most {args.max_seq_len}")

    def model_args(self) -> ModelArgs:
        overrides = {k: getattr(self, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")}
        return replace(PRESETS[self.preset], **{k: v for k, v in overrides.items() if v is not None})


@register("llama", LlamaConfig)
class LlamaWorkload(WorkloadBase):
    """Data-parallel training of a Llama 3-style decoder (DDP or FSDP2 on more than one rank)."""

    throughput_unit = "tokens/s"

    def __init__(self, config: LlamaConfig, ctx: RunContext):
        if config.batch_size % ctx.world_size:
            raise _invalid(
                "batch_size",
                f"{config.batch_size} is not divisible by the world size {ctx.world_size}; "
                f"use a multiple of {ctx.world_size}",
            )
        self.local_batch = config.batch_size // ctx.world_size
        if self.local_batch % config.grad_accum_steps:
            raise _invalid(
                "grad_accum_steps",
                f"the per-rank batch {self.local_batch} is not divisible by {config.grad_accum_steps}",
            )
        self.config, self.ctx = config, ctx
        self.args = config.model_args()
        use_bf16 = config.dtype == "bfloat16" or (config.dtype == "auto" and ctx.is_accelerator)
        self.compute_dtype = torch.bfloat16 if use_bf16 else torch.float32
        self.parallelism = self._choose_parallelism()
        self._cursor = 0

    def _choose_parallelism(self) -> str:
        if not self.ctx.distributed:
            return "none"
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
        self.source = MarkovTokenSource(self.args.vocab_size, seed=cfg.data_seed, branching=cfg.data_branching)
        self.entropy_rate = self.source.entropy_rate()
        self.train_set = self._make_batches(cfg.train_batches, stream=0)
        self.eval_set = self._make_batches(cfg.eval_batches, stream=1)
        model = build_model(self.args, ctx.device, seed=ctx.seed)
        self.model = self._parallelize(model)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)

    def _make_batches(self, count: int, stream: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-rank batches; ``stream`` 1 is held out (never seen in training)."""
        generator = torch.Generator().manual_seed(
            ((self.ctx.seed * 1_000_003 + stream) * 1009 + self.ctx.rank) % 2**63
        )
        batches = []
        for _ in range(count):
            inputs, targets = self.source.batch(self.local_batch, self.config.seq_len, generator)
            batches.append((inputs.to(self.ctx.device), targets.to(self.ctx.device)))
        return batches

    def _parallelize(self, model: nn.Module) -> nn.Module:
        if self.parallelism == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.ctx.device.index] if self.ctx.is_accelerator else None
            return DistributedDataParallel(model, device_ids=device_ids, process_group=self.ctx.process_group)
        if self.parallelism == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for block in model.layers:
                fully_shard(block)
            fully_shard(model)
        return model

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
        with autocast:
            logits_bsv = self.model(inputs_bs)
        return F.cross_entropy(logits_bsv.flatten(0, 1).float(), targets_bs.flatten())

    def step(self) -> StepResult:
        self.model.train()
        inputs_bs, targets_bs = self.train_set[self._cursor % len(self.train_set)]
        self._cursor += 1
        micro = self.config.grad_accum_steps
        total = torch.zeros((), device=self.ctx.device)
        for inputs, targets in zip(inputs_bs.chunk(micro), targets_bs.chunk(micro), strict=True):
            loss = self._loss(inputs, targets) / micro
            loss.backward()
            total += loss.detach()
        nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(samples=self.local_batch, tokens=self.local_batch * self.config.seq_len, loss=total)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        losses = torch.stack([self._loss(inputs, targets) for inputs, targets in self.eval_set])
        mean = losses.mean()
        if self.ctx.distributed:
            dist.all_reduce(mean, group=self.ctx.process_group)
            mean /= self.ctx.world_size
        return {"eval_loss": float(mean)}

    # -- what the harness reports ---------------------------------------------------------------

    def flops_per_step(self) -> float:
        return training_flops_per_token(self.args, self.config.seq_len) * self.local_batch * self.config.seq_len

    def target_eval_loss(self) -> float:
        if self.config.eval_loss_target is not None:
            return self.config.eval_loss_target
        floor = self.entropy_rate
        return floor + 0.5 * (math.log(self.args.vocab_size) - floor)

    def quality_target(self) -> QualityTarget:
        return QualityTarget("eval_loss", self.target_eval_loss(), "min")

    def mlperf_info(self) -> MLPerfInfo:
        cfg = self.config
        return MLPerfInfo.of_batches(
            "llama31_8b", cfg.batch_size, cfg.train_batches, cfg.eval_batches,
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

    def root_module(self) -> nn.Module:
        return self.model  # a capture names each op's module scope after it

    def extra_metrics(self) -> dict[str, float]:
        return {
            "model_params": float(count_params(self.args)),
            "data_entropy_nats": self.entropy_rate,
            "eval_loss_target": self.target_eval_loss(),
        }

    def teardown(self) -> None:
        for name in ("model", "optimizer", "scheduler", "train_set", "eval_set"):
            self.__dict__.pop(name, None)
