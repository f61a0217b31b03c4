"""Bare server streams for tests: send what a well-behaved client never would, frame by frame, and read the answers."""
from __future__ import annotations

import asyncio
from typing import Any

import torch
from hivemind.p2p import PeerID

from swarmclient.swarm import Swarm
from swarmnet import protocol

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def raw_stream(client: Swarm, peer_id: str, rpc: str = protocol.RPC_INFERENCE) -> Stream:
    """A bare stream (reader, writer) of one RPC to a server."""
    _, reader, writer = client.loop.run(client.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), rpc))
    return reader, writer


def framed(tensors: list[torch.Tensor], meta: dict[str, Any]) -> bytes:
    """One stream message."""
    return protocol.length_prefixed(protocol.encode(tensors, meta))


def opening(session_id: str, *, batch_size: int = 1, max_length: int = 8, start: int = 0, end: int = 6) -> bytes:
    """A session's open message."""
    return framed([], {"open": True, "session_id": session_id, "start": start, "end": end, "batch_size": batch_size,
                       "max_length": max_length})


def send(client: Swarm, stream: Stream, payload: bytes) -> None:
    """Write bytes on the stream, answered or not."""
    async def write() -> None:
        stream[1].write(payload)
        await stream[1].drain()
    client.loop.run(write())


def answer_frame(client: Swarm, stream: Stream, timeout: float = 30.0) -> bytes:
    """The stream's next answer, undecoded."""
    return client.loop.run(asyncio.wait_for(protocol.read_frame(stream[0], 1 << 24), timeout))


def answer(client: Swarm, stream: Stream, timeout: float = 30.0) -> dict[str, Any]:
    """The meta of the stream's next answer."""
    return protocol.decode(answer_frame(client, stream, timeout))[1]


def exchange(client: Swarm, stream: Stream, payload: bytes) -> dict[str, Any]:
    """Write bytes, then read one answer's meta."""
    return protocol.decode(exchange_frame(client, stream, payload))[1]


def exchange_frame(client: Swarm, stream: Stream, payload: bytes) -> bytes:
    """Write bytes, then read one answer, undecoded."""
    send(client, stream, payload)
    return answer_frame(client, stream)


def error_code(meta: dict[str, Any]) -> protocol.ErrorCode | None:
    """The error code an answer carries, if any."""
    error = protocol.response_error(meta)
    return None if error is None else error[0]


def ended(client: Swarm, stream: Stream, timeout: float = 30.0) -> bool:
    """Whether the server ends the stream (nothing more to read) within `timeout`."""
    try:
        return client.loop.run(asyncio.wait_for(stream[0].read(), timeout)) == b""
    except TimeoutError:
        return False


def close(client: Swarm, stream: Stream) -> None:
    """End our side of the stream."""
    async def run() -> None:
        stream[1].close()
    client.loop.run(run())
