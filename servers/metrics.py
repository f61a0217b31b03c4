"""Prometheus metrics of a block server (`swarmbatch serve --metrics-port`), named `swarmbatch_server_*`.

A custom collector reads the server's `ServerStatus` at scrape time, on its own registry (never the process-wide
default one), so nothing is counted twice and no extra bookkeeping runs on the request path.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from threading import Thread
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from servers.errors import ServerConfigError
from servers.status import ServerStatus, SpanStatus
from swarmnet.data_structures import ServerState

logger = logging.getLogger(__name__)
PREFIX = "swarmbatch_server"


class ServerCollector(Collector):
    """Exports one `ServerStatus` per scrape: state, span, counters, sessions and KV-cache budget."""

    def __init__(self, status: Callable[[], ServerStatus]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        """The metric families of this scrape (the span and load only once the span is loaded)."""
        status = self.status()  # one reading, so the families of a scrape agree with each other
        yield self._state(status)
        if status.span is None:  # still joining: nothing served yet
            return
        yield from self._span(status, status.span)
        yield from self._load(status, status.span)

    def _state(self, status: ServerStatus) -> Metric:
        state = GaugeMetricFamily(f"{PREFIX}_state", "1 for the server's current state (joining, online, offline)",
                                  labels=["state"])
        for value in ServerState:
            state.add_metric([value.name.lower()], 1.0 if status.state == value else 0.0)
        return state

    def _span(self, status: ServerStatus, span: SpanStatus) -> Iterator[Metric]:
        yield InfoMetricFamily(f"{PREFIX}_span", "The model and blocks this server holds", value={
            "model_id": status.model_id, "peer_id": status.peer_id, "start": str(span.start),
            "end": str(span.end), "dtype": status.dtype, "quant": status.quant})
        yield GaugeMetricFamily(f"{PREFIX}_span_start", "First block served (inclusive)", value=span.start)
        yield GaugeMetricFamily(f"{PREFIX}_span_end", "Last block served (exclusive)", value=span.end)
        yield GaugeMetricFamily(f"{PREFIX}_throughput", "Measured block-steps per second, announced for routing",
                                value=span.throughput)

    def _load(self, status: ServerStatus, span: SpanStatus) -> Iterator[Metric]:
        stats = status.stats
        yield CounterMetricFamily(f"{PREFIX}_steps", "Computed requests: forward calls and inference steps",
                                  value=stats.steps)
        yield CounterMetricFamily(f"{PREFIX}_tokens", "Tokens computed (batch x length, summed over steps)",
                                  value=stats.tokens)
        errors = CounterMetricFamily(f"{PREFIX}_errors", "Rejected or failed requests by error code", labels=["code"])
        for code, count in sorted(stats.errors.items()):
            errors.add_metric([code], count)
        yield errors
        yield GaugeMetricFamily(f"{PREFIX}_open_sessions", "Inference sessions open now", value=span.sessions)
        yield GaugeMetricFamily(f"{PREFIX}_cache_reserved_block_tokens",
                                "KV-cache block-tokens reserved by open sessions", value=span.cache.used)
        yield GaugeMetricFamily(f"{PREFIX}_cache_budget_block_tokens",
                                "KV-cache block-tokens this server admits (--attn-cache-tokens x blocks)",
                                value=span.cache.limit)
        yield GaugeMetricFamily(f"{PREFIX}_cache_lent", "1 while a caller alone here may borrow past its share of "
                                "the KV cache (--lend-idle-cache), 0 while each caller is held to its share",
                                value=int(span.cache.lending))


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


def start_metrics(status: Callable[[], ServerStatus], host: str, port: int) -> MetricsEndpoint:
    """Serve `status()` as metrics at http://host:port/metrics; raises ServerConfigError if the port is taken."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(status))
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise ServerConfigError(f"cannot serve metrics on {host}:{port} ({e.strerror}); "
                                "pick a free --metrics-port or --metrics-host") from e
    url = f"http://{host}:{httpd.server_address[1]}/metrics"
    logger.info("Metrics at %s", url)
    return MetricsEndpoint(httpd, thread, url)
