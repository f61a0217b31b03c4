"""Pure routing: from the servers' spans, measured round trips and bans to a chain of hops. No I/O here.

A route is a shortest path over block boundaries 0..n: an edge i -> j exists through a server whose span
covers [i, j), and costs its round-trip time plus (j - i) block-steps at its throughput. So the route prefers
fast servers and few hops, and can splice sub-spans of different servers.

The throughput is the one the client trusts (`trusted_throughput`): a DHT record can be written by anyone who
can reach the DHT, so its figure is only believed up to what the server itself answered to our `info` call and
what the client measured of its steps. A server is left out when it announced too little free KV cache for
the session on the blocks it would serve (`has_room`): dialling it would only earn a refusal and a ban.
"""
from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping

from swarmclient.data_structures import RemoteSpanInfo, RouteHop

DEFAULT_RTT = 0.05  # seconds assumed for a server we have not pinged yet


def missing_ranges(spans: list[RemoteSpanInfo], start: int, end: int) -> list[tuple[int, int]]:
    """Block ranges in [start, end) that no span covers, merged, e.g. [(3, 5)]."""
    covered = [False] * (end - start)
    for span in spans:
        for i in range(max(span.start, start), min(span.end, end)):
            covered[i - start] = True
    ranges: list[tuple[int, int]] = []
    for offset, ok in enumerate(covered):
        i = start + offset
        if ok:
            continue
        if ranges and ranges[-1][1] == i:
            ranges[-1] = (ranges[-1][0], i + 1)
        else:
            ranges.append((i, i + 1))
    return ranges


def trusted_throughput(announced: float, *measured: float | None) -> float:
    """The block-steps/s routing uses: the lowest of the record's figure and the measured ones that exist.

    `measured`: the figure the server gave in its own `info` answer (what it claims to its caller, who can hold it
    to it), and the best rate the client saw in its steps (blocks / seconds of a decode step, network included).
    A measurement only ever lowers the record's figure: an inflated record stops winning routes once the
    server is pinged or used, and an honest one loses at most the network's share of its step time.
    """
    return max(min([announced, *(m for m in measured if m is not None)]), 0.0)


def hop_cost(span: RemoteSpanInfo, num_blocks: int, rtt: float, throughput: float | None = None) -> float:
    """Estimated seconds for one decode step through `num_blocks` blocks of this server.

    throughput: block-steps/s to use (default: the announced one)."""
    speed = span.info.throughput if throughput is None else throughput
    return rtt + num_blocks / max(speed, 1e-6)


def has_room(span: RemoteSpanInfo, num_blocks: int, session_tokens: int) -> bool:
    """Whether the server announced free KV cache for a session of `session_tokens` (batch x max_length) tokens
    on `num_blocks` of its blocks. The record's figure is per block over its whole span; 0 tokens always fit.

    Routing asks it for every block of [start, end) the server holds, not per hop: a route may hold one server
    in two hops, and both reserve."""
    free = span.info.cache_tokens_left * (span.info.end - span.info.start)
    return session_tokens * num_blocks <= free


def min_latency_route(
    spans: list[RemoteSpanInfo],
    start: int,
    end: int,
    *,
    rtts: Mapping[str, float] | None = None,
    banned: Collection[str] = (),
    throughputs: Mapping[str, float] | None = None,
    session_tokens: int = 0,
) -> list[RouteHop] | None:
    """The cheapest chain of hops covering blocks [start, end), or None if some block is uncovered.

    throughputs: per peer, the block-steps/s to trust (`trusted_throughput`); a peer not named keeps its record's.
    session_tokens: batch x max_length of the session to open; servers without room for it are left out.
    """
    rtts, throughputs = rtts or {}, throughputs or {}
    usable = [s for s in spans if s.peer_id not in banned and s.end > start and s.start < end
              and has_room(s, min(s.end, end) - max(s.start, start), session_tokens)]
    best: dict[int, float] = {start: 0.0}
    came_from: dict[int, RouteHop] = {}
    queue: list[tuple[float, int]] = [(0.0, start)]
    while queue:
        cost, i = heapq.heappop(queue)
        if i == end:
            return _unwind(came_from, start, end)
        if cost > best.get(i, float("inf")):
            continue
        for span in usable:
            if not span.start <= i < span.end:
                continue
            rtt, speed = rtts.get(span.peer_id, DEFAULT_RTT), throughputs.get(span.peer_id)
            for j in range(i + 1, min(span.end, end) + 1):
                new_cost = cost + hop_cost(span, j - i, rtt, speed)
                # ties go to the longer hop (fewer servers); the epsilon keeps float noise from flipping it
                if new_cost < best.get(j, float("inf")) - 1e-12:
                    best[j] = new_cost
                    came_from[j] = RouteHop(span.peer_id, i, j)
                    heapq.heappush(queue, (new_cost, j))
    return None


def _unwind(came_from: dict[int, RouteHop], start: int, end: int) -> list[RouteHop]:
    route: list[RouteHop] = []
    position = end
    while position != start:
        hop = came_from[position]
        route.append(hop)
        position = hop.start
    return route[::-1]
