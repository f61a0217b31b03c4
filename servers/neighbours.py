"""`NextServerPings`: this server's round trips to the servers that may follow it in a chain, for push routing.

With server-to-server push a chain's latency is mostly its links between servers, which a client cannot measure.
So each server pings (the `info` RPC, the best of a few) the members that hold the block right after its span and
reports the round trips in its `info` answer (`next_rtts`: {peer id: seconds}); clients route on them, held to the
triangle inequality on their own pings (swarmclient/routing.py `link_rtt`).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID

from swarmnet import protocol
from swarmnet.data_structures import ServerState
from swarmnet.discovery import get_remote_module_infos

logger = logging.getLogger(__name__)
PING_PERIOD = 10.0  # seconds between rounds (servers join and leave; a round costs a few `info` calls)
PINGS = 3  # calls per server and round; the fastest counts (one may wait behind a compute)
MAX_NEXT = 32  # servers pinged per round
PING_TIMEOUT = 5.0
ROUND_TRIPS_LINE = "Round trips to the servers after this span"  # logged with the count when the set changes


class NextServerPings:
    """Measures, every PING_PERIOD, the round trip to each member server holding block `end` (ours ends there)."""

    def __init__(self, p2p: P2P, node: DHTNode, *, model_id: str, num_blocks: int, end: int,
                 allows: Callable[[str], bool]) -> None:
        self.p2p, self.node, self.model_id, self.num_blocks, self.end = p2p, node, model_id, num_blocks, end
        self.allows = allows
        self.rtts: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start measuring in the background (nothing to measure for the last blocks of the model)."""
        if self.end < self.num_blocks:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop measuring."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                await self.measure()
            except Exception as e:  # a DHT read or ping round failed: the next round tries again
                logger.info("Measuring the next servers' round trips failed: %s: %s", type(e).__name__, e)
            await asyncio.sleep(PING_PERIOD)

    async def measure(self) -> None:
        """One round: read who holds block `end`, ping each, keep the fastest of PINGS calls."""
        infos = await get_remote_module_infos(self.node, self.model_id, self.num_blocks)
        me = self.p2p.peer_id.to_base58()
        peers = [peer for peer, info in infos[self.end].items()
                 if info.state is ServerState.ONLINE and peer != me and self.allows(peer)][:MAX_NEXT]
        results = await asyncio.gather(*(self._best_ping(peer) for peer in peers), return_exceptions=True)
        rtts = {peer: rtt for peer, rtt in zip(peers, results, strict=True) if isinstance(rtt, float)}
        if rtts.keys() != self.rtts.keys():  # who follows us changed: say so once, not every round
            logger.info("%s %d: %s", ROUND_TRIPS_LINE, len(rtts),
                        ", ".join(f"{peer[-6:]} {rtt * 1000:.1f} ms" for peer, rtt in sorted(rtts.items())) or "none")
        self.rtts = rtts

    async def _best_ping(self, peer: str) -> float:
        return min([await self._ping(peer) for _ in range(PINGS)])

    async def _ping(self, peer: str) -> float:
        began = time.perf_counter()
        async with asyncio.timeout(PING_TIMEOUT):
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), protocol.RPC_INFO)
            try:
                protocol.write_frame(writer, protocol.encode([], {}))
                await writer.drain()
                await protocol.read_frame(reader, 1 << 20)
            finally:
                writer.close()
        return time.perf_counter() - began
