"""Pure routing: from the servers' spans, measured round trips and bans to a chain of hops. No I/O here.

A route is a shortest path over block boundaries 0..n: an edge i -> j exists through a server whose span
covers [i, j), and costs its round-trip time plus (j - i) block-steps at its throughput. So the route prefers
fast servers and few hops, and can splice sub-spans of different servers.

The throughput is the one the client trusts (`trusted_throughput`): a DHT record can be written by anyone who
can reach the DHT, so its figure is only believed up to what the server itself answered to our `info` call and
what the client measured of its steps. A server is left out when it announced too little free KV cache for
the session on the blocks it would serve (`has_room`): dialling it would only earn a refusal and a ban.

With server-to-server push (`pushed_route`) a step goes client -> server 1 -> server 2 -> ... -> client, so a chain
costs half the client's round trip to its first and last servers plus half the round trip between each server and
the next, which servers measure to the servers that may follow them and report in their `info` answers. A report
is held to the triangle inequality on what the client measured itself (a link is at least as long as the
difference of the client's round trips to its ends), and a link nobody reported costs what relaying it through
the client would (the sum of the client's round trips to both ends): so servers close to each other win over a
chain that zigzags across the WAN, and a server claiming a short link gains at most the difference.

A machine's compute is shared by the sessions on it (`machine_loads`): a hop's compute counts (1 + the sessions it
shares compute with beyond those of the least loaded server) times. They are this client's own sessions on the
server's machine, live, and other callers' sessions on that server alone, as it last answered this client's ping
(`Swarm.others`; pinged again before a session opens where it is older than `load_max_age`): a server speaks for
itself, not for the machine it names. So a worker's lanes spread over the holders of a span on different machines
instead of all taking the fastest, a second worker's lanes go where the first's are not, and servers of one machine
that nobody else uses are chosen between exactly as before. Other callers' sessions come from the server's own
answer, not from its DHT record (which anyone may write and which lags by an announce period): a server that
under-reports them gains sessions as one overstating its throughput would, and loses them again once this client's
steps through it measure slow.
"""
from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Collection, Mapping

from swarmnet.data_structures import RemoteSpanInfo, RouteHop
from swarmnet.discovery import uncovered_ranges

DEFAULT_RTT = 0.05  # seconds assumed for a server we have not pinged yet


def missing_ranges(spans: list[RemoteSpanInfo], start: int, end: int) -> list[tuple[int, int]]:
    """Block ranges in [start, end) that no span covers, merged, e.g. [(3, 5)]."""
    covered = [False] * (end - start)
    for span in spans:
        for i in range(max(span.start, start), min(span.end, end)):
            covered[i - start] = True
    return uncovered_ranges(covered, start)


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


def machine_loads(spans: list[RemoteSpanInfo], held: Mapping[str, int],
                  others: Mapping[str, int] | None = None) -> dict[str, int]:
    """Per server, how many more sessions it shares compute with than the least loaded server among `spans` does:
    this client's (`held`, by peer id) on all servers of its machine, plus other callers' (`others`) on it alone.
    0 everywhere when all are on one machine and nobody else holds sessions (or all are equally loaded), so routing
    chooses between them exactly as without load. A server that names no machine is one of its own; a record naming
    another server's machine adds load there only where this client holds sessions on that record's server, and a
    server's count of other callers' sessions loads that server only (it speaks for itself, not for its machine)."""
    machine = {s.peer_id: s.info.machine or f"peer:{s.peer_id}" for s in spans}
    ours: Counter[str] = Counter(dict.fromkeys(machine.values(), 0))
    for peer, name in machine.items():
        ours[name] += held.get(peer, 0)
    others = others or {}
    load = {peer: ours[name] + others.get(peer, 0) for peer, name in machine.items()}
    least = min(load.values(), default=0)
    return {peer: count - least for peer, count in load.items()}


def shared_speed(span: RemoteSpanInfo, throughputs: Mapping[str, float], loads: Mapping[str, int]) -> float:
    """The block-steps/s a new session gets from a server: its trusted throughput (its record's where `throughputs`
    does not name it), shared 1 + its machine's load ways (`machine_loads`)."""
    return throughputs.get(span.peer_id, span.info.throughput) / (1 + loads.get(span.peer_id, 0))


