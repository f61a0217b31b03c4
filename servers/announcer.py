"""Announcing a server's blocks on the DHT: periodically, on every state change, and OFFLINE on shutdown."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from servers.status import ServerStatus
from swarmnet.data_structures import MAX_RECORD_TTL, ServerInfo, ServerState, block_uid

logger = logging.getLogger(__name__)


class Announcer:
    """Keeps `{model_id}.{i}` -> {peer_id: ServerInfo} fresh for each served block i, read from `status()`."""

    def __init__(self, node: DHTNode, *, status: Callable[[], ServerStatus], update_period: float) -> None:
        self.node, self.status, self.update_period = node, status, update_period
        if self.expiration > MAX_RECORD_TTL:
            raise ValueError(f"records of a {update_period:g} s period would live {self.expiration:g} s; "
                             f"peers refuse more than {MAX_RECORD_TTL:g} s")
        self._task: asyncio.Task[None] | None = None

    @property
    def expiration(self) -> float:
        """Records live two periods, so one lost refresh does not make the server vanish (at most MAX_RECORD_TTL)."""
        return max(2 * self.update_period, 10.0)

    async def announce(self) -> bool:
        """Store the current status's record under every served block key; returns whether every store succeeded."""
        info = self.status().announcement()
        return await self._store(info, range(info.start, info.end))

    async def withdraw(self, start: int, end: int) -> bool:
        """Store an OFFLINE record of span [start, end) under the blocks of it that the current status no longer
        announces (a server moving away), so that nobody counts on them until the old records expire."""
        info = self.status().announcement()
        left = [i for i in range(start, end) if not info.start <= i < info.end]
        return await self._store(info.model_copy(update={"state": ServerState.OFFLINE, "start": start, "end": end}),
                                 left)

    async def _store(self, info: ServerInfo, blocks: Sequence[int]) -> bool:
        status = self.status()
        keys = [block_uid(status.model_id, i) for i in blocks]
        if not keys:
            return True
        expiration = get_dht_time() + self.expiration
        # hivemind (1.1.12) sends each key's records in a store request of their own: one record per request here,
        # far within what nodes accept (dht_wire.MAX_STORE_RECORDS)
        results = await self.node.store_many(keys, [info.to_wire()] * len(keys), expiration,
                                             subkeys=[status.peer_id] * len(keys))
        ok = all(results.values())
        logger.debug("Announced %s for blocks %s (%s)", info.state.value, f"{keys[0]}..{keys[-1]}",
                     "ok" if ok else "partly failed")
        return ok

    def start(self) -> None:
        """Begin periodic re-announcement."""
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.update_period)
            try:
                await self.announce()
            except Exception:  # a DHT hiccup must not kill the server; the next period retries
                logger.warning("Announcement failed", exc_info=True)

    async def stop(self) -> None:
        """Stop the periodic task."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
