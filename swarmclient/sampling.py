"""Choosing the next token: penalties and biases (swarmclient.penalties), the grammar's mask (swarmclient.constraints),
then greedy, or temperature, top-k, top-p and min-p (transformers' order) with a generator seeded by (seed, position).

Seeding by position makes a sequence's samples independent of its batch neighbours and of restarts: a
request resumed at position p draws exactly what an uninterrupted run draws at p.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from swarmclient.constraints import Constraint, Grammar
from swarmclient.penalties import History, Penalties, apply_penalties

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
    top_k: int = 0  # keep the k most likely tokens (ties kept); 0 or -1: all (vLLM's extension)
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (vLLM's extension)
    penalties: Penalties = Penalties()
    # the last `earlier_tokens` tokens of the input are this sequence's own output from before a resume: the
    # frequency and presence penalties count them as generated, and the grammar's matcher consumes them
    earlier_tokens: int = 0
    grammar: Grammar | None = None  # the output must be a string of this grammar (constrained decoding)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (all tokens) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

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


def top_k_filter(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the k most likely tokens (ties with the k-th too), renormalized, as transformers' TopKLogitsWarper
    leaves them for top-p; unchanged for k <= 0."""
    if top_k <= 0 or top_k >= probs.shape[-1]:
        return probs
    kept = probs * (probs >= probs.topk(top_k).values[-1])
    return kept / kept.sum()


def min_p_filter(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Zero the tokens less likely than min_p times the most likely one (transformers' MinPLogitsWarper)."""
    if min_p <= 0:
        return probs
    return probs * (probs >= probs.max() * min_p)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a token is drawn from, from (penalized) logits [V], in transformers' order: temperature,
    top-k, top-p, min-p. Float64, not renormalized after the last filter (torch.multinomial needs no sum of 1)."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    return min_p_filter(top_p_filter(top_k_filter(probs, params.top_k), params.top_p), params.min_p)


def sample_row(logits: torch.Tensor, params: SamplingParams, position: int, history: History | None = None,
               constraint: Constraint | None = None) -> int:
    """The next token of one sequence from its logits [V] (and the tokens it has seen, for its penalties; its
    grammar's matcher, which then allows only some tokens)."""
    if params.penalties.active:
        logits = apply_penalties(logits, params.penalties, history)
    if constraint is not None:
        logits = constraint.apply(logits)
    if params.greedy:
        return int(logits.argmax())
    generator = torch.Generator().manual_seed(position_seed(params.seed, position))
    return int(torch.multinomial(sampling_probs(logits, params), 1, generator=generator))


def all_greedy(params: list[SamplingParams]) -> bool:
    """Whether every row's token is the plain argmax of its logits (no penalty, no grammar changes them)."""
    return all(p.greedy and not p.penalties.active and p.grammar is None for p in params)


def sample_next(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                histories: list[History | None] | None = None,
                constraints: list[Constraint | None] | None = None) -> torch.Tensor:
    """Next tokens [B] from logits [B, V]; row b uses params[b], its absolute position positions[b] and, for its
    penalties, histories[b], for its grammar constraints[b]."""
    if all_greedy(params):
        return logits.argmax(-1)
    batch = logits.shape[0]
    rows, matchers = histories or [None] * batch, constraints or [None] * batch
    return torch.tensor([sample_row(logits[b], params[b], positions[b], rows[b], matchers[b]) for b in range(batch)])


def start_histories(context: torch.Tensor, mask: torch.Tensor, params: list[SamplingParams], vocab: int
                    ) -> list[History | None]:
    """Each row's History (None where its penalties need none) from the left-padded input [B, T] and its mask."""
    return [History(context[b][mask[b].bool()].tolist(), p.earlier_tokens, vocab) if p.penalties.needs_history
            else None for b, p in enumerate(params)]


def start_constraints(context: torch.Tensor, params: list[SamplingParams]) -> list[Constraint | None]:
    """Each row's Constraint (None where it has no grammar), past its output from before a resume (the last
    `earlier_tokens` of its left-padded input [B, T])."""
    return [None if p.grammar is None else
            Constraint(p.grammar, context[b, context.shape[1] - p.earlier_tokens:].tolist() if p.earlier_tokens else ())
            for b, p in enumerate(params)]
