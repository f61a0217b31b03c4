"""`Rebalancer`: the watch of a server that was not pinned; every period it reads the members' coverage and moves
the server's span when the rules of servers/rebalancing.py say it is its turn."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from servers.rebalancing import Move, holder_of, holders_of, plan, turn
from servers.status import ServerStatus
from swarmnet.discovery import get_remote_module_infos

logger = logging.getLogger(__name__)
JITTER = 0.25  # each wait is the period times a random factor in [1 - JITTER, 1 + JITTER]: servers drift apart


class Rebalancer:
    """Checks coverage every `period` seconds (jittered) and awaits `move(move)` when this server should move."""

    def __init__(self, node: DHTNode, *, status: Callable[[], ServerStatus], num_blocks: int,
                 allows: Callable[[str], bool], move: Callable[[Move], Awaitable[bool]], period: float,
                 quality: float, cooldown: float) -> None:
        self.node, self.status, self.num_blocks, self.allows, self.move = node, status, num_blocks, allows, move
        self.period, self.quality, self.cooldown = period, quality, cooldown
        self.waited = 0  # rounds in a row in which this server was a candidate and another one's turn came first
        self.failures = 0  # moves in a row that failed (e.g. the new span did not fit): each doubles the pause
        self.paused_until = 0.0  # no move before this DHT time, after a failed one
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start watching in the background."""
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop watching (a move under way is abandoned where it is)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period * random.uniform(1 - JITTER, 1 + JITTER))
            try:
                await self.check()
            except Exception as e:  # a DHT read failed, or a move did: the next round looks again
                logger.warning("Coverage check failed: %s: %s", type(e).__name__, e)

    async def check(self) -> Move | None:
        """One round: read the coverage, plan, and move if it is this server's turn; returns the move made."""
        if get_dht_time() < self.paused_until:
            return None
        status = self.status()
        infos = await get_remote_module_infos(self.node, status.model_id, self.num_blocks)
        me = holder_of(status.peer_id, status.announcement())  # what we are now, whatever the DHT still says
        holders = [h for h in holders_of(infos, self.allows) if h.peer_id != me.peer_id] + [me]
        planned = plan(holders, self.num_blocks, quality=self.quality, cooldown=self.cooldown, now=get_dht_time())
        move = turn(planned, me.peer_id, self.waited)
        self.waited = self.waited + 1 if move is None and any(m.peer_id == me.peer_id for m in planned) else 0
        if move is not None and not await self.move(move):
            self.failures += 1
            self.paused_until = get_dht_time() + self.cooldown * 2 ** (self.failures - 1)
            logger.warning("Moves paused for %.0f s after %d failed in a row", self.paused_until - get_dht_time(),
                           self.failures)
            return None
        if move is not None:
            self.failures = 0
        return move
