"""What Llama's real-data fields may say: the sources, the C4 readers, the data checks, and the MLPerf recipes a
run can follow (their files, validation set, evaluation cadence and quality target).

Light (no torch, no numpy): the config schema checks its values against these, and the readers
(:mod:`workloads.llama.sources`) follow the recipe a config names.
"""

from __future__ import annotations

from dataclasses import dataclass

from workloads.base import invalid_config as _invalid

SOURCES = ("synthetic", "c4", "megatron")
C4_READERS = ("json", "datasets")
DATA_CHECKS = ("auto", "full", "head")


@dataclass(frozen=True)
class Recipe:
    """What an MLPerf reference fixes about its data and quality target."""

    train_shards: str  # C4 training shards, inclusive
    val_documents: int  # the validation set: the first N documents of the unshuffled validation files
    eval_sequences: int  # sequences of seq_len evaluated (the first of the validation set)
    eval_every_sequences: int  # training sequences between evaluations (the harness's runner.eval_interval)
    seq_len: int
    eval_loss_target: float  # log perplexity
    cite: str


# github.com/mlcommons/training, small_llm_pretraining/nemo (Llama 3.1 8B): README.md "Training and test data
# separation" (c4-train.<x>-of-01024 for 768 <= x <= 1023; the first 91,205 validation documents = 47,185,920
# tokens = 5,760 sequences of 8,192), "Evaluation frequency" (every 12,288 sequences), "Evaluation thoroughness"
# (1,024 sequences), "Quality target" (log perplexity 3.3); pretrain_llama31.py: seq_length 8192, --eval_every
# 12288, --eval_tokens 1024, --target_log_ppl 3.3. The 405B reference (large_language_model_pretraining/nemo)
# uses the same files and validation set, evaluates all 5,760 sequences every 46,080, to log perplexity 5.6.
RECIPES = {
    "mlperf_llama31_8b": Recipe("768-1023", 91_205, 1_024, 12_288, 8_192, 3.3,
                                "mlcommons/training small_llm_pretraining/nemo (Llama 3.1 8B)"),
    "mlperf_llama31_405b": Recipe("768-1023", 91_205, 5_760, 46_080, 8_192, 5.6,
                                  "mlcommons/training large_language_model_pretraining/nemo (Llama 3.1 405B)"),
}


def recipe_of(name: str | None) -> Recipe | None:
    if name is None:
        return None
    if name not in RECIPES:
        raise _invalid("data_recipe", f"got {name!r}, allowed values: {', '.join(RECIPES)} (or null)")
    return RECIPES[name]


__all__ = ["C4_READERS", "DATA_CHECKS", "RECIPES", "SOURCES", "Recipe", "recipe_of"]
