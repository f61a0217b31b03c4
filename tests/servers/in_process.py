"""Block handlers served in this process, without p2pd: each stream is a socket pair whose server end the handler's
RPC method serves, as it would a libp2p stream (the caller's peer id is what the stream's info says it is).

`Wires` stands in for hivemind's P2P where the handlers call each other (a handler's `pusher.p2p`), and is what a
test's own raw client opens its streams with. Everything it starts is stopped by `close`.
"""
from __future__ import annotations

import asyncio
import functools
import socket
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils.multiaddr import Multiaddr

from servers.handler import RPCS, BlockHandler
from servers.memory import CacheBudget
from servers.span import BlockSpan
from servers.validation import Limits
from swarmnet import protocol
from swarmnet.identity import Identity

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
RawServer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
ADDRESS = Multiaddr("/ip4/127.0.0.1/tcp/1")


_KEYS = tempfile.TemporaryDirectory(prefix="in-process-keys-")  # (removed when the test process exits)


@functools.cache
def identity(name: str) -> Identity:
    """A peer key for a name: a handler signs its pushes with it (swarmnet/push_proof.py)."""
    return Identity.create(Path(_KEYS.name) / name)


def peer(name: str) -> str:
    """A peer id (base58) for a name: its key's."""
    return identity(name).peer_id


async def stream_pair() -> tuple[Streams, Streams]:
    """Two connected ends of a stream: (reader, writer) each."""
    one, other = socket.socketpair()
    return await asyncio.open_connection(sock=one), await asyncio.open_connection(sock=other)


class Wires:
    """The streams between this process's handlers and callers, by peer id."""

    def __init__(self) -> None:
        self.handlers: dict[str, BlockHandler] = {}
        self.raw: dict[str, RawServer] = {}  # peers that serve streams their own way (a test's misbehaving server)
        self._tasks: set[asyncio.Future[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    def caller(self, name: str) -> Caller:
        """What a handler of that peer, or a test's client of that peer, opens streams with."""
        return Caller(self, peer(name))

    async def open(self, caller: str, callee: str, rpc: str) -> Streams:
        """A stream from caller to callee's `rpc`."""
        client, server = await stream_pair()
        self._writers += [client[1], server[1]]
        if callee in self.raw:
            served = self.raw[callee](*server)
        else:
            info = StreamInfo(PeerID.from_base58(caller), ADDRESS, rpc)
            served = getattr(self.handlers[callee], RPCS[rpc])(info, *server)
        task = asyncio.ensure_future(served)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return client

    async def close(self) -> None:
        """End every stream and wait for what served them."""
        for writer in self._writers:
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for handler in self.handlers.values():
            handler.executor.shutdown(wait=True)


class Caller:
    """One peer's side of the wires: hivemind P2P's `call_binary_stream_handler`, as a pusher uses it."""

    def __init__(self, wires: Wires, peer_id: str) -> None:
        self.wires, self.peer_id = wires, peer_id

    async def call_binary_stream_handler(self, peer_id: PeerID, rpc: str
                                         ) -> tuple[StreamInfo, asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await self.wires.open(self.peer_id, peer_id.to_base58(), rpc)
        return StreamInfo(peer_id, ADDRESS, rpc), reader, writer


def run(test: Callable[[Wires], Awaitable[None]]) -> None:
    """Run `test` on fresh wires, closing them after."""

    async def main() -> None:
        wires = Wires()
        try:
            await test(wires)
        finally:
            await wires.close()
    asyncio.run(main())


def serve(wires: Wires, name: str, span: BlockSpan, **options: Any) -> BlockHandler:
    """A handler of all of the span's blocks, as peer `name`, whose pushes go over the wires."""
    spec = span.spec
    handler = BlockHandler(span, Limits(span.start, span.end, spec.hidden_size, 8, 256),
                           CacheBudget(1024, span.end - span.start), status=lambda: None,  # type: ignore[arg-type,return-value]
                           **options)
    handler.pusher.p2p = wires.caller(name)  # type: ignore[assignment]
    handler.pusher.identity = identity(name)
    wires.handlers[peer(name)] = handler
    return handler


async def send(stream: Streams, tensors: list[torch.Tensor], meta: dict[str, Any]) -> None:
    """Write one message."""
    protocol.write_frame(stream[1], protocol.encode(tensors, meta))
    await stream[1].drain()


async def read(stream: Streams, timeout: float = 10.0) -> tuple[list[torch.Tensor], dict[str, Any]] | None:
    """The next answer, or None once the server ended the stream."""
    try:
        frame = await asyncio.wait_for(protocol.read_frame(stream[0], 1 << 24), timeout)
    except (asyncio.IncompleteReadError, ConnectionResetError):
        return None
    return protocol.decode(frame)


async def nothing_within(stream: Streams, seconds: float) -> bool:
    """Whether no answer comes within `seconds` (and the stream is still open)."""
    try:
        await asyncio.wait_for(stream[0].readexactly(8), seconds)
    except TimeoutError:
        return True
    return False
