"""KV-cache budget: sessions reserve their worst case up front, so an admitted session never runs out; one caller
may reserve at most a share of it."""
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
    owner_limit: int = 0  # block-tokens one caller may reserve (its share of `limit`)

    @property
    def tokens_left(self) -> int:
        """Tokens per block still free (what a session over the whole span could reserve)."""
        return (self.limit - self.used) // self.num_blocks

    @property
    def tokens_per_caller(self) -> int:
        """Tokens per block one caller may reserve, all its sessions together (its share of the budget)."""
        return self.owner_limit // self.num_blocks


@dataclass
class _Reservation:
    owner: str   # the caller (peer id) whose session it is
    tokens: int  # block-tokens


class CacheBudget:
    """Counts block-tokens (tokens cached in one block) reserved by open sessions against a limit; each owner (the
    calling peer) may hold at most `owner_share` of the limit."""

    def __init__(self, tokens_per_block: int, num_blocks: int, *, owner_share: float = 1.0) -> None:
        self.limit = tokens_per_block * num_blocks
        self.num_blocks = num_blocks
        self.owner_limit = int(self.limit * owner_share)
        self._reserved: dict[str, _Reservation] = {}

    @property
    def used(self) -> int:
        """Block-tokens reserved now."""
        return sum(r.tokens for r in self._reserved.values())

    def used_by(self, owner: str) -> int:
        """Block-tokens reserved now by one owner's sessions."""
        return sum(r.tokens for r in self._reserved.values() if r.owner == owner)

    def use(self) -> CacheUse:
        """The budget now, as one reading."""
        return CacheUse(self.used, self.limit, self.num_blocks, self.owner_limit)

    def reserve(self, session_id: str, *, owner: str, batch_size: int, max_length: int, num_blocks: int) -> None:
        """Reserve a session's cache; raises RequestRejected: CACHE_FULL if it does not fit now, BUSY if it would
        take its owner past its share."""
        need = batch_size * max_length * num_blocks
        if need > self.limit - self.used:
            raise RequestRejected(ErrorCode.CACHE_FULL,
                                  f"session needs {need} block-tokens, {self.limit - self.used} of {self.limit} free")
        held = self.used_by(owner)
        if held + need > self.owner_limit:
            raise RequestRejected(ErrorCode.BUSY,
                                  f"session needs {need} block-tokens and this caller holds {held} of the "
                                  f"{self.owner_limit} one caller may reserve here; close a session or use another server")
        self._reserved[session_id] = _Reservation(owner, need)

    def shrink(self, session_id: str, *, batch_size: int, max_length: int, num_blocks: int) -> None:
        """Lower a session's reservation to a smaller batch (after it dropped rows); never raises it."""
        reservation = self._reserved.get(session_id)
        if reservation is not None:
            reservation.tokens = min(reservation.tokens, batch_size * max_length * num_blocks)

    def release(self, session_id: str) -> None:
        """Free a session's reservation (idempotent)."""
        self._reserved.pop(session_id, None)
