"""A block server: composition of loading, handlers, announcer and shutdown, configured by `ServerConfig`."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from servers.access import MemberGate
from servers.announcer import Announcer
from servers.block_loading import load_span
from servers.block_selection import choose_best_blocks
from servers.block_sizing import auto_num_blocks, spare_memory
from servers.config import ServerConfig
from servers.counters import ServerCounters
from servers.errors import ServerConfigError
from servers.faults import fault_noise, inject_faults, push_fault_noise
from servers.handler import RPCS, BlockHandler
from servers.machine import this_machine
from servers.memory import CacheBudget
from servers.metrics import start_metrics
from servers.neighbours import NextServerPings
from servers.rebalancer import Rebalancer
from servers.rebalancing import Move
from servers.ring import RING_HEAD_LOG, RingGuesser
from servers.span import BlockSpan
from servers.span_forms import tune_span
from servers.status import ServerStatus, SpanStatus
from servers.throughput import measure_throughput
from servers.validation import Limits
from swarmnet.data_structures import MAX_MOVE_REASON_CHARS, MAX_MOVES_ANNOUNCED, PROTOCOL_VERSION, ServerState, SpanMove
from swarmnet.discovery import get_remote_module_infos
from swarmnet.identity import Identity
from swarmnet.membership import Membership
from swarmnet.model_spec import ModelSpec
from swarmnet.network import run_async, start_dht_node, stop_dht_node, visible_maddrs

logger = logging.getLogger(__name__)
MOVED_LOG = "Moved blocks %d:%d -> %d:%d in %.1f s (%d sessions ended): %s"  # the one line per move


@dataclass(frozen=True)
class Serving:
    """What serves a span, built in one step once the span is chosen (and again on each move): the blocks, their
    budget and the RPC handler."""

    span: BlockSpan
    budget: CacheBudget
    handler: BlockHandler


class BlockServer:
    """One running server; `start()`, then `wait()` until a signal, then `shutdown()`.

    What exists before the span is chosen is built here; `start()` builds the rest in order and registers how to
    stop each part, so `shutdown()` stops exactly what was built, in reverse (announce OFFLINE, stop the handlers,
    leave the DHT, close /metrics), also after a start that failed half-way or never ran.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.spec = ModelSpec.open(config.model_dir)
        self.membership = Membership.from_file(config.swarm_file) if config.swarm_file else Membership.open()
        self.fault_noise = fault_noise(private=not self.membership.is_open)  # refused in a private swarm, before loading
        self.push_noise = push_fault_noise(private=not self.membership.is_open)  # the same, on pushed outputs only
        self.max_length = min(config.max_length or self.spec.max_length, self.spec.max_length)
        self.stats = ServerCounters()
        self.state = ServerState.JOINING
        self.peer_id = ""  # set once the server has joined the DHT
        self.throughput = 0.0  # measured once the span is loaded
        self.machine = self.config.machine or this_machine()  # announced: clients spread sessions over machines
        self.device, self.dtype = config.torch_device(), config.compute_dtype()  # --device/--dtype auto resolved
        self.serving: Serving | None = None  # set when the span is loaded, replaced when it moves
        self.announcer: Announcer | None = None
        self.pings: NextServerPings | None = None
        self.target: tuple[int, int] | None = None  # while moving: the span moved to (announced JOINING)
        self.moves: deque[SpanMove] = deque(maxlen=MAX_MOVES_ANNOUNCED)
        self.p2p: P2P | None = None
        self.identity: Identity | None = None  # the peer key: it signs DHT records and push proofs
        self._running = contextlib.AsyncExitStack()  # how to stop what start() built, last built first
        self._stop = asyncio.Event()

    async def start(self) -> list[str]:
        """Join the DHT, load the span, serve, and announce ONLINE; returns the multiaddrs peers can dial."""
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        if self.config.metrics_port:  # up before loading, so a health check can see "joining"
            metrics = start_metrics(self.status, self.config.metrics_host, self.config.metrics_port)
            self._running.callback(metrics.stop)  # stopped last: a scraper sees "offline" until the server is gone
        writers = None if self.membership.is_open else self.membership.serves  # a private swarm stores members' only
        p2p, node = await start_dht_node(self.config.initial_peers, self.config.network, client_mode=False,
                                         writers=writers)
        self._running.push_async_callback(stop_dht_node, p2p, node)
        self.peer_id, self.p2p, self.identity = p2p.peer_id.to_base58(), p2p, node.identity
        self.membership.require(self.peer_id, "server", self.config.network.identity_path)
        start, end = await self._choose_span(node)
        self.serving = await self._serve(start, end)
        announcer = self.announcer = Announcer(node, status=self.status, update_period=self.config.announce_period)
        self._running.push_async_callback(self._stop_serving)
        await announcer.announce()  # JOINING: visible to block selection of servers starting now
        self.throughput = self.config.throughput or measure_throughput(self.serving.span)
        await self._register(p2p)
        self.state = ServerState.ONLINE
        await announcer.announce()
        announcer.start()
        self._running.push_async_callback(self._stop_pings)
        self._start_pings(node)
        if self.config.rebalances:
            rebalancer = Rebalancer(node, status=self.status, num_blocks=self.spec.num_blocks,
                                    allows=self.membership.serves, move=self.move_span,
                                    period=self.config.rebalance_period, quality=self.config.balance_quality,
                                    cooldown=self.config.move_cooldown)
            rebalancer.start()
            self._running.push_async_callback(rebalancer.stop)
        return await visible_maddrs(p2p)

    async def _register(self, p2p: P2P) -> None:
        """The RPCs, each answered by the handler of the span served now (a move replaces it)."""
        for name, method in RPCS.items():
            await p2p.add_binary_stream_handler(name, self._dispatch(method))

    def _dispatch(self, method: str) -> Callable[..., Any]:
        async def serve(*args: Any) -> None:
            assert self.serving is not None
            await getattr(self.serving.handler, method)(*args)
        return serve

    def _start_pings(self, node: DHTNode) -> None:
        assert self.p2p is not None and self.serving is not None
        pings = self.pings = NextServerPings(self.p2p, node, model_id=self.spec.model_id,
                                             num_blocks=self.spec.num_blocks, end=self.serving.span.end,
                                             allows=self.membership.serves)
        self.serving.handler.next_rtts = lambda: dict(pings.rtts)
        pings.start()

    async def _stop_pings(self) -> None:
        if self.pings is not None:
            await self.pings.stop()

    async def move_span(self, move: Move) -> bool:
        """Move to blocks [move.start, move.end): announce JOINING there at once (nobody else runs for the same
        hole), refuse new sessions, load the new span while the running sessions and forwards finish (for up to
        --move-drain-seconds), end the sessions left, then serve and announce it. Returns whether it moved: if
        anything fails on the way, the old span is served and announced again, and no session was ended."""
        assert self.serving is not None and self.announcer is not None
        old, began, at = self.serving, time.perf_counter(), get_dht_time()
        self.state, self.target = ServerState.JOINING, (move.start, move.end)
        old.handler.moving_to = f"{move.start}:{move.end}"
        try:
            new = await self._load_while_settling(old, move)
        except Exception as e:
            await self._stay(old, move, e)
            return False
        ended = old.handler.end_sessions()
        self.serving = new
        self.moves.append(SpanMove(at=at, start=move.start, end=move.end, from_start=old.span.start,
                                   from_end=old.span.end, reason=move.reason[:MAX_MOVE_REASON_CHARS]))
        self.state, self.target = ServerState.ONLINE, None
        await self.announcer.announce()
        old.handler.executor.shutdown(wait=False, cancel_futures=True)
        old.handler.background.shutdown(wait=False, cancel_futures=True)
        logger.info(MOVED_LOG, old.span.start, old.span.end, move.start, move.end, time.perf_counter() - began,
                    ended, move.reason)
        await self._stop_pings()
        self._start_pings(self.announcer.node)
        return True

    async def _load_while_settling(self, old: Serving, move: Move) -> Serving:
        """Withdraw the old span, announce the new one as JOINING, and load it while the old one settles."""
        assert self.announcer is not None
        await self.announcer.withdraw(old.span.start, old.span.end)
        await self.announcer.announce()
        loading = asyncio.ensure_future(self._serve(move.start, move.end))
        try:
            await old.handler.settle(self.config.move_drain_seconds)
            return await loading
        except BaseException:
            loading.cancel()
            raise

    async def _stay(self, old: Serving, move: Move, error: Exception) -> None:
        """A move failed: serve and announce the old span again, as if it had never started."""
        logger.warning("Could not move to blocks %d:%d (%s: %s); serving %d:%d again", move.start, move.end,
                       type(error).__name__, error, old.span.start, old.span.end)
        old.handler.moving_to = None
        self.state, self.target = ServerState.ONLINE, None
        assert self.announcer is not None
        try:
            await self.announcer.announce()
        except Exception as e:  # the announcer's next period announces it anyway
            logger.warning("Could not announce blocks %d:%d again yet: %s: %s", old.span.start, old.span.end,
                           type(e).__name__, e)

    async def _choose_span(self, node: DHTNode) -> tuple[int, int]:
        if self.config.blocks is not None:
            start, end = self.config.blocks
            if not 0 <= start < end <= self.spec.num_blocks:
                raise ServerConfigError(f"--blocks {start}:{end} is outside the model's 0:{self.spec.num_blocks}")
            return start, end
        count = self.config.num_blocks or auto_num_blocks(
            self.spec, self.device, self.dtype, self.config.quant, self.config.attn_cache_tokens,
            self.config.max_memory_gb)
        infos = [{peer: info for peer, info in servers.items() if self.membership.serves(peer)}  # clients use no other
                 for servers in await get_remote_module_infos(node, self.spec.model_id, self.spec.num_blocks)]
        try:
            return choose_best_blocks(count, infos,
                                      lambda start, end: self.spec.can_load(self.spec.block_prefixes(start, end)))
        except ValueError as e:
            raise ServerConfigError(str(e)) from e

    async def _serve(self, start: int, end: int) -> Serving:
        """Load blocks [start, end) and build what serves and announces them."""
        config = self.config
        span = await asyncio.get_running_loop().run_in_executor(
            None, lambda: load_span(self.spec, start, end, dtype=self.dtype, quant=config.quant,
                                    device=self.device))
        if config.tune_products:  # before the fault hook and the throughput: the forms every step takes
            spare = spare_memory(self.spec, self.device, self.dtype, config.quant, config.attn_cache_tokens,
                                 end - start, config.max_memory_gb)
            await asyncio.get_running_loop().run_in_executor(None, lambda: tune_span(span, spare_bytes=spare))
        inject_faults(span, self.fault_noise)  # tests only: a server that lies (servers/faults.py)
        guesser = None
        if config.ring and end == self.spec.num_blocks:
            guesser = await asyncio.get_running_loop().run_in_executor(None, RingGuesser, self.spec, self.device)
            logger.info(RING_HEAD_LOG)
        budget = CacheBudget(config.attn_cache_tokens, end - start, owner_share=config.max_cache_share_per_peer,
                             lend=config.lend_idle_cache)
        limits = Limits(start, end, self.spec.hidden_size, config.max_batch_size, self.max_length)
        handler = BlockHandler(span, limits, budget, self.status, session_timeout=config.session_timeout,
                               batch_wait_ms=config.batch_wait_ms, max_merge_tokens=config.max_merge_tokens,
                               max_sessions_per_peer=config.max_sessions_per_peer,
                               max_queued_forwards=config.max_queued_forwards,
                               max_forwards_per_peer=config.max_forwards_per_peer,
                               max_forward_tokens=config.max_forward_tokens,
                               max_streams_per_peer=config.max_streams_per_peer,
                               lent_cache_grace=config.lent_cache_grace, session_grace=config.session_grace,
                               stats=self.stats,
                               authorize=MemberGate(self.membership).check, membership=self.membership,
                               may_push_to=self.membership.serves,
                               may_push_here=self.membership.serves, guesser=guesser)
        if self.p2p is not None:
            handler.pusher.p2p = self.p2p
        handler.pusher.identity, handler.pusher.noise = self.identity, self.push_noise
        return Serving(span, budget, handler)

    def status(self) -> ServerStatus:
        """This server now: the one reading that its `info` answer, /metrics and DHT record are made from."""
        serving = self.serving
        span = None if serving is None else SpanStatus(
            start=serving.span.start, end=serving.span.end, throughput=self.throughput,
            sessions=len(serving.handler.sessions), forwards=serving.handler.forwards.in_use, cache=serving.budget.use())
        if span is not None and self.target is not None:
            span = dataclasses.replace(span, start=self.target[0], end=self.target[1])
        return ServerStatus(
            state=self.state, model_id=self.spec.model_id, peer_id=self.peer_id, dtype=self.dtype.value,
            quant=self.config.quant.value, version=PROTOCOL_VERSION, revision=self.spec.revision,
            max_batch_size=self.config.max_batch_size, max_length=self.max_length,
            max_sessions_per_peer=self.config.max_sessions_per_peer, stats=self.stats.copy(),
            span=span, rebalances=self.config.rebalances, moves=tuple(self.moves), machine=self.machine)

    def request_stop(self) -> None:
        """Ask `wait()` to return (signal-safe)."""
        self._stop.set()

    async def wait(self) -> None:
        """Block until `request_stop()`."""
        await self._stop.wait()

    async def shutdown(self) -> None:
        """Announce OFFLINE first (clients stop routing here), then stop serving, leave the DHT, close /metrics."""
        self.state = ServerState.OFFLINE
        await self._running.aclose()

    async def _stop_serving(self) -> None:
        """Announce OFFLINE (peers stop routing here before we vanish), then stop the compute thread."""
        assert self.announcer is not None and self.serving is not None
        await self.announcer.stop()
        try:
            await asyncio.wait_for(self.announcer.announce(), timeout=5)
        except Exception:
            logger.warning("Could not announce OFFLINE; records expire in %.0f s", self.announcer.expiration)
        self.serving.handler.executor.shutdown(wait=False, cancel_futures=True)
        self.serving.handler.background.shutdown(wait=False, cancel_futures=True)


def run_server(config: ServerConfig, on_ready: Callable[[ServerStatus, list[str]], None]) -> None:
    """Run a server until SIGTERM/SIGINT; `on_ready(status, maddrs)` is called once it is ONLINE."""
    async def main() -> None:
        server = BlockServer(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.request_stop)
        began = time.perf_counter()
        try:
            maddrs = await server.start()
            status = server.status()
            span = status.loaded_span()
            logger.info("Server ONLINE in %.1f s: blocks %d:%d, %.0f block-steps/s", time.perf_counter() - began,
                        span.start, span.end, span.throughput)
            on_ready(status, maddrs)
            await server.wait()
            logger.info("Shutting down: announcing OFFLINE")
        finally:
            await server.shutdown()
    run_async(main())
