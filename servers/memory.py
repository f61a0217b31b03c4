"""KV-cache budget: sessions reserve their worst case up front, so an admitted session never runs out."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from servers.errors import RequestRejected
from swarmclient.protocol import ErrorCode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheUse:
    """A budget read at one moment, so the figures derived from it agree with each other."""

    used: int        # block-tokens reserved
    limit: int       # block-tokens admitted (--attn-cache-tokens x blocks)
    num_blocks: int

    @property
    def tokens_left(self) -> int:
        """Tokens per block still free (what a session over the whole span could reserve)."""
        return (self.limit - self.used) // self.num_blocks


class CacheBudget:
    """Counts block-tokens (tokens cached in one block) reserved by open sessions against a limit."""

    def __init__(self, tokens_per_block: int, num_blocks: int) -> None:
        self.limit = tokens_per_block * num_blocks
        self.num_blocks = num_blocks
        self._reserved: dict[str, int] = {}

    @property
    def used(self) -> int:
        """Block-tokens reserved now."""
        return sum(self._reserved.values())

    def use(self) -> CacheUse:
        """The budget now, as one reading."""
        return CacheUse(self.used, self.limit, self.num_blocks)

    def reserve(self, session_id: str, *, batch_size: int, max_length: int, num_blocks: int) -> None:
        """Reserve a session's cache; raises RequestRejected(CACHE_FULL) if it does not fit now."""
        need = batch_size * max_length * num_blocks
        if need > self.limit - self.used:
            raise RequestRejected(ErrorCode.CACHE_FULL,
                                  f"session needs {need} block-tokens, {self.limit - self.used} of {self.limit} free")
        self._reserved[session_id] = need

    def shrink(self, session_id: str, *, batch_size: int, max_length: int, num_blocks: int) -> None:
        """Lower a session's reservation to a smaller batch (after it dropped rows); never raises it."""
        if session_id in self._reserved:
            self._reserved[session_id] = min(self._reserved[session_id], batch_size * max_length * num_blocks)

    def release(self, session_id: str) -> None:
        """Free a session's reservation (idempotent)."""
        self._reserved.pop(session_id, None)
