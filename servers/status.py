"""`ServerStatus`: one reading of a block server, the single source of its `info` answer, /metrics and DHT record.

`BlockServer.status()` builds it; the handler's `info` RPC, the Prometheus collector and the announcer only read it,
so the three can never disagree on a figure, and none of them needs the server itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servers.counters import ServerCounters
from servers.memory import CacheUse
from swarmnet.data_structures import ServerInfo, ServerState, SpanMove


@dataclass(frozen=True)
class SpanStatus:
    """The loaded span and its load: exists once the server has chosen and loaded its blocks."""

    start: int
    end: int
    throughput: float  # block-steps per second; 0 until measured
    sessions: int      # inference sessions open now
    forwards: int      # forwards admitted and not yet answered
    cache: CacheUse


@dataclass(frozen=True)
class ServerStatus:
    """A block server at one moment."""

    state: ServerState
    model_id: str
    peer_id: str       # "" until the server has joined the DHT
    dtype: str
    quant: str
    version: str
    revision: str
    max_batch_size: int
    max_length: int
    max_sessions_per_peer: int
    stats: ServerCounters  # a copy: counters since start-up
    span: SpanStatus | None  # None while joining, before the span is loaded; while moving, the span moved to
    rebalances: bool = False  # may move its span (servers/rebalancing.py)
    moves: tuple[SpanMove, ...] = ()  # its last moves, oldest first
    machine: str | None = None  # the machine whose compute it shares (servers/machine.py)

    def loaded_span(self) -> SpanStatus:
        """The span; raises RuntimeError before it is loaded (nothing is served or announced until then)."""
        if self.span is None:
            raise RuntimeError("the server has not loaded its span yet")
        return self.span

    def announcement(self) -> ServerInfo:
        """The DHT record (the wire contract), stored under every served block."""
        span = self.loaded_span()
        return ServerInfo(
            state=self.state, start=span.start, end=span.end, throughput=span.throughput,
            cache_tokens_left=span.cache.tokens_left, dtype=self.dtype, quant=self.quant, version=self.version,
            revision=self.revision, max_batch_size=self.max_batch_size, max_length=self.max_length,
            max_sessions_per_peer=self.max_sessions_per_peer, cache_tokens_per_peer=span.cache.tokens_per_caller,
            cache_tokens_most_per_peer=span.cache.most_per_caller,
            rebalances=self.rebalances, moves=self.moves, machine=self.machine)

    def info_answer(self) -> dict[str, Any]:
        """The `info` RPC's answer: the announcement, who this is, and the load."""
        return {**self.announcement().to_wire(), "peer_id": self.peer_id, "model_id": self.model_id,
                "steps": self.stats.steps, "tokens": self.stats.tokens, "errors": dict(self.stats.errors),
                "sessions": self.loaded_span().sessions, "merged_steps": self.stats.merged_steps,
                "merged_sessions": self.stats.merged_sessions, "max_merged": self.stats.max_merged,
                "forwards": self.loaded_span().forwards}
