"""A block server: composition of loading, handlers, announcer and shutdown, configured by `ServerConfig`."""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from servers.announcer import Announcer
from servers.block_loading import DType, Quant, load_span
from servers.block_selection import choose_best_blocks
from servers.errors import ServerConfigError
from servers.handler import BlockHandler
from servers.memory import CacheBudget
from servers.metrics import MetricsEndpoint, start_metrics
from servers.throughput import measure_throughput
from servers.validation import Limits
from swarmclient.data_structures import PROTOCOL_VERSION, ServerInfo, ServerState
from swarmclient.discovery import get_remote_module_infos
from swarmclient.model_spec import ModelSpec
from swarmclient.network import NetworkOptions, run_async, start_dht_node, stop_dht_node, visible_maddrs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """Everything `swarmbatch serve` accepts."""

    model_dir: str
    initial_peers: list[str]
    blocks: tuple[int, int] | None = None   # explicit span [start, end)
    num_blocks: int | None = None           # or: this many blocks, where coverage is weakest
    network: NetworkOptions = field(default_factory=NetworkOptions)
    dtype: DType = DType.float32
    quant: Quant = Quant.none
    attn_cache_tokens: int = 16384          # tokens cached per block, over all sessions
    max_batch_size: int = 64
    max_length: int | None = None           # longest session; default: the model's context
    announce_period: float = 15.0           # seconds between DHT refreshes
    session_timeout: float = 300.0          # an idle session is closed and its cache freed after this
    num_threads: int | None = None          # torch threads for compute; None keeps torch's default
    batch_wait_ms: float = 2.0              # a decode step waits this long to merge with other sessions'; 0 = never
    max_merge_tokens: int = 2048            # sessions caching more (rows x length) run alone (merging copies caches)
    metrics_port: int = 0                   # Prometheus /metrics port; 0 = no metrics endpoint
    metrics_host: str = "127.0.0.1"         # where /metrics listens (0.0.0.0 for a scraper elsewhere)

    def __post_init__(self) -> None:
        if (self.blocks is None) == (self.num_blocks is None):
            raise ServerConfigError("pass exactly one of --blocks A:B and --num-blocks N")
        if self.attn_cache_tokens < 1 or self.max_batch_size < 1 or self.announce_period <= 0:
            raise ServerConfigError("--attn-cache-tokens, --max-batch-size and --announce-period must be positive")
        if self.batch_wait_ms < 0:
            raise ServerConfigError("--batch-wait-ms must be 0 (no merging) or more")


