"""Routing is pure: spans, round trips and bans in, hops out."""
from __future__ import annotations

from factories import block_infos, span

from swarmclient.routing import (
    has_room,
    link_rtt,
    machine_loads,
    min_latency_route,
    missing_ranges,
    pushed_route,
    trusted_throughput,
)
from swarmnet.data_structures import RemoteSpanInfo, RouteHop, ServerState, SpanMove
from swarmnet.discovery import online_spans


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



def test_a_moved_servers_stale_records_of_its_old_span_are_not_joined_to_its_new_span() -> None:
    # a server moved 0:4 -> 4:8; a DHT node still holds its ONLINE records of 0:4 (announced before the move)
    old = span("mover", 0, 4)
    moved = SpanMove(at=5.0, start=4, end=8, from_start=0, from_end=4, reason="a hole")
    new = span("mover", 4, 8)
    new = RemoteSpanInfo("mover", 4, 8, new.info.model_copy(update={"moves": (moved,), "rebalances": True}))
    infos = block_infos(8, old, new)
    assert [(s.peer_id, s.start, s.end) for s in online_spans(infos)] == [("mover", 4, 8)]

# ---- what routing trusts: measurements over records, and the free cache servers announce -----------------------------

def test_the_trusted_throughput_is_the_lowest_figure_known() -> None:
    assert trusted_throughput(1000.0) == 1000.0
    assert trusted_throughput(1000.0, None, None) == 1000.0
    assert trusted_throughput(1000.0, 800.0, None) == 800.0      # the server's own info answer
    assert trusted_throughput(1000.0, None, 30.0) == 30.0        # what our steps through it took
    assert trusted_throughput(1000.0, 800.0, 30.0) == 30.0
    assert trusted_throughput(50.0, 800.0, 300.0) == 50.0        # a measurement never raises a modest record


def test_an_overstated_record_stops_winning_once_its_server_is_measured() -> None:
    spans = [span("boaster", 0, 8, throughput=100_000.0), span("honest", 0, 8, throughput=100.0)]
    rtts = {"boaster": 0.001, "honest": 0.001}
    assert min_latency_route(spans, 0, 8, rtts=rtts) == [RouteHop("boaster", 0, 8)]
    measured = {"boaster": trusted_throughput(100_000.0, 100_000.0, 20.0)}  # info repeats the lie; the steps do not
    assert min_latency_route(spans, 0, 8, rtts=rtts, throughputs=measured) == [RouteHop("honest", 0, 8)]


def test_a_server_without_room_for_the_session_is_left_out() -> None:
    spans = [span("full", 0, 8, throughput=10_000.0, cache_tokens_left=10), span("roomy", 0, 8)]
    assert min_latency_route(spans, 0, 8) == [RouteHop("full", 0, 8)]
    assert min_latency_route(spans, 0, 8, session_tokens=64) == [RouteHop("roomy", 0, 8)]   # e.g. batch 2 x 32
    assert min_latency_route(spans, 0, 8, session_tokens=10) == [RouteHop("full", 0, 8)]    # exactly fits


def test_room_is_counted_for_the_blocks_the_server_would_serve() -> None:
    # 'big' has 8 blocks x 40 free tokens = 320 block-tokens: a 64-token session fits on 5 of its blocks, not 8
    big = span("big", 0, 8, throughput=10_000.0, cache_tokens_left=40)
    assert has_room(big, 5, 64) and not has_room(big, 6, 64)
    assert min_latency_route([big, span("slow", 0, 8, throughput=1.0)], 0, 8, session_tokens=64) == \
        [RouteHop("slow", 0, 8)]                      # not two hops through 'big': both would reserve
    assert min_latency_route([big], 3, 8, session_tokens=64) == [RouteHop("big", 3, 8)]  # a 5-block repair fits


def test_without_any_room_there_is_no_route_through_full_servers() -> None:
    spans = [span("a", 0, 8, cache_tokens_left=1)]
    assert min_latency_route(spans, 0, 8, session_tokens=64) is None   # Swarm.route then falls back to them
    assert min_latency_route(spans, 0, 8) == [RouteHop("a", 0, 8)]


