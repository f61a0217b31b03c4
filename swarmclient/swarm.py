"""`Swarm`: a client's live view of one model's servers — DHT reads, pings, bans and routes."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import torch
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from swarmclient import protocol
from swarmclient.config import ClientConfig
from swarmclient.data_structures import RemoteSpanInfo, RouteHop
from swarmclient.discovery import BlockServers, get_remote_module_infos, online_spans
from swarmclient.errors import InvalidRequest, MissingBlocksError, PeerFailed
from swarmclient.network import LoopThread, NetworkOptions, start_dht_node
from swarmclient.retry import BanList
from swarmclient.routing import min_latency_route, missing_ranges

logger = logging.getLogger(__name__)


class Swarm:
    """Connection to the swarm serving one model: owns a P2P node, a DHT client node and an event loop."""

    def __init__(self, p2p: P2P, node: DHTNode, loop: LoopThread, *, model_id: str, num_blocks: int,
                 config: ClientConfig) -> None:
        self.p2p, self.node, self.loop = p2p, node, loop
        self.model_id, self.num_blocks, self.config = model_id, num_blocks, config
        self.bans = BanList(config.ban_timeout, config.max_ban_timeout)
        self.rtts: dict[str, float] = {}
        self._block_infos: list[BlockServers] | None = None
        self._read_at = 0.0

    @classmethod
    def connect(cls, initial_peers: Sequence[str], *, model_id: str, num_blocks: int,
                config: ClientConfig | None = None, network: NetworkOptions | None = None) -> Swarm:
        """Join the DHT as a client (raises DHTUnreachable if no initial peer answers)."""
        loop = LoopThread()
        try:
            p2p, node = loop.run(start_dht_node(initial_peers, network or NetworkOptions(), client_mode=True))
        except BaseException:
            loop.stop()
            raise
        return cls(p2p, node, loop, model_id=model_id, num_blocks=num_blocks, config=config or ClientConfig())

    def close(self) -> None:
        """Leave the DHT and stop the P2P daemon and the loop."""
        async def _shutdown() -> None:
            await self.node.shutdown()
            await self.p2p.shutdown()
        try:
            self.loop.run(_shutdown(), timeout=10)
        finally:
            self.loop.stop()

    async def block_infos(self, *, refresh: bool = False) -> list[BlockServers]:
        """Per block, the servers announcing it; reuses a read younger than `discovery_ttl`."""
        if refresh or self._block_infos is None or time.monotonic() - self._read_at > self.config.discovery_ttl:
            self._block_infos = await get_remote_module_infos(self.node, self.model_id, self.num_blocks)
            self._read_at = time.monotonic()
        return self._block_infos

    async def route(self, start: int, end: int) -> list[RouteHop]:
        """A route over blocks [start, end) avoiding banned peers; raises MissingBlocksError if uncovered."""
        for refresh in (False, True):
            spans = [s for s in online_spans(await self.block_infos(refresh=refresh))
                     if not self.bans.is_banned(s.peer_id)]
            await self._ping_unknown(spans, start, end)
            route = min_latency_route(spans, start, end, rtts=self.rtts, banned=self.bans.banned())
            if route is not None:
                logger.info("Route %d:%d via %s", start, end,
                            ", ".join(f"{h.start}:{h.end}@{h.peer_id[-6:]}" for h in route))
                return route
        usable = [s for s in online_spans(await self.block_infos()) if not self.bans.is_banned(s.peer_id)]
        raise MissingBlocksError(self.model_id, missing_ranges(usable, start, end))

    async def _ping_unknown(self, spans: list[RemoteSpanInfo], start: int, end: int) -> None:
        """Measure round trips to servers on [start, end) that we have not pinged yet; ban the silent ones."""
        todo = [s.peer_id for s in spans if s.peer_id not in self.rtts and s.end > start and s.start < end]
        results = await asyncio.gather(*(self.ping(peer) for peer in todo), return_exceptions=True)
        for peer, result in zip(todo, results, strict=True):
            if isinstance(result, BaseException):
                logger.info("Ping of %s failed (%s); banning it", peer[-6:], result)
                self.bans.ban(peer)

    async def ping(self, peer_id: str) -> float:
        """Round-trip seconds of an `info` call to a server; raises PeerFailed."""
        began = time.perf_counter()
        await self.call_info(peer_id)
        rtt = time.perf_counter() - began
        self.rtts[peer_id] = rtt
        return rtt

    async def call_info(self, peer_id: str) -> dict[str, object]:
        """The server's `info` RPC: its span, limits and load."""
        request = protocol.make_request([], {})
        try:
            response = await asyncio.wait_for(
                self.p2p.call_protobuf_handler(PeerID.from_base58(peer_id), protocol.RPC_INFO, request,
                                               runtime_pb2.ExpertResponse),
                timeout=self.config.connect_timeout)
        except Exception as e:
            raise PeerFailed(peer_id, f"info failed: {type(e).__name__}: {e}") from e
        return protocol.read_message(response)[1]

    async def call_forward(self, peer_id: str, start: int, end: int, hidden: torch.Tensor, attention_mask: torch.Tensor,
                           position_ids: torch.Tensor) -> torch.Tensor:
        """The server's stateless `forward` RPC: whole sequences [B, L, H] through blocks [start, end).

        Raises PeerFailed when the server fails or refuses, and InvalidRequest when it calls the request malformed.
        """
        request = protocol.make_request([hidden.float().contiguous(), attention_mask.long(), position_ids.long()],
                                        {"start": start, "end": end})
        tokens = hidden.shape[0] * hidden.shape[1]
        try:
            response = await asyncio.wait_for(
                self.p2p.call_protobuf_handler(PeerID.from_base58(peer_id), protocol.RPC_FORWARD, request,
                                               runtime_pb2.ExpertResponse),
                timeout=self.config.step_timeout + self.config.step_timeout_per_token * tokens)
            tensors, meta = protocol.read_message(response)
        except Exception as e:
            raise PeerFailed(peer_id, f"forward failed: {type(e).__name__}: {e}") from e
        error = protocol.response_error(meta)
        if error is not None:
            code, message = error
            if code.retryable:
                raise PeerFailed(peer_id, f"{code.value}: {message}")
            raise InvalidRequest(f"server {peer_id[-8:]} refused a forward: {code.value}: {message}")
        if len(tensors) != 1 or tensors[0].shape != hidden.shape:
            raise PeerFailed(peer_id, f"a forward answer of shapes {[tuple(t.shape) for t in tensors]} "
                                      f"to {tuple(hidden.shape)}")
        return tensors[0]
