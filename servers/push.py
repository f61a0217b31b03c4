"""Server-to-server push, the upstream side: a server sends a step's outputs straight to the next server's session.

A step that names a `route` ([peer id, session id] of the hops after this one) is pushed, once computed, to the first
of them as a step of that session (its outputs, the step's attention mask and positions, keep_rows, step id, and the
rest of the route), so a token costs about (hops + 1) / 2 round trips instead of one per hop. `Pusher` keeps one
`PushLink` per (upstream session, downstream peer, downstream session): a `push` stream whose first message attaches
it to the downstream session; pushes go out in order and are answered in order ({"accepted": step id} or an error).
A push that fails (no stream, a broken one, an error answer) is reported to the client on the upstream session's own
stream as {"session_id", "step_id", "push_failed": {"peer", "reason"}}; the client then sends that step to the
downstream server itself (a step id makes the one that arrives second a duplicate, applied once: handler.py).

The downstream side, what a push may do there (members only, sessions opened for push only), is in handler.py.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.p2p import P2P, PeerID

from swarmnet import protocol

logger = logging.getLogger(__name__)
PUSH_CONNECT_TIMEOUT = 10.0  # seconds to open a push stream and attach it to the downstream session

Report = Callable[[str, str], Awaitable[None]]  # (downstream peer, reason) -> tell the client


class PushError(Exception):
    """A push did not reach the downstream session (its reason goes to the client)."""


class PushLink:
    """One `push` stream to one downstream session: frames out in order, their answers read back in order."""

    def __init__(self, peer: str, session_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.peer, self.session_id = peer, session_id
        self._reader, self._writer = reader, writer
        self._answers: collections.deque[asyncio.Future[dict[str, Any]]] = collections.deque()
        self.broken: str | None = None
        self._reading = asyncio.ensure_future(self._read_answers())

    @classmethod
    async def connect(cls, p2p: P2P, peer: str, session_id: str, *, timeout: float = PUSH_CONNECT_TIMEOUT
                      ) -> PushLink:
        """Open a push stream and attach it to `session_id` on `peer`; raises PushError if refused or unreachable."""
        try:
            async with asyncio.timeout(timeout):
                _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), protocol.RPC_PUSH)
                try:
                    protocol.write_frame(writer, protocol.encode([], {"attach": True, "session_id": session_id}))
                    await writer.drain()
                    answer = protocol.decode_meta(await protocol.read_frame(reader, protocol.OPEN_FRAME_LIMIT))
                except BaseException:
                    writer.close()
                    raise
        except PushError:
            raise
        except Exception as e:
            raise PushError(f"cannot open a push stream: {type(e).__name__}: {e}") from e
        error = protocol.response_error(answer)
        if error is not None:
            writer.close()
            raise PushError(f"{error[0].value}: {error[1]}")
        return cls(peer, session_id, reader, writer)

    async def push(self, frame: bytes) -> None:
        """Send one step; returns once the downstream server accepted it (raises PushError otherwise)."""
        if self.broken is not None:
            raise PushError(self.broken)
        answer = asyncio.get_running_loop().create_future()
        self._answers.append(answer)
        protocol.write_frame(self._writer, frame)
        await self._writer.drain()
        error = protocol.response_error(await answer)
        if error is not None:
            raise PushError(f"{error[0].value}: {error[1]}")

    async def _read_answers(self) -> None:
        try:
            while True:
                meta = protocol.decode_meta(await protocol.read_frame(self._reader, protocol.OPEN_FRAME_LIMIT))
                if self._answers:
                    answer = self._answers.popleft()
                    if not answer.done():
                        answer.set_result(meta)
        except BaseException as e:  # the stream ended: everything in flight failed
            self.broken = f"the push stream broke ({type(e).__name__})"
            while self._answers:
                answer = self._answers.popleft()
                if not answer.done():
                    answer.set_exception(PushError(self.broken))
            if isinstance(e, asyncio.CancelledError):
                raise

    def close(self) -> None:
        """End the stream (the downstream session stays: it is its client's)."""
        self._reading.cancel()
        self._writer.close()


class Pusher:
    """The push links of a server's sessions, and the pushes in flight."""

    def __init__(self) -> None:
        self.p2p: P2P | None = None  # set when the handler registers with a P2P node
        self._links: dict[str, dict[tuple[str, str], PushLink]] = {}  # upstream session id -> its links
        self._opening: dict[tuple[str, str, str], asyncio.Lock] = {}
        self._tasks: set[asyncio.Future[None]] = set()
        self.pushed = 0
        self.failed = 0

    def push_later(self, session_id: str, target: tuple[str, str], frame: bytes, report: Report) -> None:
        """Push `frame` to target (peer, session) in the background; a failure goes to `report`."""
        task = asyncio.ensure_future(self._push(session_id, target, frame, report))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _push(self, session_id: str, target: tuple[str, str], frame: bytes, report: Report) -> None:
        try:
            link = await self._link(session_id, target)
            await link.push(frame)
            self.pushed += 1
        except Exception as e:  # every failure is the client's to route around
            self.failed += 1
            reason = str(e) if isinstance(e, PushError) else f"{type(e).__name__}: {e}"
            logger.info("Push of session %s to %s failed: %s", session_id[:8], target[0][-6:], reason)
            await report(target[0], reason)

    async def _link(self, session_id: str, target: tuple[str, str]) -> PushLink:
        links = self._links.setdefault(session_id, {})
        link = links.get(target)
        if link is not None and link.broken is None:
            return link
        key = (session_id, *target)
        async with self._opening.setdefault(key, asyncio.Lock()):
            link = links.get(target)
            if link is None or link.broken is not None:
                if self.p2p is None:
                    raise PushError("this server has no P2P node")
                if link is not None:
                    link.close()
                link = links[target] = await PushLink.connect(self.p2p, *target)
        if session_id not in self._links:  # the session closed meanwhile
            link.close()
            raise PushError("the session closed")
        return link

    def close_session(self, session_id: str) -> None:
        """Close the links of a session that ended."""
        for link in self._links.pop(session_id, {}).values():
            link.close()
        for key in [k for k in self._opening if k[0] == session_id]:
            del self._opening[key]