# ---- with server-to-server push: the links between servers count ---------------------------------------------------
def two_chains() -> list:
    """Chains a1 -> a2 and b1 -> b2 over blocks 0:4 and 4:8, every server 20 ms from the client."""
    return [span(peer, start, end) for peer, start, end in
            [("a1", 0, 4), ("a2", 4, 8), ("b1", 0, 4), ("b2", 4, 8)]]


CLIENT_RTTS = {"a1": 0.02, "a2": 0.02, "b1": 0.02, "b2": 0.02}


def test_with_push_the_chain_whose_servers_are_close_to_each_other_wins() -> None:
    # a1 -> a2 is 1 ms, b1 -> b2 is 40 ms, and the zigzags a1 -> b2, b1 -> a2 80 ms
    links = {("a1", "a2"): 0.001, ("b1", "b2"): 0.04, ("a1", "b2"): 0.08, ("b1", "a2"): 0.08}
    route = pushed_route(two_chains(), 0, 8, rtts=CLIENT_RTTS, links=links)
    assert route == [RouteHop("a1", 0, 4), RouteHop("a2", 4, 8)]
    # and the other way round
    links = {("a1", "a2"): 0.04, ("b1", "b2"): 0.001, ("a1", "b2"): 0.08, ("b1", "a2"): 0.08}
    route = pushed_route(two_chains(), 0, 8, rtts=CLIENT_RTTS, links=links)
    assert route == [RouteHop("b1", 0, 4), RouteHop("b2", 4, 8)]


def test_a_reported_link_is_held_to_what_the_client_measured() -> None:
    # b1 claims 0 ms to b2, but the client is 1 ms from b1 and 60 ms from b2: that link is at least 59 ms long
    rtts = {"a1": 0.02, "a2": 0.02, "b1": 0.001, "b2": 0.06}
    links = {("a1", "a2"): 0.005, ("b1", "b2"): 0.0, ("b1", "a2"): 0.08, ("a1", "b2"): 0.08}
    assert link_rtt("b1", "b2", rtts, links) == 0.059
    assert [h.peer_id for h in pushed_route(two_chains(), 0, 8, rtts=rtts, links=links) or []] == ["a1", "a2"]


def test_an_unreported_link_costs_a_relay_through_the_client() -> None:
    assert link_rtt("a1", "a2", CLIENT_RTTS, {}) == 0.04
    links = {("b1", "b2"): 0.01}  # only b1 reported its link: 10 ms beats a relayed 40 ms
    assert [h.peer_id for h in pushed_route(two_chains(), 0, 8, rtts=CLIENT_RTTS, links=links) or []] == ["b1", "b2"]


def test_a_pushed_route_never_pushes_a_server_to_itself_and_skips_banned_servers() -> None:
    spans = [span("full", 0, 8), span("a", 0, 4), span("b", 4, 8)]
    assert pushed_route(spans, 0, 8) == [RouteHop("full", 0, 8)]
    assert pushed_route(spans, 0, 8, banned={"full"}) == [RouteHop("a", 0, 4), RouteHop("b", 4, 8)]
    assert pushed_route([span("a", 0, 4)], 0, 8) is None


def chains_on(machines: dict[str, str]) -> list:
    """two_chains' servers on the named machines."""
    return [span(peer, start, end, machine=machines[peer])
            for peer, start, end in [("a1", 0, 4), ("a2", 4, 8), ("b1", 0, 4), ("b2", 4, 8)]]


SAME_LINKS = {(one, other): 0.001 for one in ("a1", "b1") for other in ("a2", "b2")}


