"""Which blocks a new server should hold: the window whose blocks are least covered now. Pure functions."""
from __future__ import annotations

from collections.abc import Callable

from swarmnet.data_structures import ServerState
from swarmnet.discovery import BlockServers


def block_coverage(block_infos: list[BlockServers]) -> list[float]:
    """Per block, the summed throughput of servers that hold it and are not OFFLINE."""
    return [sum(info.throughput for info in servers.values() if info.state != ServerState.OFFLINE)
            for servers in block_infos]


def choose_best_blocks(num_blocks: int, block_infos: list[BlockServers],
                       loadable: Callable[[int, int], bool] = lambda start, end: True) -> tuple[int, int]:
    """The span [start, start + num_blocks) that raises the weakest coverage most, among those `loadable` says this
    box can load (a box holding only some shards).

    Windows are ranked by their least covered block, then by their total coverage, then by position,
    so an empty swarm gets 0:num_blocks and a half-covered one gets the other half.
    """
    total = len(block_infos)
    if not 0 < num_blocks <= total:
        raise ValueError(f"--num-blocks must be in [1, {total}], got {num_blocks}")
    coverage = block_coverage(block_infos)
    # rounding keeps float noise in summed throughputs from deciding between equally covered windows
    candidates = [(round(min(coverage[s:s + num_blocks]), 6), round(sum(coverage[s:s + num_blocks]), 6), s)
                  for s in range(total - num_blocks + 1) if loadable(s, s + num_blocks)]
    if not candidates:
        raise ValueError(f"this box holds the weight files of no {num_blocks} consecutive blocks; copy the shards of "
                         "the blocks to serve ('swarmbatch model files DIR --blocks A:B') or pass --blocks")
    start = min(candidates)[2]
    return start, start + num_blocks
