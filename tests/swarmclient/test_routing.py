"""Routing is pure: spans, round trips and bans in, hops out."""
from __future__ import annotations

from factories import block_infos, span

from swarmclient.data_structures import RouteHop, ServerState
from swarmclient.discovery import online_spans
from swarmclient.routing import min_latency_route, missing_ranges


def test_a_single_server_holding_everything_is_one_hop() -> None:
    route = min_latency_route([span("a", 0, 8)], 0, 8)
    assert route == [RouteHop("a", 0, 8)]


def test_a_route_chains_servers_that_together_cover_all_blocks() -> None:
    route = min_latency_route([span("a", 0, 4), span("b", 4, 8)], 0, 8)
    assert route == [RouteHop("a", 0, 4), RouteHop("b", 4, 8)]


def test_the_route_prefers_fewer_hops_when_servers_are_equally_fast() -> None:
    route = min_latency_route([span("full", 0, 8), span("a", 0, 4), span("b", 4, 8)], 0, 8)
    assert route == [RouteHop("full", 0, 8)]


def test_a_slow_full_server_loses_to_two_fast_halves() -> None:
    spans = [span("full", 0, 8, throughput=10.0), span("a", 0, 4, throughput=1000.0), span("b", 4, 8, throughput=1000.0)]
    route = min_latency_route(spans, 0, 8, rtts={"full": 0.001, "a": 0.001, "b": 0.001})
    assert [h.peer_id for h in route or []] == ["a", "b"]


def test_a_high_round_trip_time_steers_the_route_away() -> None:
    spans = [span("far", 0, 8), span("near", 0, 8)]
    route = min_latency_route(spans, 0, 8, rtts={"far": 0.5, "near": 0.001})
    assert route == [RouteHop("near", 0, 8)]


def test_banned_servers_are_never_routed_through() -> None:
    spans = [span("full", 0, 8), span("a", 0, 4), span("b", 4, 8)]
    route = min_latency_route(spans, 0, 8, banned={"full"})
    assert route == [RouteHop("a", 0, 4), RouteHop("b", 4, 8)]


def test_overlapping_servers_are_spliced_by_sub_spans() -> None:
    route = min_latency_route([span("a", 0, 6), span("b", 3, 8)], 0, 8)
    assert route is not None and route[0] == RouteHop("a", 0, route[0].end) and route[-1].end == 8
    assert route[0].end == route[1].start and 3 <= route[0].end <= 6


def test_a_sub_range_is_routed_for_a_replacement() -> None:
    route = min_latency_route([span("a", 0, 8)], 2, 5)
    assert route == [RouteHop("a", 2, 5)]


def test_no_route_exists_when_a_block_is_uncovered() -> None:
    assert min_latency_route([span("a", 0, 3), span("b", 5, 8)], 0, 8) is None


def test_missing_ranges_are_merged_and_named() -> None:
    assert missing_ranges([span("a", 0, 3), span("b", 5, 7)], 0, 10) == [(3, 5), (7, 10)]
    assert missing_ranges([span("a", 0, 10)], 0, 10) == []


def test_only_online_servers_make_spans() -> None:
    infos = block_infos(8, span("on", 0, 4), span("joining", 4, 8, state=ServerState.JOINING),
                        span("gone", 4, 8, state=ServerState.OFFLINE))
    assert [(s.peer_id, s.start, s.end) for s in online_spans(infos)] == [("on", 0, 4)]


def test_a_server_speaking_another_protocol_version_is_never_routed_to() -> None:
    infos = block_infos(8, span("new", 0, 8), span("old", 0, 8, version="swarmbatch/1"))
    assert [s.peer_id for s in online_spans(infos)] == ["new"]
    assert missing_ranges(online_spans(block_infos(8, span("old", 0, 8, version="swarmbatch/1"))), 0, 8) == [(0, 8)]
