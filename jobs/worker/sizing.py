"""How much a worker takes on at once: the claim (requests in flight) and the lanes (micro-batches) it splits it into.

Sized from what the chain of servers announces it can hold for one caller (`ChainRoom`: rows per session, KV
cache this caller may reserve, sessions it may open, each hop's step time), the job's next requests (their
prompt + max_tokens is what a session reserves per row), and a fair share of the job among live workers. The claim
reaches ahead (`CLAIM_AHEAD`): lanes start only as the cache allows (runner.py), the rest wait, leased.
Explicit settings (SWARMBATCH_WORKER_BATCH_SIZE, SWARMBATCH_PIPELINE_LANES) win over the sizing.
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swarmclient.routing import DEFAULT_RTT, hop_cost

if TYPE_CHECKING:
    from swarmclient.swarm import Swarm
    from swarmnet.data_structures import RemoteSpanInfo

MAX_CLAIM = 256    # requests one worker process claims at most, whatever the servers could hold
MIN_LANES, MAX_LANES = 2, 8
MIN_ROWS_PER_LANE = 16  # lanes added to hide round trips keep at least this many rows each
FALLBACK_CLAIM = 8  # when the swarm cannot be read now (the batch will say why): a small claim
DEFAULT_SESSIONS_PER_PEER = 16  # what servers allow one caller when their record does not say (older ones)
SESSIONS_PER_LANE_SLACK = 2  # a lane may hold two sessions on a server at once: its own and a failover replacement
# the claim holds the rows whose lanes fit the cache share at once, and as many again, leased and waiting to start as
# lanes finish: a finished lane is followed at once by a full one of similar lengths, not by small refills
CLAIM_AHEAD = 2


@dataclass(frozen=True)
class ChainRoom:
    """What the chain a worker routes through can hold for this caller, from the servers' records."""

    rows_per_session: int     # the smallest max_batch_size along the chain
    cache_tokens: int         # tokens per block this caller may reserve on every server of the chain (all sessions)
    sessions: int             # sessions this caller may open on every server of the chain
    compute_seconds: tuple[float, ...]  # per hop: its blocks at its trusted throughput (one decode step)
    rtt_seconds: tuple[float, ...]      # per hop: the round trip to its server
    ceiling: int | None = None  # tokens per block one request may ever reserve on some chain (caller_ceiling)

    def lanes_to_fill(self, *, round_trips: bool = True) -> int:
        """Micro-batches that keep the slowest server busy while a step travels the rest of the chain: one decode
        step's time over the whole chain (compute, and round trips unless not `round_trips`) over the slowest hop's
        compute, plus one for the client's own part (LM head, sampling). Far servers get more lanes in flight."""
        slowest = max(self.compute_seconds, default=0.0)
        chain = sum(self.compute_seconds) + (sum(self.rtt_seconds) if round_trips else 0.0)
        depth = math.ceil(chain / slowest) if slowest > 0 else 1
        return max(MIN_LANES, min(MAX_LANES, depth + 1, self.max_lanes()))

    def lanes_for(self, rows: int) -> int:
        """Lanes for `rows` in flight at once: enough to keep every server and the client busy, and more to hide
        the round trips only while each lane keeps MIN_ROWS_PER_LANE rows (a smaller lane costs the servers more CPU
        per token than the latency it hides: bench/RESULTS.md, session 13)."""
        busy = self.lanes_to_fill(round_trips=False)
        return max(busy, min(self.lanes_to_fill(), rows // MIN_ROWS_PER_LANE))

    def max_lanes(self) -> int:
        """Lanes this caller may run at once without hitting the servers' per-caller session limit."""
        return max(1, self.sessions // SESSIONS_PER_LANE_SLACK)


@dataclass(frozen=True)
class PipelinePlan:
    """What one batch of a worker runs: up to `claim` requests in flight, split into `lanes` micro-batches at first,
    never reserving more than `cache_tokens` per block in `max_lanes` lanes at once, nor more than `rows_per_session`
    rows in one (None: unknown, no limit)."""

    claim: int
    lanes: int
    max_lanes: int
    cache_tokens: int | None = None
    rows_per_session: int | None = None
    bound: str = "set"  # what set the claim, for the log and `status`
    ceiling: int | None = None  # a request needing more KV cache per block can never run (caller_ceiling)

    def as_dict(self) -> dict[str, object]:
        """What the job object and `status` show of it."""
        return {"claim": self.claim, "lanes": self.lanes, "bound": self.bound}

    def describe(self) -> str:
        """One line for the log and `status`: 'claim 32 in 4 lanes (bound: cache share)'."""
        return f"claim {self.claim} in {self.lanes} lanes ({self.bound})"


def lane_reservation(row_tokens: Sequence[int], lanes: int) -> int:
    """Tokens per block the rows reserve when split into `lanes` micro-batches of similar lengths (each session
    reserves its rows x its longest row), as `runner.split_lanes` splits them."""
    ordered = sorted(row_tokens)
    count = min(lanes, len(ordered))
    groups = [ordered[i * len(ordered) // count:(i + 1) * len(ordered) // count] for i in range(count)] if count else []
    return sum(len(group) * group[-1] for group in groups if group)


def plan_pipeline(room: ChainRoom | None, row_tokens: Sequence[int], *, share: int, claim: int | None = None,
                  lanes: int | None = None) -> PipelinePlan:
    """The batch to run, given the chain's room (None: unknown now), the next requests' prompt + max_tokens in claim
    order, and this worker's fair share of the job's open requests. `claim`/`lanes`: explicit settings, which win."""
    if room is None:
        chosen_lanes = lanes or MIN_LANES * 2
        return PipelinePlan(claim or min(FALLBACK_CLAIM, max(1, share)), chosen_lanes, max(chosen_lanes, MAX_LANES),
                            bound="set" if claim else "swarm not read yet")
    chosen_lanes = lanes or room.lanes_to_fill()
    max_lanes = max(chosen_lanes, room.max_lanes())
    if claim is not None:
        return PipelinePlan(claim, chosen_lanes, max_lanes, room.cache_tokens, room.rows_per_session, "set",
                            room.ceiling)
    limits = {"fair share": max(1, share), "max batch size": chosen_lanes * room.rows_per_session,
              "most per worker": MAX_CLAIM, "open requests": max(1, len(row_tokens))}
    bound = min(limits, key=limits.__getitem__)
    count = limits[bound]
    fits = rows_that_fit(row_tokens[:count], chosen_lanes, room.cache_tokens * CLAIM_AHEAD)
    if fits < count:
        count, bound = max(1, fits), "cache share"
    if lanes is None:  # sized here: as many as the rows that fit at once fill (lanes_for), and hold
        at_once = min(count, rows_that_fit(row_tokens[:count], chosen_lanes, room.cache_tokens))
        chosen_lanes = max(room.lanes_for(at_once), -(-at_once // room.rows_per_session))
    return PipelinePlan(count, min(chosen_lanes, count), max_lanes, room.cache_tokens, room.rows_per_session,
                        f"bound: {bound}", room.ceiling)


def rows_that_fit(row_tokens: Sequence[int], lanes: int, cache_tokens: int) -> int:
    """The most leading rows whose lanes' reservation fits in `cache_tokens` per block (binary search: the
    reservation grows with every row)."""
    low, high = 0, len(row_tokens)
    while low < high:
        middle = (low + high + 1) // 2
        if lane_reservation(row_tokens[:middle], lanes) <= cache_tokens:
            low = middle
        else:
            high = middle - 1
    return low


async def chain_room(swarm: Swarm) -> ChainRoom:
    """The room of the chain a session would be routed through now (reads the DHT, pings servers not pinged yet,
    asks each hop what this caller may reserve now; raises what `Swarm.route` raises)."""
    route = await swarm.route(0, swarm.num_blocks)
    spans = {span.peer_id: span for span in await swarm.member_spans()}
    hops = [(hop, spans[hop.peer_id]) for hop in route if hop.peer_id in spans]
    throughputs = swarm.trusted_throughputs([span for _, span in hops])
    answers = await asyncio.gather(*(swarm.call_info(hop.peer_id) for hop, _ in hops), return_exceptions=True)
    return ChainRoom(
        rows_per_session=min(span.info.max_batch_size for _, span in hops),
        cache_tokens=min(caller_cache_tokens(span, answer) for (_, span), answer in zip(hops, answers, strict=True)),
        sessions=min(span.info.max_sessions_per_peer or DEFAULT_SESSIONS_PER_PEER for _, span in hops),
        compute_seconds=tuple(hop_cost(span, hop.end - hop.start, 0.0, throughputs[hop.peer_id]) for hop, span in hops),
        rtt_seconds=tuple(swarm.rtts.get(hop.peer_id, DEFAULT_RTT) for hop, _ in hops),
        ceiling=caller_ceiling(list(spans.values()), swarm.num_blocks))


def caller_ceiling(spans: Sequence[RemoteSpanInfo], num_blocks: int) -> int | None:
    """Tokens per block one request may ever reserve: per block, the most that any member server holding it grants
    one caller (alone, while lent: `cache_tokens_most_per_peer`); the least of those over the blocks. None when it
    cannot be known: a block without servers (routing says so), or a server that does not say (an older one)."""
    most: list[int | None] = [0] * num_blocks
    for span in spans:
        grants = span.info.cache_tokens_most_per_peer
        for index in range(span.start, min(span.end, num_blocks)):
            current = most[index]
            most[index] = None if grants is None or current is None else max(current, grants)
    if any(value is None or value == 0 for value in most):
        return None
    return min(value for value in most if value is not None)


def caller_cache_tokens(span: RemoteSpanInfo, answer: dict[str, Any] | BaseException) -> int:
    """Tokens per block this caller may reserve on a server: what its `info` answer says now (within its share, or
    within what the server lends a caller alone), else what its DHT record said (up to one announce period old)."""
    live = answer.get("cache_tokens_for_caller") if isinstance(answer, dict) else None
    if isinstance(live, int) and not isinstance(live, bool) and live >= 0:
        return live
    return min(span.info.cache_tokens_left, span.info.cache_tokens_per_peer or span.info.cache_tokens_left)