def min_latency_route(
    spans: list[RemoteSpanInfo],
    start: int,
    end: int,
    *,
    rtts: Mapping[str, float] | None = None,
    banned: Collection[str] = (),
    throughputs: Mapping[str, float] | None = None,
    session_tokens: int = 0,
    loads: Mapping[str, int] | None = None,
) -> list[RouteHop] | None:
    """The cheapest chain of hops covering blocks [start, end), or None if some block is uncovered.

    throughputs: per peer, the block-steps/s to trust (`trusted_throughput`); a peer not named keeps its record's.
    session_tokens: batch x max_length of the session to open; servers without room for it are left out.
    loads: per peer, the sessions open on its machine (`machine_loads`): its compute counts 1 + that many times.
    """
    rtts, throughputs, loads = rtts or {}, throughputs or {}, loads or {}
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
            rtt, speed = rtts.get(span.peer_id, DEFAULT_RTT), shared_speed(span, throughputs, loads)
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


def link_rtt(first: str, second: str, rtts: Mapping[str, float], links: Mapping[tuple[str, str], float]) -> float:
    """The round trip routing assumes from server `first` to server `second`: the reported one, held to the triangle
    inequality on the client's own round trips; a link nobody reported costs a relay through the client."""
    to_first, to_second = rtts.get(first, DEFAULT_RTT), rtts.get(second, DEFAULT_RTT)
    reported = links.get((first, second))
    if reported is None:
        return to_first + to_second
    return max(reported, abs(to_first - to_second))


def pushed_route(
    spans: list[RemoteSpanInfo],
    start: int,
    end: int,
    *,
    rtts: Mapping[str, float] | None = None,
    links: Mapping[tuple[str, str], float] | None = None,
    banned: Collection[str] = (),
    throughputs: Mapping[str, float] | None = None,
    session_tokens: int = 0,
    loads: Mapping[str, int] | None = None,
) -> list[RouteHop] | None:
    """`min_latency_route` for push: the cheapest chain when each server pushes to the next (links: round trips
    servers reported to the servers after them, (from, to) -> seconds). A shortest path over (block boundary, last
    server) states, since what a hop costs depends on the server before it."""
    rtts, links, throughputs, loads = rtts or {}, links or {}, throughputs or {}, loads or {}
    usable = [s for s in spans if s.peer_id not in banned and s.end > start and s.start < end
              and has_room(s, min(s.end, end) - max(s.start, start), session_tokens)]
    State = tuple[int, str]
    best: dict[State, float] = {}
    came_from: dict[State, tuple[State | None, RouteHop]] = {}
    queue: list[tuple[float, int, str]] = [(0.0, start, "")]  # "": no server yet (the client sends)
    while queue:
        cost, i, peer = heapq.heappop(queue)
        state = (i, peer)
        if i == end:
            return _unwind_states(came_from, state)
        if cost > best.get(state, float("inf")):
            continue
        for span in usable:
            if not span.start <= i < span.end or span.peer_id == peer:  # a server never pushes to itself
                continue
            arrive = rtts.get(span.peer_id, DEFAULT_RTT) if not peer else link_rtt(peer, span.peer_id, rtts, links)
            speed = shared_speed(span, throughputs, loads)
            for j in range(i + 1, min(span.end, end) + 1):
                leave = rtts.get(span.peer_id, DEFAULT_RTT) / 2 if j == end else 0.0
                new_cost = cost + arrive / 2 + (j - i) / max(speed, 1e-6) + leave
                target = (j, span.peer_id)
                if new_cost < best.get(target, float("inf")) - 1e-12:
                    best[target] = new_cost
                    came_from[target] = (state if peer else None, RouteHop(span.peer_id, i, j))
                    heapq.heappush(queue, (new_cost, j, span.peer_id))
    return None


def _unwind_states(came_from: dict[tuple[int, str], tuple[tuple[int, str] | None, RouteHop]],
                   state: tuple[int, str]) -> list[RouteHop]:
    route: list[RouteHop] = []
    current: tuple[int, str] | None = state
    while current is not None:
        previous, hop = came_from[current]
        route.append(hop)
        current = previous
    return route[::-1]
