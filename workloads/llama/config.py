"""``workload=llama``'s config: the schema of ``conf/workload/llama.yaml`` (every key listed there).

Light: it imports neither torch nor the model's code, so composing configs stays cheap; the data fields are
checked against :mod:`workloads.llama.recipes` (the sources, readers and MLPerf recipes)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

from workloads.base import invalid_config as _invalid
from workloads.llama.args import PRESETS, ModelArgs
from workloads.llama.layout import PP_SCHEDULES, ParallelConfig, resolve_layout
from workloads.llama.recipes import C4_READERS, DATA_CHECKS, SOURCES, recipe_of

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
    dtype: str = "auto"  # auto: bfloat16 autocast on accelerators with native bf16, else float32
    parallelism: str = "auto"  # with >1 rank. auto: fsdp2 where torch has it, else ddp
    # -- data: synthetic (a planted chain), c4 (AllenAI's JSON shards) or megatron (PREFIX.bin/.idx) --
    data: str = "synthetic"
    data_path: str | None = None  # c4: the folder of shards; megatron: the training set's prefix
    val_data_path: str | None = None  # c4: a folder of validation shards; megatron: a prefix; None: see yaml
    tokenizer: str | None = None  # real data: a tokenizer.json, or a model folder holding one
    data_recipe: str | None = None  # mlperf_llama31_8b | mlperf_llama31_405b: fills the null fields below
    train_shards: str | None = None  # c4: "FIRST-LAST" training shards; None: the recipe's, else all present
    val_documents: int | None = None  # c4: evaluate on the first N validation documents; None: recipe's / all
    eval_sequences: int | None = None  # real data: sequences evaluated; None: recipe's, else eval_batches global
    shuffle_sequences: int = 1024  # c4: packed sequences shuffled together
    prefetch_batches: int = 32  # real data: batches made ahead on a background thread
    c4_reader: str = "json"  # json (gzip + json; a third of the CPU: c4.read_texts) | datasets (Hugging Face)
    data_check: str = "auto"  # c4 files up front: full (every line) | head (gzip header, first line) | auto
    data_seed: int = 0  # the planted chain; fixed so every run learns the same task
    data_branching: int = 4  # likely successors per token: lower = easier task
    train_batches: int = 64  # synthetic: size of the training set, in global batches; c4: MLPerf's train_samples
    eval_batches: int = 4
    eval_loss_target: float | None = None  # None: the recipe's; synthetic: halfway ln(vocab)..entropy rate
    compile: bool = False  # torch.compile the model (the first steps then include compilation)
    # -- mixture of experts (MoE presets only) --
    moe_bias_update_coeff: float = 1e-3  # aux-loss-free balancing: bias step per optimiser step; 0 = off
    moe_aux_loss_weight: float = 0.0  # Switch-style balance loss added to the training loss; 0 = off
    router_init_skew: float = 0.0  # in [0, 1): tilt the initial routers towards few experts (balance tests)
    expert_parallel: bool = True  # with >1 rank: shard the experts over the ranks (all-to-all)
    # -- layout on a device mesh: tensor, pipeline, sharded and replicated data parallelism (layout.py) --
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

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
        for key in ("moe_bias_update_coeff", "moe_aux_loss_weight"):
            if not (math.isfinite(getattr(self, key)) and getattr(self, key) >= 0):
                raise _invalid(key, f"got {getattr(self, key)}, must be a number >= 0 (0 switches it off)")
        if not 0 <= self.router_init_skew < 1:
            raise _invalid("router_init_skew", f"got {self.router_init_skew}, must be in [0, 1)")
        if self.parallelism not in PARALLELISMS:
            raise _invalid("parallelism", f"got {self.parallelism!r}, allowed values: {', '.join(PARALLELISMS)}")
        if self.parallel.pp_schedule not in PP_SCHEDULES:
            raise _invalid("parallel.pp_schedule",
                           f"got {self.parallel.pp_schedule!r}, allowed values: {', '.join(PP_SCHEDULES)}")
        self._check_data_fields()
        args = self.model_args()
        try:
            args.validate()
        except ValueError as err:
            raise ValueError(f"invalid config 'workload' (model from preset {self.preset!r}): {err}") from err
        if self.seq_len > args.max_seq_len:
            raise _invalid("seq_len", f"got {self.seq_len}, the model supports at most {args.max_seq_len}")
        world_size = int(os.environ.get("WORLD_SIZE", "0"))  # torchrun's: the layout is checked before any
        if world_size:                                        # process group exists
            resolve_layout(self.parallel, world_size, args, self.batch_size, self.seq_len, self.grad_accum_steps)

    def _check_data_fields(self) -> None:
        """The real-source fields' values alone (types and ranges); files are checked when the source opens."""
        if self.data not in SOURCES:
            raise _invalid("data", f"got {self.data!r}, allowed values: {', '.join(SOURCES)}")
        if self.c4_reader not in C4_READERS:
            raise _invalid("c4_reader", f"got {self.c4_reader!r}, allowed values: {', '.join(C4_READERS)}")
        if self.data_check not in DATA_CHECKS:
            raise _invalid("data_check", f"got {self.data_check!r}, allowed values: {', '.join(DATA_CHECKS)}")
        recipe_of(self.data_recipe)
        for key in ("val_documents", "eval_sequences", "shuffle_sequences", "prefetch_batches"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise _invalid(key, f"got {value}, must be >= 1")
        if self.train_shards is not None:
            from workloads.llama.c4 import parse_shards  # the reader's module: imported when it is used

            try:
                parse_shards(self.train_shards)
            except ValueError as err:
                raise _invalid("train_shards", str(err)) from err

    def model_args(self) -> ModelArgs:
        overrides = {k: getattr(self, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")}
        return replace(PRESETS[self.preset], **{k: v for k, v in overrides.items() if v is not None})


__all__ = ["DTYPES", "PARALLELISMS", "LlamaConfig"]