class BlockServer:
    """One running server; `start()`, then `wait()` until a signal, then `shutdown()`."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.spec = ModelSpec.open(config.model_dir)
        self.state = ServerState.JOINING
        self.throughput = 0.0
        self.peer_id = ""
        self.metrics: MetricsEndpoint | None = None
        self._stop = asyncio.Event()

    async def start(self) -> None:
        """Join the DHT, load the span, serve, and announce ONLINE."""
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        if self.config.metrics_port:  # up before loading, so a health check can see "joining"
            self.metrics = start_metrics(self, self.config.metrics_host, self.config.metrics_port)
        self.p2p, self.node = await start_dht_node(self.config.initial_peers, self.config.network, client_mode=False)
        self.peer_id = self.p2p.peer_id.to_base58()
        self.start_block, self.end_block = await self._choose_span()
        self.span = await asyncio.get_running_loop().run_in_executor(
            None, lambda: load_span(self.spec, self.start_block, self.end_block,
                                    dtype=self.config.dtype, quant=self.config.quant))
        self.budget = CacheBudget(self.config.attn_cache_tokens, self.end_block - self.start_block)
        self.handler = BlockHandler(self.span, self._limits(), self.budget, self._info_dict,
                                    session_timeout=self.config.session_timeout,
                                    batch_wait_ms=self.config.batch_wait_ms,
                                    max_merge_tokens=self.config.max_merge_tokens)
        self.announcer = Announcer(self.node, model_id=self.spec.model_id, peer_id=self.peer_id,
                                   info=self.info, update_period=self.config.announce_period)
        await self.announcer.announce()  # JOINING: visible to block selection of servers starting now
        self.throughput = measure_throughput(self.span)
        await self.handler.register(self.p2p)
        self.state = ServerState.ONLINE
        await self.announcer.announce()
        self.announcer.start()

    async def _choose_span(self) -> tuple[int, int]:
        if self.config.blocks is not None:
            start, end = self.config.blocks
            if not 0 <= start < end <= self.spec.num_blocks:
                raise ServerConfigError(f"--blocks {start}:{end} is outside the model's 0:{self.spec.num_blocks}")
            return start, end
        assert self.config.num_blocks is not None
        infos = await get_remote_module_infos(self.node, self.spec.model_id, self.spec.num_blocks)
        try:
            return choose_best_blocks(self.config.num_blocks, infos)
        except ValueError as e:
            raise ServerConfigError(str(e)) from e

    def _limits(self) -> Limits:
        max_length = min(self.config.max_length or self.spec.max_length, self.spec.max_length)
        return Limits(self.start_block, self.end_block, self.spec.hidden_size, self.config.max_batch_size, max_length)

    def info(self) -> ServerInfo:
        """What this server announces now."""
        return ServerInfo(
            state=self.state, start=self.start_block, end=self.end_block, throughput=self.throughput,
            cache_tokens_left=self.budget.tokens_left, dtype=self.config.dtype.value, quant=self.config.quant.value,
            version=PROTOCOL_VERSION, revision=self.spec.revision, max_batch_size=self.config.max_batch_size,
            max_length=self._limits().max_length)

    def _info_dict(self) -> dict[str, Any]:
        return {**self.info().to_wire(), "peer_id": self.peer_id, "model_id": self.spec.model_id,
                "steps": self.handler.stats.steps, "tokens": self.handler.stats.tokens,
                "errors": dict(self.handler.stats.errors)}

    async def maddrs(self) -> list[str]:
        """Multiaddrs peers can dial."""
        return await visible_maddrs(self.p2p)

    def request_stop(self) -> None:
        """Ask `wait()` to return (signal-safe)."""
        self._stop.set()

    async def wait(self) -> None:
        """Block until `request_stop()`."""
        await self._stop.wait()

    async def shutdown(self) -> None:
        """Announce OFFLINE first (clients stop routing here), then stop serving and leave the DHT."""
        self.state = ServerState.OFFLINE
        if hasattr(self, "announcer"):
            await self.announcer.stop()
            try:
                await asyncio.wait_for(self.announcer.announce(), timeout=5)
            except Exception:
                logger.warning("Could not announce OFFLINE; records expire in %.0f s", self.announcer.expiration)
        if hasattr(self, "handler"):
            self.handler.executor.shutdown(wait=False, cancel_futures=True)
        if hasattr(self, "node"):
            await stop_dht_node(self.p2p, self.node)
        if self.metrics is not None:  # last: a scraper sees "offline" until the server is gone
            self.metrics.stop()


def run_server(config: ServerConfig, on_ready: Callable[[BlockServer, list[str]], None]) -> None:
    """Run a server until SIGTERM/SIGINT; `on_ready(server, maddrs)` is called once it is ONLINE."""
    async def main() -> None:
        server = BlockServer(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.request_stop)
        began = time.perf_counter()
        try:
            await server.start()
            logger.info("Server ONLINE in %.1f s: blocks %d:%d, %.0f block-steps/s", time.perf_counter() - began,
                        server.start_block, server.end_block, server.throughput)
            on_ready(server, await server.maddrs())
            await server.wait()
            logger.info("Shutting down: announcing OFFLINE")
        finally:
            await server.shutdown()
    run_async(main())
