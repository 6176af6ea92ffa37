"""Synthetic token streams a language model can actually learn.

Uniform random tokens give a loss stuck at ``ln(vocab)`` whatever the model does, so a quality
target on them is meaningless. :class:`MarkovTokenSource` plants structure instead: a sparse
first-order Markov chain whose best achievable cross-entropy is known exactly.
"""

from __future__ import annotations

import math

import torch


class MarkovTokenSource:
    """A planted first-order Markov chain over ``vocab_size`` tokens.

    Every token has ``branching`` distinct likely successors whose probabilities are drawn from
    a flat Dirichlet (uniform on the simplex); with ``smoothing`` > 0 the next token is instead
    uniform over the whole vocabulary with that probability. The chain is stored sparsely
    (``vocab_size x branching``), so a 128k vocabulary costs a few megabytes.

    A model's cross-entropy on these streams starts near ``ln(vocab_size)`` and can fall no
    lower than :meth:`entropy_rate`, which a model reaches by learning the transition table.
    An eval-loss target between the two is therefore a meaningful MLPerf-style quality target:
    hitting it proves the model learned something, and the floor says how much is left.
    """

    def __init__(
        self, vocab_size: int, branching: int = 4, smoothing: float = 0.0, seed: int = 0
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if not 1 <= branching <= vocab_size:
            raise ValueError(f"branching must be in [1, vocab_size={vocab_size}], got {branching}")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self.vocab_size, self.branching, self.smoothing = vocab_size, branching, smoothing

        generator = torch.Generator().manual_seed(seed)
        # Distinct successors without a vocab x vocab table: sorted draws from
        # [0, vocab - branching] shifted by their rank never collide.
        shape = (vocab_size, branching)
        draws = torch.randint(0, vocab_size - branching + 1, shape, generator=generator)
        self.successors = draws.sort(dim=1).values + torch.arange(branching)
        # Normalised i.i.d. exponentials are a Dirichlet(1, ..., 1) sample.
        weights = torch.empty(vocab_size, branching, dtype=torch.float64)
        weights.exponential_(generator=generator)
        self.probs = weights / weights.sum(dim=1, keepdim=True)
        self._cumulative = self.probs.cumsum(dim=1)
        self._cumulative[:, -1] = 1.0  # no u in [0, 1) may fall past the last successor

    def batch(
        self, batch_size: int, seq_len: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``batch_size`` streams of ``seq_len + 1`` tokens (first token uniform) and
        return ``(inputs, targets)``, each ``(batch_size, seq_len)`` int64 on the CPU, targets
        being inputs shifted left by one. Deterministic in the generator's state."""
        tokens_bs = torch.empty(batch_size, seq_len + 1, dtype=torch.int64)
        tokens_bs[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=generator)
        for pos in range(1, seq_len + 1):
            current = tokens_bs[:, pos - 1]
            u = torch.rand(batch_size, 1, dtype=torch.float64, generator=generator)
            choice = torch.searchsorted(self._cumulative[current], u, right=True)
            tokens_bs[:, pos] = self.successors[current].gather(1, choice).squeeze(1)
            if self.smoothing:
                uniform = torch.randint(0, self.vocab_size, (batch_size,), generator=generator)
                jump = torch.rand(batch_size, generator=generator) < self.smoothing
                tokens_bs[:, pos] = torch.where(jump, uniform, tokens_bs[:, pos])
        return tokens_bs[:, :-1], tokens_bs[:, 1:]

    def stationary_distribution(self, tol: float = 1e-12, max_iters: int = 100_000) -> torch.Tensor:
        """Long-run token frequencies, by power iteration from the uniform start the sampler uses.

        Iterates the lazy chain ``(P + I) / 2``: it has the same stationary distribution but
        cannot be periodic, so the iteration converges for every planted graph.
        """
        dist = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        for _ in range(max_iters):
            moved = torch.zeros_like(dist).index_add_(
                0, self.successors.flatten(), (dist[:, None] * self.probs).flatten()
            )
            moved = (1 - self.smoothing) * moved + self.smoothing / self.vocab_size
            new = 0.5 * (dist + moved)
            if (new - dist).abs().sum() < tol:
                return new
            dist = new
        raise RuntimeError(f"stationary distribution did not converge in {max_iters} iterations")

    def entropy_rate(self) -> float:
        """Entropy rate in nats: the per-token loss of a model that knows the chain exactly,
        ``sum_i pi_i * H(P[i, :])`` with ``pi`` the stationary distribution."""
        eps, vocab = self.smoothing, self.vocab_size
        listed = (1 - eps) * self.probs + eps / vocab
        row_entropy = -(listed * listed.log()).sum(dim=1)
        if eps:  # every token off the successor list carries eps / vocab
            row_entropy += -(vocab - self.branching) * (eps / vocab) * math.log(eps / vocab)
        return float(self.stationary_distribution() @ row_entropy)


__all__ = ["MarkovTokenSource"]
