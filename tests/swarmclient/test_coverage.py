"""The coverage map: ONLINE servers of our protocol version cover blocks; others show but are not counted."""
from __future__ import annotations

import re

from factories import block_infos, server_info, span

from swarmclient.coverage import coverage_report, render_coverage
from swarmnet.data_structures import RemoteSpanInfo, ServerState, SpanMove


def test_a_previous_protocol_server_shows_as_not_used_and_its_blocks_as_missing() -> None:
    report = coverage_report("m", block_infos(4, span("peer-new", 0, 2), span("peer-old", 2, 4, version="swarmbatch/2")))
    assert report["missing"] == [[2, 4]] and not report["complete"]
    assert report["blocks"][3]["servers"][0] | {"version": "swarmbatch/2", "compatible": False} == \
        report["blocks"][3]["servers"][0]
    text = render_coverage(report)
    assert "protocol swarmbatch/2: not used" in text and "upgrade the servers marked not used" in text
    assert text.splitlines()[1].split()[1] == "ok" and text.splitlines()[3].split()[1] == "MISSING"


def test_a_joining_server_does_not_cover_its_blocks() -> None:
    report = coverage_report("m", block_infos(2, span("a", 0, 2, state=ServerState.JOINING)))
    assert report["missing"] == [[0, 2]]
    assert "upgrade" not in render_coverage(report)


def test_a_block_no_server_holds_says_so_on_its_row_and_in_the_verdict() -> None:
    report = coverage_report("m", block_infos(6, span("a", 0, 3), span("b", 4, 5, state=ServerState.JOINING)))
    rows = render_coverage(report).splitlines()
    assert rows[4].split() == ["3", "MISSING", "no", "server"] and rows[6].split()[:2] == ["5", "MISSING"]
    assert rows[5].split()[1] == "MISSING" and "(joining" in rows[5]  # held, but not online yet
    assert rows[-1].startswith("Missing blocks 3:6: 3 of 6 blocks have no server online, so nothing can be generated")


def test_a_fully_served_model_ends_with_all_blocks_served() -> None:
    assert render_coverage(coverage_report("m", block_infos(2, span("a", 0, 2)))).splitlines()[-1] == \
        "All blocks are served."


def test_the_report_shows_the_bottleneck_and_each_servers_moves() -> None:
    moved = server_info(15, 30, throughput=40.0).model_copy(update={"rebalances": True, "moves": (
        SpanMove(at=0.0, start=15, end=30, from_start=0, from_end=15, reason="no server held blocks 15:30"),)})
    infos = block_infos(30, span("pinned", 0, 15, throughput=100.0), RemoteSpanInfo("mover", 15, 30, moved))
    for index in range(15):  # what the mover left under the blocks it moved away from
        infos[index]["mover"] = moved.model_copy(update={"state": ServerState.OFFLINE, "start": 0, "end": 15})
    report = coverage_report("m", infos)
    assert report["bottleneck"] == {"block": 15, "throughput": 40.0}
    assert [(s["peer_id"], s["start"], s["end"], s["state"], s["rebalances"], len(s["moves"]))
            for s in report["servers"]] == [("mover", 15, 30, "online", True, 1), ("pinned", 0, 15, "online", False, 0)]
    text = render_coverage(report)
    assert "Bottleneck: 40 steps/s at block 15" in text
    assert re.search(r"mover  15:30 online, unpinned, moved 0:15 -> 15:30 at \d\d:\d\d:\d\d \(no server held blocks 15:30\)",
                     text), text
    assert "pinned  0:15 online, pinned" in text
