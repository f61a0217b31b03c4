"""Builders of real domain objects for tests."""
from __future__ import annotations

from typing import Any

from jobs import store
from jobs.batch_input import COMPLETIONS_URL, LineError, ParsedBatch, ParsedRequest
from jobs.runtime import Runtime
from swarmnet.data_structures import PROTOCOL_VERSION, RemoteSpanInfo, ServerInfo, ServerState


class ManualClock:
    """A clock a test moves by hand (`clock.now += 5`), for the code that takes a `clock` callable."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def server_info(start: int, end: int, *, throughput: float = 100.0, state: ServerState = ServerState.ONLINE,
                version: str = PROTOCOL_VERSION, cache_tokens_left: int = 1000, max_batch_size: int = 8,
                max_sessions_per_peer: int | None = None, cache_tokens_per_peer: int | None = None,
                cache_tokens_most_per_peer: int | None = None, machine: str | None = None) -> ServerInfo:
    """A valid announcement for blocks [start, end)."""
    return ServerInfo(state=state, start=start, end=end, throughput=throughput, cache_tokens_left=cache_tokens_left,
                      dtype="float32", quant="none", version=version, revision="r" * 64,
                      max_batch_size=max_batch_size, max_length=128, max_sessions_per_peer=max_sessions_per_peer,
                      cache_tokens_per_peer=cache_tokens_per_peer,
                      cache_tokens_most_per_peer=cache_tokens_most_per_peer, machine=machine)


def span(peer: str, start: int, end: int, **kwargs: object) -> RemoteSpanInfo:
    """A RemoteSpanInfo with a valid ServerInfo."""
    return RemoteSpanInfo(peer, start, end, server_info(start, end, **kwargs))  # type: ignore[arg-type]


def block_infos(num_blocks: int, *spans: RemoteSpanInfo) -> list[dict[str, ServerInfo]]:
    """What discovery returns for these servers: per block, peer -> info."""
    return [{s.peer_id: s.info for s in spans if s.start <= i < s.end} for i in range(num_blocks)]


def parsed_request(line_number: int, custom_id: str, **body: Any) -> ParsedRequest:
    """A good completions line, as batch_input would produce it."""
    return ParsedRequest(line_number=line_number, custom_id=custom_id, url=COMPLETIONS_URL,
                         body={"model": "tiny", "prompt": f"prompt of {custom_id}", **body},
                         prompt_ids=[1, 100 + line_number, 7], max_tokens=16, temperature=0.0, top_p=1.0,
                         seed=line_number, stop=[])


def parsed_batch(count: int, errors: list[LineError] | None = None) -> ParsedBatch:
    """`count` good lines (custom ids req-0, req-1, ...) and the given bad ones."""
    return ParsedBatch([parsed_request(i + 1, f"req-{i}") for i in range(count)], errors or [], COMPLETIONS_URL)


def new_job(runtime: Runtime, count: int = 3, **kwargs: Any) -> str:
    """Create and commit a job of `count` requests; returns its id."""
    with runtime.session() as session:
        job = store.create_job(session=session, parsed=parsed_batch(count), model="tiny", **kwargs)
        session.commit()
        return job.id


def new_key(runtime: Runtime, name: str = "tester") -> str:
    """A new API key in the runtime's store (committed); returns the plain key."""
    with runtime.session() as session:
        _, plain = store.create_api_key(session=session, name=name)
        session.commit()
    return plain
