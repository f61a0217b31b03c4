"""Penalties and biases on one sequence's logits, before temperature: what OpenAI and vLLM apply, in their order.

- `logit_bias` (OpenAI): a bias per token id, added to its logit.
- `repetition_penalty` (vLLM, transformers' RepetitionPenaltyLogitsProcessor): every token seen so far, prompt and
  output alike, has its logit divided by the penalty when positive, multiplied by it when negative.
- `frequency_penalty`, `presence_penalty` (OpenAI): `logit[j] -= count[j] * frequency + (count[j] > 0) * presence`,
  where count[j] is how often token j was generated so far (the prompt does not count).

The counts come from token ids only (`History`), so a request resumed from its stored generated ids penalizes
exactly as the run that was interrupted.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Penalties:
    """The penalties and biases of one sequence; the defaults change nothing."""

    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])

    def __post_init__(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias must map token ids >= 0 to biases in [-100, 100], got {token}: {bias}")

    @property
    def active(self) -> bool:
        """Whether any of them changes the logits."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1
                    or self.logit_bias)

    @property
    def needs_history(self) -> bool:
        """Whether they depend on the tokens seen so far (a bias alone does not)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1)


class History:
    """The tokens one sequence has seen: the prompt and its output so far (`earlier` of the context's last tokens
    are output from before a resume), kept as per-token counts over the vocabulary."""

    def __init__(self, context: Sequence[int], earlier: int, vocab: int) -> None:
        ids = torch.tensor(list(context), dtype=torch.long)
        self.seen = torch.zeros(vocab, dtype=torch.bool)
        self.seen[ids[ids < vocab]] = True
        output = ids[len(ids) - earlier:] if earlier else ids[:0]
        self.generated = torch.bincount(output[output < vocab], minlength=vocab).to(torch.float32)

    def add(self, token: int) -> None:
        """Count one newly generated token."""
        if 0 <= token < self.generated.shape[0]:
            self.seen[token] = True
            self.generated[token] += 1


def apply_penalties(logits: torch.Tensor, penalties: Penalties, history: History | None) -> torch.Tensor:
    """The logits [V] after the bias and the penalties (a new float32 tensor; `logits` is left as it is)."""
    shaped = logits.float().clone()
    for token, bias in penalties.logit_bias:
        if token < shaped.shape[0]:
            shaped[token] += bias
    if history is None:
        return shaped
    if penalties.repetition_penalty != 1:
        seen = shaped[history.seen]
        shaped[history.seen] = torch.where(seen < 0, seen * penalties.repetition_penalty,
                                           seen / penalties.repetition_penalty)
    counts = history.generated
    return shaped - counts * penalties.frequency_penalty - (counts > 0).float() * penalties.presence_penalty
