"""`Swarm`: a client's live view of one model's servers — DHT reads, pings, bans and routes."""
from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID

from swarmclient.config import ClientConfig
from swarmclient.errors import InvalidRequest, MissingBlocksError, NoRoom, PeerFailed, SwarmBusy, Unauthorized
from swarmclient.retry import BanList
from swarmclient.routing import (
    has_room,
    machine_loads,
    min_latency_route,
    missing_ranges,
    pushed_route,
    trusted_throughput,
)
from swarmnet import protocol
from swarmnet.addresses import NetworkOptions
from swarmnet.data_structures import RemoteSpanInfo, RouteHop
from swarmnet.discovery import BlockServers, get_remote_module_infos, online_spans
from swarmnet.membership import ADD_MEMBER, NotAMember, SwarmAccess
from swarmnet.network import LoopThread, start_dht_node
from swarmnet.protocol import ErrorCode
from swarmnet.relays import RELAY_CONNECTION_CAP, RelayRole

logger = logging.getLogger(__name__)


class SessionHolder(Protocol):
    """What holds server sessions of this client (an inference session): routing counts them as those servers' load."""

    def held_peers(self) -> list[str]:
        """The peer id of each server session held or being opened (one entry per session)."""


class Swarm:
    """Connection to the swarm serving one model: owns a P2P node, a DHT client node and an event loop."""

    def __init__(self, p2p: P2P, node: DHTNode, loop: LoopThread, *, model_id: str, num_blocks: int,
                 config: ClientConfig, access: SwarmAccess | None = None) -> None:
        self.p2p, self.node, self.loop = p2p, node, loop
        self.model_id, self.num_blocks, self.config = model_id, num_blocks, config
        self.access = access or SwarmAccess.open()
        self.bans = BanList(config.ban_timeout, config.max_ban_timeout)
        self.rtts: dict[str, float] = {}
        self.pinged_at: dict[str, float] = {}  # when each round trip in `rtts` was measured (time.monotonic)
        self.links: dict[tuple[str, str], float] = {}  # (server, a server after it) -> the round trip it reported
        self.claimed: dict[str, float] = {}   # throughput each pinged server gave in its own `info` answer
        self.observed: dict[str, float] = {}  # the best block-steps/s seen in decode steps through each server
        # sessions other callers held on each pinged server: its `info` answer's count less ours there, at the ping
        self.others: dict[str, int] = {}
        # this client's inference sessions that hold (or are opening) server sessions: routing counts them as load
        self.holders: weakref.WeakSet[SessionHolder] = weakref.WeakSet()
        self.refusals: dict[str, str] = {}  # servers that refused us as no member -> why (explains a failed route)
        self.full_until: dict[str, float] = {}  # servers that refused a session for lack of room -> until when to skip
        self.relayed: set[str] = set()  # servers reached through a circuit relay (their connections are capped)
        self._paths_checked: set[str] = set()
        self._forward_slots: dict[str, asyncio.Semaphore] = {}  # per server: this client's forwards in flight there
        self._block_infos: list[BlockServers] | None = None
        self._read_at = 0.0
        self._reading: asyncio.Future[list[BlockServers]] | None = None  # the DHT read in flight, shared by callers

    @classmethod
    def connect(cls, initial_peers: Sequence[str], *, model_id: str, num_blocks: int,
                config: ClientConfig | None = None, network: NetworkOptions | None = None,
                access: SwarmAccess | None = None) -> Swarm:
        """Join the DHT as a client (raises DHTUnreachable if no initial peer answers).

        access: the membership to route within and the member key to prove ours with (default: an open swarm).
        """
        loop = LoopThread()
        try:
            # a client dials servers behind NAT through their relays (swarmnet/relays.py)
            network = network or NetworkOptions(relay_role=RelayRole.dial)
            p2p, node = loop.run(start_dht_node(initial_peers, network, client_mode=True))
        except BaseException:
            loop.stop()
            raise
        return cls(p2p, node, loop, model_id=model_id, num_blocks=num_blocks, config=config or ClientConfig(),
                   access=access)

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
        """Per block, the servers announcing it; reuses a read younger than `discovery_ttl`, and shares a read in
        flight between callers (refresh: a read of its own, begun now)."""
        if refresh:
            return await self._read()
        fresh = self._fresh_block_infos()
        return fresh if fresh is not None else await asyncio.shield(self._read_soon())

    async def _read(self) -> list[BlockServers]:
        """One DHT read, kept as the last one unless a read begun after it was kept first (a shared read and a
        refresh may overlap): a read is as old as the moment it asked the DHT."""
        began = time.monotonic()
        infos = await get_remote_module_infos(self.node, self.model_id, self.num_blocks)
        if began >= self._read_at:
            self._block_infos, self._read_at = infos, began
        return infos

    def _read_soon(self) -> asyncio.Future[list[BlockServers]]:
        """The DHT read in flight, or a new one (a task: it runs on whether or not its callers wait)."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read())
            self._reading.add_done_callback(_log_failed_read)
        return self._reading

    def _fresh_block_infos(self) -> list[BlockServers] | None:
        """The last read if it is younger than `discovery_ttl`, else None."""
        if self._block_infos is None or time.monotonic() - self._read_at > self.config.discovery_ttl:
            return None
        return self._block_infos

    async def member_spans(self, *, refresh: bool = False) -> list[RemoteSpanInfo]:
        """The ONLINE spans of members only: the one place where non-members are dropped, before any ping."""
        return self._members(await self.block_infos(refresh=refresh))

    def fresh_member_spans(self) -> list[RemoteSpanInfo] | None:
        """`member_spans` of a DHT read younger than `discovery_ttl`, without waiting (None if there is none): for a
        decision that must not wait on the network. Where the last read is older, a new one starts beside, so that
        the next caller finds a fresh one. Call it on the swarm's event loop."""
        fresh = self._fresh_block_infos()
        if fresh is None:
            self._read_soon()
            return None
        return self._members(fresh)

    def _members(self, block_infos: list[BlockServers]) -> list[RemoteSpanInfo]:
        return [s for s in online_spans(block_infos) if self.access.membership.serves(s.peer_id)]

    def auth_meta(self) -> dict[str, bytes]:
        """What proves our membership to a server: {"credential": ...} (or nothing without a member key), for the
        meta of `info`, `forward` and a session's opening step."""
        credential = self.access.credential(self.p2p.peer_id.to_base58())
        return {} if credential is None else {"credential": credential}

    def ban(self, failure: PeerFailed) -> float:
        """Ban a failed server (returns the ban's seconds); a membership refusal is kept to explain a failed route.

        A server with no room for a session now (NoRoom) is not banned: routes skip it for `full_timeout` seconds."""
        if isinstance(failure, NoRoom):
            self.full_until[failure.peer_id] = time.monotonic() + self.config.full_timeout
            return self.config.full_timeout
        if isinstance(failure, Unauthorized):
            self.refusals[failure.peer_id] = failure.reason
        if failure.peer_id in self.relayed and type(failure) is PeerFailed:
            # not its fault: the relay reset the connection at its cap (swarmnet/relays.py); the retry dials a new
            # circuit and replays, and the retry limit still bounds a server that keeps failing
            logger.info("Server %s is reached through a relay, which resets a connection after %s; reconnecting",
                        failure.peer_id[-8:], RELAY_CONNECTION_CAP)
            return 0.0
        return self.bans.ban(failure.peer_id)

    async def note_path(self, peer_id: str) -> None:
        """Once per server, after a stream to it opened: remember whether we reach it through a relay."""
        if peer_id in self._paths_checked:
            return
        self._paths_checked.add(peer_id)
        for info in await self.p2p.list_peers():
            if info.peer_id.to_base58() == peer_id and any("p2p-circuit" in str(addr) for addr in info.addrs):
                self.relayed.add(peer_id)
                logger.info("Server %s is reached through a relay", peer_id[-8:])

    def _usable(self, span: RemoteSpanInfo) -> bool:
        """Neither banned nor just found full."""
        return not self.bans.is_banned(span.peer_id) and self.full_until.get(span.peer_id, 0.0) <= time.monotonic()

    async def route(self, start: int, end: int, *, session_tokens: int = 0) -> list[RouteHop]:
        """A route over blocks [start, end) avoiding banned peers; raises MissingBlocksError if uncovered, NotAMember
        if servers that refused us as no member would have covered it, SwarmBusy if servers that just refused us
        for lack of room would have.

        session_tokens: batch x max_length of the session the route is for. Servers whose records announce too
        little free cache for it are neither dialled nor used, unless no route exists without them (a record
        lags the server by up to one announce period; one that is really full refuses, and is banned).
        """
        for refresh in (False, True):
            spans = [s for s in await self.member_spans(refresh=refresh) if self._usable(s)]
            route = await self._cheapest_route(spans, start, end, session_tokens)
            if route is None and session_tokens:
                route = await self._cheapest_route(spans, start, end, 0)
            if route is not None:
                logger.info("Route %d:%d via %s", start, end,
                            ", ".join(f"{h.start}:{h.end}@{h.peer_id[-6:]}" for h in route))
                return route
        spans = await self.member_spans()
        usable = [s for s in spans if self._usable(s)]
        missing = missing_ranges(usable, start, end)
        refused = [s for s in spans if s.peer_id in self.refusals]
        if refused and missing_ranges(usable + refused, start, end) != missing:
            raise self._not_a_member(refused)
        full = [s for s in spans if not self.bans.is_banned(s.peer_id) and s.peer_id in self.full_until]
        if full and missing_ranges(usable + full, start, end) != missing:
            ranges = ", ".join(f"{a}:{b}" for a, b in missing)
            raise SwarmBusy(f"the servers of blocks {ranges} of {self.model_id} have no room for this session now "
                            f"(their KV cache, or this client's share of it, is taken); retry when sessions end")
        raise MissingBlocksError(self.model_id, missing)

    def _not_a_member(self, refused: list[RemoteSpanInfo]) -> NotAMember:
        key = self.access.identity
        fix = (f"add this key's peer id with '{ADD_MEMBER} SWARM_FILE {key.peer_id}' on the servers' swarm file"
               if key is not None else "pass --identity KEYFILE with a member key (one the servers' swarm file lists;"
               f" add one with '{ADD_MEMBER}')")
        peers = ", ".join(sorted({s.peer_id[-8:] for s in refused}))
        return NotAMember(f"not a member of the swarm: servers {peers} refused this client "
                          f"({self.refusals[refused[0].peer_id]}); {fix}")

    async def _cheapest_route(self, spans: list[RemoteSpanInfo], start: int, end: int, session_tokens: int
                              ) -> list[RouteHop] | None:
        """Ping the servers with room for the session that we have not pinged in `rtt_max_age`, then route through
        them. Where other servers could take some of its hops, the servers whose count of other callers' sessions may
        have moved the choice (the route's, and those other callers were using) are pinged again where that count is
        older than `load_max_age`, and the route is searched anew."""
        roomy = [s for s in spans if has_room(s, min(s.end, end) - max(s.start, start), session_tokens)
                 and s.end > start and s.start < end]
        await self._ping_older_than(self.config.rtt_max_age, [s.peer_id for s in roomy])
        route = self._search(roomy, start, end, session_tokens)
        if route is None or len({s.peer_id for s in roomy}) <= len({hop.peer_id for hop in route}):
            return route
        used = [hop.peer_id for hop in route] + [s.peer_id for s in roomy if self.others.get(s.peer_id)]
        if not await self._ping_older_than(self.config.load_max_age, used):
            return route
        return self._search(roomy, start, end, session_tokens)

    def _search(self, roomy: list[RemoteSpanInfo], start: int, end: int, session_tokens: int) -> list[RouteHop] | None:
        """The cheapest route over the servers with room, as the client knows them now (`routing`)."""
        loads = machine_loads(roomy, self.held_sessions(), self.others)
        if self.config.push:  # the links between servers count: servers report them in their info answers
            return pushed_route(roomy, start, end, rtts=self.rtts, links=self.links, banned=self.bans.banned(),
                                throughputs=self.trusted_throughputs(roomy), session_tokens=session_tokens,
                                loads=loads)
        return min_latency_route(roomy, start, end, rtts=self.rtts, banned=self.bans.banned(),
                                 throughputs=self.trusted_throughputs(roomy), session_tokens=session_tokens,
                                 loads=loads)

    def held_sessions(self) -> Counter[str]:
        """Per server (peer id), the server sessions this client's inference sessions hold or are opening there (other
        callers' sessions, as servers last answered our pings, are in `others`)."""
        return Counter(peer for holder in list(self.holders) for peer in holder.held_peers())

    def trusted_throughputs(self, spans: list[RemoteSpanInfo]) -> dict[str, float]:
        """Per server, the throughput routing believes: its record's, clamped to its info answer and our steps."""
        return {s.peer_id: trusted_throughput(s.info.throughput, self.claimed.get(s.peer_id),
                                              self.observed.get(s.peer_id)) for s in spans}

    def observe_step(self, peer_id: str, num_blocks: int, seconds: float) -> None:
        """Record a decode step through `num_blocks` blocks of a server that took `seconds` (network included)."""
        rate = num_blocks / max(seconds, 1e-6)
        if rate > self.observed.get(peer_id, 0.0):
            self.observed[peer_id] = rate

    async def _ping_older_than(self, seconds: float, peers: list[str]) -> list[str]:
        """Ping those of `peers` not pinged in the last `seconds` (round trip, claimed throughput, others' sessions)
        and ban the silent; returns the peers pinged."""
        oldest = time.monotonic() - seconds
        todo = list(dict.fromkeys(peer for peer in peers if self.pinged_at.get(peer, -math.inf) < oldest))
        results = await asyncio.gather(*(self.ping(peer) for peer in todo), return_exceptions=True)
        for peer, result in zip(todo, results, strict=True):
            if isinstance(result, BaseException):
                logger.info("Ping of %s failed (%s); banning it", peer[-6:], result)
                self.ban(result if isinstance(result, PeerFailed) else PeerFailed(peer, repr(result)))
        return todo

    async def ping(self, peer_id: str) -> float:
        """Round-trip seconds of an `info` call to a server; keeps the throughput it claims. Raises PeerFailed."""
        began = time.perf_counter()
        answer = await self.call_info(peer_id)
        rtt = time.perf_counter() - began
        self.rtts[peer_id], self.pinged_at[peer_id] = rtt, time.monotonic()
        claimed, sessions = answer.get("throughput"), answer.get("sessions")
        if isinstance(claimed, int | float) and not isinstance(claimed, bool):
            self.claimed[peer_id] = float(claimed)
        if isinstance(sessions, int) and not isinstance(sessions, bool):  # a count too high only repels callers
            self.others[peer_id] = max(0, sessions - self.held_sessions()[peer_id])
        self.links = {link: seconds for link, seconds in self.links.items() if link[0] != peer_id}  # its answer is news
        self.links.update(reported_links(peer_id, answer.get("next_rtts")))
        self.refusals.pop(peer_id, None)
        return rtt

    async def call_info(self, peer_id: str) -> dict[str, Any]:
        """The server's `info` RPC: its span, limits and load; raises PeerFailed (Unauthorized: not a member)."""
        _, meta = await self._call(peer_id, protocol.RPC_INFO, [protocol.encode([], self.auth_meta())],
                                   timeout=self.config.connect_timeout, max_answer=1 << 20)
        error = protocol.response_error(meta)
        if error is not None:
            code, message = error
            raise (Unauthorized if code is ErrorCode.UNAUTHORIZED else PeerFailed)(peer_id, f"{code.value}: {message}")
        return meta

    async def call_forward(self, peer_id: str, start: int, end: int, tensors: Sequence[torch.Tensor]
                           ) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """The server's stateless `forward` RPC of (hidden, attention_mask, position_ids) over blocks [start, end):
        (the answer's tensors, its meta).

        The header (the shape the server admits) goes first; the tensors follow once it is admitted. A refusal
        comes as an error in the meta (`protocol.response_error`), like a step's."""
        hidden = tensors[0]
        batch, length = hidden.shape[0], hidden.shape[1]
        header = {**self.auth_meta(), "start": start, "end": end, "batch_size": batch, "length": length,
                  "dtype": str(hidden.dtype).removeprefix("torch.")}
        timeout = self.config.step_timeout + self.config.step_timeout_per_token * batch * length
        # a server admits FORWARDS_PER_SERVER of one caller's forwards at once and refuses more as busy: the sessions
        # of this client (a job's lanes, their deferred checks) take turns here instead
        slot = self._forward_slots.setdefault(peer_id, asyncio.Semaphore(FORWARDS_PER_SERVER))
        async with slot:
            return await self._call(peer_id, protocol.RPC_FORWARD,
                                    [protocol.encode([], header), protocol.encode(list(tensors))],
                                    timeout=timeout, max_answer=batch * length * hidden.shape[-1] * 4 + (1 << 16))

    async def _call(self, peer_id: str, rpc: str, frames: list[bytes], *, timeout: float, max_answer: int
                    ) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """A request on a stream of its own: each message is sent once the one before it was answered, and a
        refusal ends it. (tensors, meta) of the last answer; raises PeerFailed if the server cannot be reached."""
        try:
            async with asyncio.timeout(timeout):
                _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), rpc)
                try:
                    for frame in frames:
                        protocol.write_frame(writer, frame)
                        await writer.drain()
                        tensors, meta = protocol.decode(await protocol.read_frame(reader, max_answer))
                        if protocol.response_error(meta) is not None:
                            break
                finally:
                    writer.close()
            return tensors, meta
        except Exception as e:
            raise PeerFailed(peer_id, f"{rpc} failed: {type(e).__name__}: {e}") from e

    async def forward_hidden(self, peer_id: str, start: int, end: int, hidden: torch.Tensor,
                             attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Whole sequences [B, L, H] through blocks [start, end) of a server (`call_forward`), checked.

        Raises PeerFailed when the server fails or refuses, and InvalidRequest when it calls the request malformed.
        """
        tensors, meta = await self.call_forward(
            peer_id, start, end, [wire_hidden(hidden), attention_mask.long(), position_ids.long()])
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


MAX_REPORTED_LINKS = 64
FORWARDS_PER_SERVER = 2  # a server's default --max-forwards-per-peer: the most of one caller's forwards it admits


def reported_links(peer_id: str, value: Any) -> dict[tuple[str, str], float]:
    """The round trips a server's info answer reports to the servers after it ({peer id: seconds}), checked."""
    if not isinstance(value, dict):
        return {}
    return {(peer_id, str(other)): float(rtt) for other, rtt in list(value.items())[:MAX_REPORTED_LINKS]
            if isinstance(other, str) and len(other) <= 128 and isinstance(rtt, int | float)
            and not isinstance(rtt, bool) and 0.0 <= rtt < 60.0}


def wire_hidden(hidden: torch.Tensor) -> torch.Tensor:
    """Hidden states as sent: contiguous, in their own dtype when the wire carries it (float32, bfloat16, float16:
    each server casts its input to its compute dtype), else float32."""
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        hidden = hidden.float()
    return hidden.contiguous()


def _log_failed_read(read: asyncio.Future[list[BlockServers]]) -> None:
    """A background DHT read that failed: its callers, if any, get the error; the log says it for the rest."""
    if not read.cancelled() and read.exception() is not None:
        logger.info("A DHT read of the swarm's servers failed: %s", read.exception())
