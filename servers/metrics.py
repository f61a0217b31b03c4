"""Prometheus metrics of a block server (`swarmbatch serve --metrics-port`), named `swarmbatch_server_*`.

A custom collector reads the server's live state at scrape time, on its own registry (never the process-wide
default one), so nothing is counted twice and no extra bookkeeping runs on the request path.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from threading import Thread
from typing import TYPE_CHECKING, Any

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from servers.errors import ServerConfigError
from swarmclient.data_structures import ServerState

if TYPE_CHECKING:
    from servers.server import BlockServer

logger = logging.getLogger(__name__)
PREFIX = "swarmbatch_server"


class ServerCollector(Collector):
    """Reads a BlockServer's counters, sessions, KV-cache budget, span and state on every scrape."""

    def __init__(self, server: BlockServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        """The metric families of this scrape (the span and load only once the span is loaded)."""
        yield self._state()
        handler, budget = getattr(self.server, "handler", None), getattr(self.server, "budget", None)
        if handler is None or budget is None:  # still joining: nothing served yet
            return
        yield from self._span()
        yield from self._load(handler, budget)

    def _state(self) -> Metric:
        state = GaugeMetricFamily(f"{PREFIX}_state", "1 for the server's current state (joining, online, offline)",
                                  labels=["state"])
        for value in ServerState:
            state.add_metric([value.name.lower()], 1.0 if self.server.state == value else 0.0)
        return state

    def _span(self) -> Iterator[Metric]:
        server = self.server
        yield InfoMetricFamily(f"{PREFIX}_span", "The model and blocks this server holds", value={
            "model_id": server.spec.model_id, "peer_id": server.peer_id, "start": str(server.start_block),
            "end": str(server.end_block), "dtype": server.config.dtype.value, "quant": server.config.quant.value})
        yield GaugeMetricFamily(f"{PREFIX}_span_start", "First block served (inclusive)", value=server.start_block)
        yield GaugeMetricFamily(f"{PREFIX}_span_end", "Last block served (exclusive)", value=server.end_block)
        yield GaugeMetricFamily(f"{PREFIX}_throughput", "Measured block-steps per second, announced for routing",
                                value=server.throughput)

    def _load(self, handler: Any, budget: Any) -> Iterator[Metric]:
        stats = handler.stats
        yield CounterMetricFamily(f"{PREFIX}_steps", "Computed requests: forward calls and inference steps",
                                  value=stats.steps)
        yield CounterMetricFamily(f"{PREFIX}_tokens", "Tokens computed (batch x length, summed over steps)",
                                  value=stats.tokens)
        errors = CounterMetricFamily(f"{PREFIX}_errors", "Rejected or failed requests by error code", labels=["code"])
        for code, count in sorted(dict(stats.errors).items()):  # dict(): a snapshot, the handler keeps counting
            errors.add_metric([code], count)
        yield errors
        yield GaugeMetricFamily(f"{PREFIX}_open_sessions", "Inference sessions open now", value=len(handler.sessions))
        yield GaugeMetricFamily(f"{PREFIX}_cache_reserved_block_tokens",
                                "KV-cache block-tokens reserved by open sessions", value=budget.used)
        yield GaugeMetricFamily(f"{PREFIX}_cache_budget_block_tokens",
                                "KV-cache block-tokens this server admits (--attn-cache-tokens x blocks)",
                                value=budget.limit)


@dataclass
class MetricsEndpoint:
    """A running `/metrics` HTTP server; `stop()` closes its socket and joins its thread."""

    httpd: Any
    thread: Thread
    url: str

    def stop(self) -> None:
        """Stop serving and release the port."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def start_metrics(server: BlockServer, host: str, port: int) -> MetricsEndpoint:
    """Serve the server's metrics at http://host:port/metrics; raises ServerConfigError if the port is taken."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(server))
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise ServerConfigError(f"cannot serve metrics on {host}:{port} ({e.strerror}); "
                                "pick a free --metrics-port or --metrics-host") from e
    url = f"http://{host}:{httpd.server_address[1]}/metrics"
    logger.info("Metrics at %s", url)
    return MetricsEndpoint(httpd, thread, url)
