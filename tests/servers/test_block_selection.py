"""A new server picks the blocks that are least covered; pure functions, no network."""
from __future__ import annotations

import pytest
from factories import block_infos, span

from servers.block_selection import block_coverage, choose_best_blocks
from swarmnet.data_structures import ServerState


def test_an_empty_swarm_gets_the_first_blocks() -> None:
    assert choose_best_blocks(4, block_infos(8)) == (0, 4)


def test_the_second_server_takes_the_uncovered_half() -> None:
    assert choose_best_blocks(4, block_infos(8, span("a", 0, 4))) == (4, 8)


def test_a_gap_in_the_middle_is_filled_first() -> None:
    infos = block_infos(12, span("a", 0, 4), span("b", 8, 12))
    assert choose_best_blocks(4, infos) == (4, 8)


def test_weaker_coverage_wins_over_position() -> None:
    infos = block_infos(8, span("fast", 0, 4, throughput=1000.0), span("slow", 4, 8, throughput=1.0))
    assert choose_best_blocks(4, infos) == (4, 8)


def test_offline_servers_do_not_count_as_coverage() -> None:
    infos = block_infos(8, span("gone", 0, 4, state=ServerState.OFFLINE), span("b", 4, 8))
    assert block_coverage(infos)[:4] == [0.0] * 4
    assert choose_best_blocks(4, infos) == (0, 4)


def test_asking_for_more_blocks_than_the_model_has_is_an_error() -> None:
    with pytest.raises(ValueError, match="--num-blocks"):
        choose_best_blocks(9, block_infos(8))


def test_a_box_holding_only_some_shards_picks_among_the_windows_it_can_load() -> None:
    # the weakest window is 4:8, but this box holds only the files of blocks 0:4
    infos = block_infos(8, span("a", 0, 4))
    assert choose_best_blocks(4, infos, lambda start, end: end <= 4) == (0, 4)
    with pytest.raises(ValueError, match="holds the weight files of no 4 consecutive blocks; copy the shards"):
        choose_best_blocks(4, infos, lambda start, end: False)
