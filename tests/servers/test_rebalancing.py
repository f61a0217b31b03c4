"""When an unpinned server moves its span, and where: pure functions over a coverage snapshot, no network."""
from __future__ import annotations

import pytest
from factories import block_infos, server_info, span

from servers.config import ServerConfig
from servers.errors import ServerConfigError
from servers.rebalancing import Holder, coverage, holders_of, holes, plan, turn
from swarmnet.data_structures import RemoteSpanInfo, ServerState, SpanMove

QUALITY, COOLDOWN = 0.75, 300.0


def holder(peer: str, start: int, end: int, throughput: float = 100.0, **kwargs: object) -> Holder:
    return Holder(peer, start, end, throughput, movable=True, **kwargs)  # type: ignore[arg-type]


def moves(holders: list[Holder], num_blocks: int, now: float = 1000.0) -> list[tuple[str, int, int]]:
    return [(m.peer_id, m.start, m.end) for m in plan(holders, num_blocks, quality=QUALITY, cooldown=COOLDOWN, now=now)]


def test_a_hole_is_filled_by_a_server_whose_blocks_others_also_hold() -> None:
    holders = [holder("a", 0, 15), holder("b", 0, 15)]
    planned = plan(holders, 30, quality=QUALITY, cooldown=COOLDOWN, now=0.0)
    assert [(m.peer_id, m.start, m.end, m.holes) for m in planned] == [("a", 15, 30, 0), ("b", 15, 30, 0)]
    assert planned[0].reason == "no server held blocks 15:30"


def test_a_server_never_leaves_a_block_it_alone_holds() -> None:
    assert moves([holder("a", 0, 15), holder("b", 5, 20)], 30) == []


def test_pinned_servers_never_move() -> None:
    assert moves([Holder("a", 0, 15, 100.0), Holder("b", 0, 15, 100.0)], 30) == []


def test_a_move_must_raise_the_bottleneck_by_a_clear_margin() -> None:
    # 3 + 1 -> 2 + 2 doubles the bottleneck: a move; 2 + 2 with unequal speeds gains less than a third: none
    assert moves([holder("a", 0, 5), holder("b", 0, 5), holder("c", 0, 5), holder("d", 5, 10)], 10)[0][1:] == (5, 10)
    assert moves([holder("a", 0, 5, 130.0), holder("b", 0, 5), holder("c", 5, 10), holder("d", 5, 10)], 10) == []


def test_a_server_that_moved_recently_closes_holes_but_does_not_chase_the_bottleneck() -> None:
    cooling = [holder("a", 0, 5, last_move=900.0), holder("b", 0, 5, last_move=900.0), holder("c", 0, 5, last_move=900.0),
               holder("d", 5, 10)]
    assert moves(cooling, 10, now=1000.0) == []
    assert moves(cooling, 10, now=1200.0) != []
    assert moves([holder("a", 0, 5, last_move=999.0), holder("b", 0, 5, last_move=999.0)], 10)[0] == ("a", 5, 10)


def test_no_bottleneck_move_while_a_server_is_joining() -> None:
    transit = [holder("a", 0, 5), holder("b", 0, 5), holder("c", 0, 5), holder("d", 5, 10, joining=True)]
    assert moves(transit, 10) == []


def test_only_the_first_candidate_moves_and_the_next_after_its_patience() -> None:
    planned = plan([holder("a", 0, 15), holder("b", 0, 15)], 30, quality=QUALITY, cooldown=COOLDOWN, now=0.0)
    assert turn(planned, "a", 0) is planned[0]
    assert [turn(planned, "b", waited) for waited in range(3)] == [None, None, None]
    assert turn(planned, "b", 3) is planned[1]
    assert turn(planned, "c", 99) is None


def test_the_snapshot_counts_online_and_joining_members_in_their_announced_span() -> None:
    moved = server_info(0, 3).model_copy(update={"rebalances": True, "moves": (
        SpanMove(at=5.0, start=0, end=3, from_start=3, from_end=6, reason="x"),)})
    infos = block_infos(6, RemoteSpanInfo("a", 0, 3, moved), span("b", 3, 6, state=ServerState.JOINING),
                        span("gone", 3, 6, state=ServerState.OFFLINE), span("stranger", 0, 6))
    infos[4]["stale"] = server_info(0, 2)  # a record left under a block its server no longer announces
    infos[1]["a"] = server_info(1, 2)  # an older record of a's, from before its move, under a block it announced
    found = holders_of(infos, allows=lambda peer: peer != "stranger")
    assert found == [Holder("a", 0, 3, 100.0, movable=True, last_move=5.0), Holder("b", 3, 6, 100.0, joining=True)]
    assert holes(coverage(found[:1], 6)) == [(3, 6)]


def test_a_server_of_another_protocol_version_leaves_its_blocks_a_hole_to_fill() -> None:
    # clients never route to it (swarmnet.discovery.online_spans), so its blocks count as uncovered
    infos = block_infos(6, span("a", 0, 3), span("old", 3, 6, version="swarmbatch/1"))
    assert [h.peer_id for h in holders_of(infos, allows=lambda peer: True)] == ["a"]


@pytest.mark.parametrize(("field", "value", "message"), [
    ("balance_quality", 0.0, r"^--balance-quality 0 is outside \(0, 1\]; pass e.g. 0.75"),
    ("balance_quality", 1.5, r"^--balance-quality 1.5 is outside \(0, 1\]"),
    ("move_cooldown", -1.0, r"^--move-cooldown -1 is negative; pass 0 or more seconds$"),
    ("rebalance_period", -5.0, r"^--rebalance-period -5 is negative"),
    ("throughput", 0.0, r"^--throughput 0 is not positive; pass the block-steps per second"),
])
def test_a_rebalancing_option_out_of_range_is_refused_naming_it(field: str, value: float, message: str) -> None:
    with pytest.raises(ServerConfigError, match=message):
        ServerConfig(model_dir="unused", initial_peers=[], num_blocks=3, **{field: value})  # type: ignore[arg-type]
