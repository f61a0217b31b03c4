"""Pure routing: from the servers' spans, measured round trips and bans to a chain of hops. No I/O here.

A route is a shortest path over block boundaries 0..n: an edge i -> j exists through a server whose span
covers [i, j), and costs its round-trip time plus (j - i) block-steps at its announced throughput. So the
route prefers fast servers and few hops, and can splice sub-spans of different servers.
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


def hop_cost(span: RemoteSpanInfo, num_blocks: int, rtt: float) -> float:
    """Estimated seconds for one decode step through `num_blocks` blocks of this server."""
    return rtt + num_blocks / max(span.info.throughput, 1e-6)


def min_latency_route(
    spans: list[RemoteSpanInfo],
    start: int,
    end: int,
    *,
    rtts: Mapping[str, float] | None = None,
    banned: Collection[str] = (),
) -> list[RouteHop] | None:
    """The cheapest chain of hops covering blocks [start, end), or None if some block is uncovered."""
    rtts = rtts or {}
    usable = [s for s in spans if s.peer_id not in banned and s.end > start and s.start < end]
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
            rtt = rtts.get(span.peer_id, DEFAULT_RTT)
            for j in range(i + 1, min(span.end, end) + 1):
                new_cost = cost + hop_cost(span, j - i, rtt)
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
