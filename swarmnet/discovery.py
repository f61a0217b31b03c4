"""Reading the DHT: which servers hold which blocks. The only client module that talks to the DHT."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from hivemind.dht.node import DHTNode

from swarmnet.data_structures import PROTOCOL_VERSION, RemoteSpanInfo, ServerInfo, ServerState, block_uid

logger = logging.getLogger(__name__)

BlockServers = dict[str, ServerInfo]  # peer id -> what it announced for one block
LOOKUPS_AT_ONCE = 16  # block keys looked up concurrently, each on its own


async def get_remote_module_infos(node: DHTNode, model_id: str, num_blocks: int) -> list[BlockServers]:
    """For each block 0..num_blocks-1, the servers that announced it (any state), with their infos.

    Each block key is looked up on its own (LOOKUPS_AT_ONCE at a time), never several in one find: a node answers a
    find with at most `dht_storage.ANSWER_BYTES` of records, split among the keys asked, so a find of one key gets
    the whole budget (every record of up to 3 KiB, `dht_storage`), and a key flooded with strangers' records can
    neither crowd another key's records out of an answer nor make the answer fail for both.
    """
    keys = [block_uid(model_id, i) for i in range(num_blocks)]
    limit = asyncio.Semaphore(LOOKUPS_AT_ONCE)

    async def lookup(key: str) -> object:
        async with limit:
            found = await node.get_many([key], sufficient_expiration_time=float("inf"))
        return found.get(key)
    return [_parse_block_record(record) for record in await asyncio.gather(*(lookup(key) for key in keys))]


def _parse_block_record(record: object) -> BlockServers:
    """Validate one DHT record (subkey -> value); malformed entries from untrusted peers are dropped."""
    value = getattr(record, "value", None)
    if not isinstance(value, dict):
        return {}
    servers: BlockServers = {}
    for peer_id, item in value.items():
        info = ServerInfo.from_wire(getattr(item, "value", None))
        if isinstance(peer_id, str) and info is not None:
            servers[peer_id] = info
        else:
            logger.debug("Dropped a malformed announcement from %r", peer_id)
    return servers


def online_spans(block_infos: list[BlockServers]) -> list[RemoteSpanInfo]:
    """One RemoteSpanInfo per ONLINE server that speaks our protocol version, with the span it announced
    (clipped to the blocks it announced). A server of another version shows in `swarm status` but is never used.

    A server that moved may still have ONLINE records of its old span in some DHT nodes until they expire: of a
    server's announced spans, the one announced since its latest move is used, never a union of old and new."""
    found: dict[tuple[str, int, int], RemoteSpanInfo] = {}
    for index, servers in enumerate(block_infos):
        for peer_id, info in servers.items():
            if info.state != ServerState.ONLINE or info.version != PROTOCOL_VERSION or not info.start <= index < info.end:
                continue
            known = found.get((peer_id, info.start, info.end))
            found[(peer_id, info.start, info.end)] = RemoteSpanInfo(
                peer_id, index if known is None else known.start, index + 1, info)
    spans: dict[str, RemoteSpanInfo] = {}
    for span in found.values():
        other = spans.get(span.peer_id)
        if other is None or _announced_after(span.info, other.info):
            spans[span.peer_id] = span
    return list(spans.values())


def _announced_after(info: ServerInfo, other: ServerInfo) -> bool:
    """Whether `info` is a later announcement of the same server than `other`: one made after more moves."""
    return max((move.at for move in info.moves), default=0.0) > max((move.at for move in other.moves), default=0.0)


def uncovered_ranges(covered: Sequence[object], start: int = 0) -> list[tuple[int, int]]:
    """The merged ranges [a, b) of blocks whose entry in `covered` is falsy (a count of 0, False); `covered[0]`
    is block `start`. E.g. [2, 0, 0, 1] -> [(1, 3)]."""
    ranges: list[tuple[int, int]] = []
    for index, held in enumerate(covered, start):
        if held:
            continue
        if ranges and ranges[-1][1] == index:
            ranges[-1] = (ranges[-1][0], index + 1)
        else:
            ranges.append((index, index + 1))
    return ranges

