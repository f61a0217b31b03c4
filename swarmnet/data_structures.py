"""The swarm's wire contract: what servers announce on the DHT and what clients read back.

Servers import this module; it imports nothing from `servers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# /3: open messages, bounded frames, info/forward on raw streams; /4: push proofs and input digests (protocol.py)
PROTOCOL_VERSION = "swarmbatch/4"

# How long a DHT record may live, swarm-wide. A server re-announces every period (at most ANNOUNCE_PERIOD_LIMIT)
# and its records expire after two; every node refuses a record expiring later than MAX_RECORD_TTL from its own
# clock (swarmnet/records.py), so a record can never outlive its writer by much. The slack absorbs clock skew.
ANNOUNCE_PERIOD_LIMIT = 30.0
RECORD_TTL_SLACK = 10.0
MAX_RECORD_TTL = 2 * ANNOUNCE_PERIOD_LIMIT + RECORD_TTL_SLACK


class ServerState(str, Enum):
    """Lifecycle of a block server as seen on the DHT."""

    OFFLINE = "offline"
    JOINING = "joining"
    ONLINE = "online"


MAX_MOVES_ANNOUNCED = 4  # a server's record carries its last moves (span history), each under 200 bytes
MAX_MACHINE_NAME = 64  # characters of the machine a server names (ServerInfo.machine)
MAX_MOVE_REASON_CHARS = 120


class SpanMove(BaseModel):
    """One move of a server's span (servers/rebalancing.py): when (DHT time), from where, to where, and why."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    at: float
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    from_start: int = Field(ge=0)
    from_end: int = Field(gt=0)
    reason: str = Field(max_length=MAX_MOVE_REASON_CHARS)


def block_uid(model_id: str, index: int) -> str:
    """DHT key of one block: '{model_id}.{index}'."""
    return f"{model_id}.{index}"


class ServerInfo(BaseModel):
    """One server's announcement, stored under every block key it serves (subkey = its peer id)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    state: ServerState
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    throughput: float = Field(ge=0, description="decode steps per second over the whole span, batch 1")
    cache_tokens_left: int = Field(ge=0)
    dtype: str
    quant: str
    version: str
    revision: str
    max_batch_size: int = Field(gt=0)
    max_length: int = Field(gt=0)
    # what one caller (peer id) may hold here at once; None from a server that does not say (an older one)
    max_sessions_per_peer: int | None = Field(default=None, gt=0)
    cache_tokens_per_peer: int | None = Field(default=None, ge=0, description="tokens per block, all its sessions")
    # the most one caller could ever hold here (alone, while lent), tokens per block: a longer session never fits
    cache_tokens_most_per_peer: int | None = Field(default=None, ge=0)
    # rebalancing (servers/rebalancing.py): whether this server may move its span (started with --num-blocks), and
    # its last moves; an older server says neither and is never asked to move
    rebalances: bool = False
    moves: tuple[SpanMove, ...] = Field(default=(), max_length=MAX_MOVES_ANNOUNCED)
    # the machine whose compute this server shares: servers of one machine announce the same name, and a client
    # spreads its sessions over machines (swarmclient/routing.py, `machine_loads`); an older server names none, and
    # is a machine of its own
    machine: str | None = Field(default=None, min_length=1, max_length=MAX_MACHINE_NAME)

    @model_validator(mode="after")
    def _span_is_not_empty(self) -> ServerInfo:
        if self.end <= self.start:
            raise ValueError(f"empty span {self.start}:{self.end}")
        return self

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-friendly dict."""
        return self.model_dump(mode="json")

    @classmethod
    def from_wire(cls, value: Any) -> ServerInfo | None:
        """Parse a value read from an untrusted peer; None when it is malformed."""
        try:
            return cls.model_validate(value)
        except ValidationError:
            return None


@dataclass(frozen=True)
class RemoteSpanInfo:
    """A server and the blocks [start, end) it holds."""

    peer_id: str
    start: int
    end: int
    info: ServerInfo

    @property
    def length(self) -> int:
        """Number of blocks in the span."""
        return self.end - self.start


@dataclass(frozen=True)
class RouteHop:
    """One hop of a route: blocks [start, end) computed by `peer_id` (a sub-span of its span)."""

    peer_id: str
    start: int
    end: int
