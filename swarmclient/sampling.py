"""Choosing the next token: greedy, or temperature + top-p with a generator seeded by (seed, position).

Seeding by position makes a sequence's samples independent of its batch neighbours and of restarts: a
request resumed at position p draws exactly what an uninterrupted run draws at p.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) pairs over the seed space


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks tokens; temperature 0 (or do_sample False) means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    # log-probabilities to report per token (swarmclient.generation.TokenLogprobs): None for none, k for the chosen
    # token's and the k most likely tokens' (0: the chosen one's alone)
    top_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """Whether this is plain argmax."""
        return self.temperature == 0


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from a request seed and an absolute token position."""
    return ((seed * _MIX) ^ (position * 0xBF58476D1CE4E5B9) ^ (position >> 3)) & ((1 << 63) - 1)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of a probability vector beyond cumulative mass top_p (the top token always stays)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    drop = sorted_probs.cumsum(-1) - sorted_probs > top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def sample_row(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The next token of one sequence from its logits [V]."""
    if params.greedy:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    probs = top_p_filter(probs, params.top_p)
    generator = torch.Generator().manual_seed(position_seed(params.seed, position))
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_next(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
    """Next tokens [B] from logits [B, V]; row b uses params[b] and its absolute position positions[b]."""
    if all(p.greedy for p in params):
        return logits.argmax(-1)
    return torch.tensor([sample_row(logits[b], params[b], positions[b]) for b in range(logits.shape[0])])
