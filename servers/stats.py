"""Counters of what a server did: requests, tokens and errors by code."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ServerStats:
    """Cumulative counters since start-up."""

    steps: int = 0
    tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)

    def record_step(self, *, tokens: int) -> None:
        """Count one computed step of `tokens` tokens (batch x length)."""
        self.steps += 1
        self.tokens += tokens

    def record_error(self, code: str) -> None:
        """Count one rejected or failed request."""
        self.errors[code] += 1
