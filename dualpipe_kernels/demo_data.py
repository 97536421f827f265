"""A deterministic synthetic token stream for the demo and the examples.

Tokens follow a fixed random Markov chain: each token has ``branching`` possible
successors, chosen uniformly.  A model that learns the table reaches a loss of
``ln(branching)`` nats per token (1.386 for the default 4), down from
``ln(vocab_size)`` (5.545 for 256) at initialisation, so a few steps already
show the loss falling.  Everything derives from the seed: the same
``(seed, step)`` always gives the same batch, on any machine.
"""

from __future__ import annotations

import math

import torch

__all__ = ["SyntheticTokens"]


class SyntheticTokens:
    """Batches of ``(inputs, targets)``, both ``[batch, seq_len]`` int64, targets shifted by one token."""

    def __init__(self, vocab_size: int = 256, seq_len: int = 32, seed: int = 0, branching: int = 4) -> None:
        if vocab_size < 2 or seq_len < 1 or not 1 <= branching <= vocab_size:
            raise ValueError(
                f"need vocab_size >= 2, seq_len >= 1 and 1 <= branching <= vocab_size, "
                f"got {vocab_size}, {seq_len}, {branching}"
            )
        self.vocab_size, self.seq_len, self.seed, self.branching = vocab_size, seq_len, seed, branching
        gen = torch.Generator().manual_seed(seed)
        # successors[t] = the tokens that may follow t
        self.successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=gen)

    @property
    def loss_floor(self) -> float:
        """Best achievable mean cross-entropy (nats), ignoring repeated successors."""
        return math.log(self.branching)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``step``-th batch: ``batch_size`` sequences of ``seq_len + 1`` tokens, split into inputs/targets."""
        if batch_size < 1 or step < 0:
            raise ValueError(f"need batch_size >= 1 and step >= 0, got {batch_size}, {step}")
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * (step + 1))
        toks = torch.empty(batch_size, self.seq_len + 1, dtype=torch.int64)
        toks[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=gen)
        choice = torch.randint(0, self.branching, (batch_size, self.seq_len), generator=gen)
        for t in range(self.seq_len):
            toks[:, t + 1] = self.successors[toks[:, t], choice[:, t]]
        return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()