def test_a_clients_sessions_spread_over_machines() -> None:
    # Given chains a1 -> a2 on machine A and b1 -> b2 on machine B, equally fast and equally far
    spans = chains_on({"a1": "A", "a2": "A", "b1": "B", "b2": "B"})
    first = pushed_route(spans, 0, 8, rtts=CLIENT_RTTS, links=SAME_LINKS)
    assert first is not None and {h.peer_id[0] for h in first} in ({"a"}, {"b"})
    # When the client holds a session on the chain it took, the next session takes the other machine's
    held = {hop.peer_id: 1 for hop in first}
    loads = machine_loads(spans, held)
    second = pushed_route(spans, 0, 8, rtts=CLIENT_RTTS, links=SAME_LINKS, loads=loads)
    assert second is not None and {h.peer_id[0] for h in second} == {"a", "b"} - {first[0].peer_id[0]}
    assert min_latency_route(spans, 0, 8, rtts=CLIENT_RTTS, loads=loads) == second
    # and with one session on each machine, a third goes to either, as the first did
    both = machine_loads(spans, {hop.peer_id: 1 for hop in first + second})
    assert pushed_route(spans, 0, 8, rtts=CLIENT_RTTS, links=SAME_LINKS, loads=both) == first


def test_servers_of_one_machine_share_its_load_and_are_chosen_between_as_before() -> None:
    # Given all four servers on one machine, the client holding a session on the a chain
    spans = chains_on(dict.fromkeys(("a1", "a2", "b1", "b2"), "M"))
    loads = machine_loads(spans, {"a1": 1, "a2": 1})
    assert set(loads.values()) == {0}  # no machine carries more of them than another
    # Then the next session routes as it would with no session held: another process of the machine is no faster
    for links in (SAME_LINKS, {**SAME_LINKS, ("b1", "b2"): 0.0005}):
        assert pushed_route(spans, 0, 8, rtts=CLIENT_RTTS, links=links, loads=loads) == \
            pushed_route(spans, 0, 8, rtts=CLIENT_RTTS, links=links)


def test_a_record_naming_another_servers_machine_loads_it_only_with_this_clients_sessions_on_the_record() -> None:
    # Given a stranger's record naming honest's machine, on which this client holds no session
    spans = [span("honest", 0, 8, machine="H"), span("liar", 0, 8, machine="H", throughput=10.0),
             span("old", 0, 8)]
    # Then honest's machine carries no load, and a server naming no machine is one of its own
    assert machine_loads(spans, {}) == {"honest": 0, "liar": 0, "old": 0}
    assert machine_loads(spans, {"old": 2}) == {"honest": 0, "liar": 0, "old": 2}
    assert machine_loads(spans, {"liar": 1}) == {"honest": 1, "liar": 1, "old": 0}
    # (loads are counted beyond the least loaded machine's)
    assert machine_loads(spans, {"liar": 1, "old": 3}) == {"honest": 0, "liar": 0, "old": 2}


def test_other_callers_sessions_send_a_new_session_to_the_machine_they_leave_free() -> None:
    # Given chains a1 -> a2 on machine A and b1 -> b2 on machine B, equally fast, this client holding no session
    spans = chains_on({"a1": "A", "a2": "A", "b1": "B", "b2": "B"})
    for busy, free in (("a", "b"), ("b", "a")):
        # When other callers hold a session on each server of one chain (as those servers answered our pings)
        loads = machine_loads(spans, {}, {f"{busy}1": 1, f"{busy}2": 1})
        # Then the new session takes the other chain, with push or without
        route = pushed_route(spans, 0, 8, rtts=CLIENT_RTTS, links=SAME_LINKS, loads=loads)
        assert route is not None and {h.peer_id[0] for h in route} == {free}
        assert min_latency_route(spans, 0, 8, rtts=CLIENT_RTTS, loads=loads) == route
    # and other callers' sessions spread evenly over both machines load neither more than the other
    assert set(machine_loads(spans, {}, dict.fromkeys(("a1", "a2", "b1", "b2"), 3)).values()) == {0}


def test_a_servers_count_of_other_callers_sessions_loads_that_server_alone() -> None:
    # Given a stranger's server naming honest's machine and answering that others hold 1000 sessions on it
    spans = [span("honest", 0, 8, machine="H"), span("liar", 0, 8, machine="H"), span("old", 0, 8)]
    # Then only the stranger's server carries them: a server speaks for itself, not for the machine it names
    assert machine_loads(spans, {}, {"liar": 1000}) == {"honest": 0, "liar": 1000, "old": 0}
    # while this client's own sessions on it still load the machine it named, as before
    assert machine_loads(spans, {"liar": 1}, {"liar": 1000}) == {"honest": 1, "liar": 1001, "old": 0}
