"""Counters of what a server did: requests, tokens and errors by code."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace


@dataclass
class ServerCounters:
    """Cumulative counters since start-up."""

    steps: int = 0
    tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    merged_steps: int = 0     # forwards that merged decode steps of several sessions
    merged_sessions: int = 0  # session steps served by those forwards
    merged_rows: int = 0      # batch rows of those forwards
    max_merged: int = 0       # the most sessions one forward merged

    def record_step(self, *, tokens: int) -> None:
        """Count one computed step of `tokens` tokens (batch x length)."""
        self.steps += 1
        self.tokens += tokens

    def record_error(self, code: str) -> None:
        """Count one rejected or failed request."""
        self.errors[code] += 1

    def record_merge(self, *, sessions: int, rows: int) -> None:
        """Count one forward that merged `sessions` sessions' decode steps (`rows` rows in all)."""
        self.merged_steps += 1
        self.merged_sessions += sessions
        self.merged_rows += rows
        self.max_merged = max(self.max_merged, sessions)

    def copy(self) -> ServerCounters:
        """An independent copy: a reading that later requests do not change."""
        return replace(self, errors=Counter(self.errors))
