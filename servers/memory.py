"""KV-cache budget: sessions reserve their worst case up front, so an admitted session never runs out; one caller
may reserve at most a share of it, except that a caller alone on the server may borrow more (all but a reserve)
while nobody else wants it, and gives it back once another caller is refused room (lending: CacheBudget). An owner
is a member of the swarm (servers/access.py), not a peer id."""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from servers.errors import RequestRejected
from swarmnet.protocol import ErrorCode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheUse:
    """A budget read at one moment, so the figures derived from it agree with each other."""

    used: int        # block-tokens reserved
    limit: int       # block-tokens admitted (--attn-cache-tokens x blocks)
    num_blocks: int
    owner_limit: int = 0  # block-tokens one caller may reserve (its share of `limit`)
    lending: bool = False  # lending now: one caller alone here may reserve up to `lend_limit`
    lend_limit: int = 0    # block-tokens a caller alone may reserve while lending (all but the reserve)
    lends: bool = False    # whether this server lends at all (--lend-idle-cache)

    @property
    def tokens_left(self) -> int:
        """Tokens per block still free (what a session over the whole span could reserve)."""
        return (self.limit - self.used) // self.num_blocks

    @property
    def tokens_per_caller(self) -> int:
        """Tokens per block one caller may reserve now, all its sessions together: its share of the budget, or the
        budget less its reserve while the server lends it (no other caller holds or was refused cache lately)."""
        return (self.lend_limit if self.lending else self.owner_limit) // self.num_blocks

    @property
    def most_per_caller(self) -> int:
        """Tokens per block one caller could ever reserve here (alone, while lent): a session that needs more is
        refused whatever happens, so a client can fail such a request at once instead of waiting for room."""
        return (max(self.owner_limit, self.lend_limit) if self.lends else self.owner_limit) // self.num_blocks


@dataclass
class _Reservation:
    owner: str   # the caller (peer id) whose session it is
    tokens: int  # block-tokens


# after a refusal that lending caused, callers are held to their share for this long (a job's session lasts seconds
# to minutes: the borrower's sessions end and the refused caller, retrying, finds its share free)
CONTENTION_SECONDS = 120.0
# the part of the budget never lent: a newcomer's first sessions (an interactive generate) find room at once
LENDING_RESERVE = 0.25


class CacheBudget:
    """Counts block-tokens (tokens cached in one block) reserved by open sessions against a limit; each owner (the
    calling peer) may hold at most `owner_share` of the limit.

    With `lend`, an owner alone on the server (no other owner holds a reservation) may borrow past its share, up to
    all but LENDING_RESERVE of the limit: one batch job's worker uses 3/4 of the cache instead of half, and a
    newcomer's first sessions still find room at once. When another owner is then refused for lack of room while
    someone holds more than a share, lending stops for `CONTENTION_SECONDS`: the borrower's new sessions are held to
    its share, and what it holds beyond it (`borrowers`) is taken back (the handler ends its newest sessions after a
    grace period, unless they ended by then), so the refused owner gets in on a retry."""

    def __init__(self, tokens_per_block: int, num_blocks: int, *, owner_share: float = 1.0, lend: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = tokens_per_block * num_blocks
        self.num_blocks = num_blocks
        self.owner_limit = int(self.limit * owner_share)
        self.lend_limit = max(self.owner_limit, self.limit - int(self.limit * LENDING_RESERVE))
        self.lend, self.clock = lend, clock
        self.contended_until = -math.inf  # no lending before this (clock seconds)
        self._reserved: dict[str, _Reservation] = {}

    @property
    def used(self) -> int:
        """Block-tokens reserved now."""
        return sum(r.tokens for r in self._reserved.values())

    def used_by(self, owner: str) -> int:
        """Block-tokens reserved now by one owner's sessions."""
        return sum(r.tokens for r in self._reserved.values() if r.owner == owner)

    def owners(self) -> set[str]:
        """The callers holding a reservation now."""
        return {r.owner for r in self._reserved.values()}

    def use(self) -> CacheUse:
        """The budget now, as one reading."""
        return CacheUse(self.used, self.limit, self.num_blocks, self.owner_limit,
                        lending=len(self.owners()) <= 1 and self._lending(), lend_limit=self.lend_limit,
                        lends=self.lend)

    def _lending(self) -> bool:
        return self.lend and self.clock() >= self.contended_until

    def limit_for(self, owner: str) -> int:
        """Block-tokens `owner` may hold now: `lend_limit` while it is alone here and lending is on, else its share."""
        return self.lend_limit if self.owners() <= {owner} and self._lending() else self.owner_limit

    def tokens_for(self, owner: str) -> int:
        """Tokens per block `owner` may still reserve now, all its new sessions together (the `info` answer's
        `cache_tokens_for_caller`): what it may hold less what it holds, within the free cache."""
        room = min(self.limit - self.used, self.limit_for(owner) - self.used_by(owner))
        return max(0, room) // self.num_blocks

    def reserve(self, session_id: str, *, owner: str, batch_size: int, max_length: int, num_blocks: int) -> None:
        """Reserve a session's cache; raises RequestRejected: CACHE_FULL if it does not fit now, BUSY if it would
        take its owner past what it may hold (its share, or what it is lent while alone)."""
        need = batch_size * max_length * num_blocks
        if need > self.limit - self.used:
            self._note_contention(owner)
            raise RequestRejected(ErrorCode.CACHE_FULL,
                                  f"session needs {need} block-tokens, {self.limit - self.used} of {self.limit} free")
        held, may_hold = self.used_by(owner), self.limit_for(owner)
        if held + need > may_hold:
            raise RequestRejected(ErrorCode.BUSY,
                                  f"session needs {need} block-tokens and this caller holds {held} of the "
                                  f"{may_hold} one caller may reserve here; close a session or use another server")
        self._reserved[session_id] = _Reservation(owner, need)

    def _note_contention(self, refused: str) -> None:
        """A caller found no room: if another holds more than a share (it borrowed), stop lending for a while."""
        if any(self.used_by(owner) > self.owner_limit for owner in self.owners() - {refused}):
            self.contended_until = self.clock() + CONTENTION_SECONDS
            logger.info("Cache lent to one caller is wanted by another: each caller is held to its share for %.0f s",
                        CONTENTION_SECONDS)

    def borrowers(self) -> dict[str, int]:
        """While lending is stopped (another caller was refused room): each owner holding more than its share, and
        by how many block-tokens; they give it back (servers/handler.py ends their newest sessions)."""
        if self._lending():
            return {}
        over = {owner: self.used_by(owner) - self.owner_limit for owner in self.owners()}
        return {owner: excess for owner, excess in over.items() if excess > 0}

    def held(self, session_id: str) -> int:
        """Block-tokens one session reserves now (0 once released)."""
        reservation = self._reserved.get(session_id)
        return 0 if reservation is None else reservation.tokens

    def shrink(self, session_id: str, *, batch_size: int, max_length: int, num_blocks: int) -> None:
        """Lower a session's reservation to a smaller batch (after it dropped rows); never raises it."""
        reservation = self._reserved.get(session_id)
        if reservation is not None:
            reservation.tokens = min(reservation.tokens, batch_size * max_length * num_blocks)

    def release(self, session_id: str) -> None:
        """Free a session's reservation (idempotent)."""
        self._reserved.pop(session_id, None)
