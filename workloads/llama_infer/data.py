"""Synthetic requests with declared length distributions, shaped like MLPerf's llama3.1-8b set.

MLPerf's llama3.1-8b serves CNN/DailyMail summarisation: long prompts (news articles, roughly
log-normally spread, several hundred to ~2,000 tokens) and short answers (a summary, at most 128
new tokens). Here the prompt lengths are log-normal and the answer budgets uniform, with every
parameter declared in the config, so a tiny model gets the same *shape* scaled to its context.
Token ids are uniform random (no download, no tokenizer); the answer's length is its budget
unless the model emits EOS first. Everything is drawn from one seed: the same config gives the
same requests on every platform. This is the default; ``workload.prompts`` serves a file's real
prompts instead (:mod:`workloads.llama_infer.prompts`), in the same :class:`RequestSet`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthDistribution:
    """Prompt lengths log-normal around ``prompt_mean`` (``prompt_sigma`` in log space), clipped
    to ``[prompt_min, prompt_max]``; new-token budgets uniform in ``[output_min, output_max]``."""

    prompt_mean: int
    prompt_sigma: float
    prompt_min: int
    prompt_max: int
    output_min: int
    output_max: int

    def validate(self, context: int) -> None:
        """``ValueError`` naming the key (relative to ``workload.``) when the lengths are impossible."""
        if not 1 <= self.prompt_min <= self.prompt_mean <= self.prompt_max:
            raise ValueError("invalid config 'workload.prompt_mean': need 1 <= prompt_min <= prompt_mean <= "
                             f"prompt_max, got {self.prompt_min}, {self.prompt_mean}, {self.prompt_max}")
        if self.prompt_sigma < 0:
            raise ValueError(f"invalid config 'workload.prompt_sigma': must be >= 0, got {self.prompt_sigma}")
        if not 1 <= self.output_min <= self.output_max:
            raise ValueError("invalid config 'workload.output_min': need 1 <= output_min <= output_max, "
                             f"got {self.output_min}, {self.output_max}")
        if self.prompt_max + self.output_max > context:
            raise ValueError(
                f"invalid config 'workload.prompt_max': prompts of up to {self.prompt_max} tokens plus up to "
                f"{self.output_max} new tokens exceed the model's context of {context} tokens; lower "
                "workload.prompt_max / workload.output_max or raise workload.max_seq_len")


@dataclass(frozen=True)
class RequestSet:
    """The sample library (LoadGen's QSL): ``prompts[i]`` and its new-token budget ``max_new_tokens[i]``,
    drawn here or read from a prompts file (:mod:`workloads.llama_infer.prompts`)."""

    prompts: list[list[int]]
    max_new_tokens: list[int]

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def longest_prompt(self) -> int:
        return max(len(p) for p in self.prompts)

    @property
    def largest_budget(self) -> int:
        return max(self.max_new_tokens)


def synthetic_requests(n: int, lengths: LengthDistribution, vocab_size: int, seed: int) -> RequestSet:
    """``n`` requests drawn from ``lengths`` with uniform random token ids below ``vocab_size``."""
    rng = np.random.default_rng(seed)
    mu = np.log(lengths.prompt_mean) - lengths.prompt_sigma**2 / 2  # so the mean before clipping is prompt_mean
    prompt_lens = np.clip(np.rint(rng.lognormal(mu, lengths.prompt_sigma, n)), lengths.prompt_min,
                          lengths.prompt_max).astype(int)
    budgets = rng.integers(lengths.output_min, lengths.output_max + 1, n)
    prompts = [rng.integers(0, vocab_size, int(length)).tolist() for length in prompt_lens]
    return RequestSet(prompts, [int(b) for b in budgets])


__all__ = ["LengthDistribution", "RequestSet", "synthetic_requests"]
