"""The coverage map: ONLINE servers of our protocol version cover blocks; others show but are not counted."""
from __future__ import annotations

from factories import block_infos, span

from swarmclient.coverage import coverage_report, render_coverage
from swarmnet.data_structures import ServerState


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
