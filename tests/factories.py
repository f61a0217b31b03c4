"""Builders of real domain objects for tests."""
from __future__ import annotations

from swarmclient.data_structures import PROTOCOL_VERSION, RemoteSpanInfo, ServerInfo, ServerState


def server_info(start: int, end: int, *, throughput: float = 100.0, state: ServerState = ServerState.ONLINE,
                version: str = PROTOCOL_VERSION) -> ServerInfo:
    """A valid announcement for blocks [start, end)."""
    return ServerInfo(state=state, start=start, end=end, throughput=throughput, cache_tokens_left=1000,
                      dtype="float32", quant="none", version=version, revision="r" * 64,
                      max_batch_size=8, max_length=128)


def span(peer: str, start: int, end: int, **kwargs: object) -> RemoteSpanInfo:
    """A RemoteSpanInfo with a valid ServerInfo."""
    return RemoteSpanInfo(peer, start, end, server_info(start, end, **kwargs))  # type: ignore[arg-type]


def block_infos(num_blocks: int, *spans: RemoteSpanInfo) -> list[dict[str, ServerInfo]]:
    """What discovery returns for these servers: per block, peer -> info."""
    return [{s.peer_id: s.info for s in spans if s.start <= i < s.end} for i in range(num_blocks)]
