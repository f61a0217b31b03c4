"""Server-to-server push, the upstream side: a server sends a step's outputs straight to the next server's session.

A step that names a `route` ([peer id, session id] of the hops after this one) is pushed, once computed, to the first
of them as a step of that session (its outputs, the step's attention mask and positions, keep_rows, step id, and the
rest of the route), so a token costs about (hops + 1) / 2 round trips instead of one per hop. `Pusher` keeps one
`PushLink` per (upstream session, downstream peer, downstream session): a `push` stream whose first message attaches
it to the downstream session; pushes go out in order and are answered in order ({"accepted": step id} or an error).
Each push carries a `push_proof` (swarmnet/push_proof.py): this server's signature, with its peer key, of the digest
of what it pushed, for which session; the downstream server checks it and hands it to the client, which can then tell
which of the two lied when what the downstream computed on differs from this server's answer.
A push that fails (no stream, a broken one, an error answer) is reported to the client on the upstream session's own
stream as {"session_id", "step_id", "push_failed": {"peer", "reason"}}; the client then sends that step to the
downstream server itself (a step id makes the one that arrives second a duplicate, applied once: handler.py).

What a session's pushes may take here is bounded: at most MAX_PUSHES_IN_FLIGHT at once (one more is reported failed
as `busy`, and its client sends that step on itself), each waits at most PUSH_TIMEOUT (+ PUSH_TIMEOUT_PER_TOKEN per
token) for its answer (then the link is dropped), and everything a session opened is closed, cancelled or dropped
when it ends. Which duplicates are pushed again is push_receiver.py's.

The downstream side, what a push may do there (members only, sessions opened for push only), is in handler.py.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P, PeerID

from swarmnet import protocol
from swarmnet.identity import Identity

logger = logging.getLogger(__name__)
PUSH_CONNECT_TIMEOUT = 10.0  # seconds to open a push stream and attach it to the downstream session
MAX_PUSHES_IN_FLIGHT = 2  # per upstream session: an honest client's chain has one step in flight, and one lagging
# seconds a push waits for its answer, which comes once the downstream server computed the step: as the client's own
# step timeout (ClientConfig.step_timeout, step_timeout_per_token), so that the client's fallback is not slower
PUSH_TIMEOUT = 30.0
PUSH_TIMEOUT_PER_TOKEN = 0.02

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

    async def push(self, frame: bytes, timeout: float) -> None:
        """Send one step; returns once the downstream server accepted it (raises PushError otherwise). A push not
        answered within `timeout` s breaks the link: the server behind it is too slow or stuck."""
        if self.broken is not None:
            raise PushError(self.broken)
        answer = asyncio.get_running_loop().create_future()
        self._answers.append(answer)
        try:
            async with asyncio.timeout(timeout):
                protocol.write_frame(self._writer, frame)
                await self._writer.drain()
                meta = await answer
        except TimeoutError:
            self.broken = f"no answer to a push in {timeout:.0f} s"
            self.close()
            raise PushError(self.broken) from None
        error = protocol.response_error(meta)
        if error is not None:
            raise PushError(f"{error[0].value}: {error[1]}")

    async def _read_answers(self) -> None:
        try:
            while True:
                meta = protocol.decode_meta(await protocol.read_frame(self._reader, protocol.OPEN_FRAME_LIMIT))
                if self._answers:
                    answer = self._answers.popleft()
                    if not answer.done():  # a push that timed out or was cancelled keeps its place in the order
                        answer.set_result(meta)
        except BaseException as e:  # the stream ended: everything in flight failed
            self.broken = self.broken or f"the push stream broke ({type(e).__name__})"
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


@dataclass
class SessionPushes:
    """What one upstream session's pushes hold: its links, the links being opened, the pushes in flight."""

    links: dict[tuple[str, str], PushLink] = field(default_factory=dict)
    opening: dict[tuple[str, str], asyncio.Future[PushLink]] = field(default_factory=dict)
    tasks: set[asyncio.Future[None]] = field(default_factory=set)
    closed: bool = False


class Pusher:
    """The push links of a server's sessions, and the pushes in flight (at most `max_in_flight` per session)."""

    def __init__(self, *, max_in_flight: int = MAX_PUSHES_IN_FLIGHT, timeout: float = PUSH_TIMEOUT,
                 timeout_per_token: float = PUSH_TIMEOUT_PER_TOKEN) -> None:
        self.p2p: P2P | None = None  # set when the handler registers with a P2P node
        self.identity: Identity | None = None  # the server's peer key: signs each push's proof (push_proof.py)
        self.noise: float | None = None  # TEST-ONLY (servers/faults.py, push-noise:STD): pushed outputs get noise
        self.max_in_flight, self.timeout, self.timeout_per_token = max_in_flight, timeout, timeout_per_token
        self._sessions: dict[str, SessionPushes] = {}  # upstream session id -> its pushes
        self.pushed = 0
        self.failed = 0

    def in_flight(self, session_id: str) -> int:
        """Pushes of the session started and not yet over."""
        pushes = self._sessions.get(session_id)
        return 0 if pushes is None else len(pushes.tasks)

    def push_later(self, session_id: str, target: tuple[str, str], frame: bytes, report: Report, *, tokens: int
                   ) -> bool:
        """Push `frame` (a step of `tokens` tokens) to target (peer, session) in the background; a failure goes to
        `report`. False, and nothing started, if the session has `max_in_flight` pushes in flight already."""
        pushes = self._sessions.setdefault(session_id, SessionPushes())
        if len(pushes.tasks) >= self.max_in_flight:
            return False
        timeout = self.timeout + self.timeout_per_token * tokens
        task = asyncio.ensure_future(self._push(session_id, pushes, target, frame, report, timeout))
        pushes.tasks.add(task)
        task.add_done_callback(pushes.tasks.discard)
        return True

    async def _push(self, session_id: str, pushes: SessionPushes, target: tuple[str, str], frame: bytes,
                    report: Report, timeout: float) -> None:
        try:
            link = await self._link(pushes, target)
            await link.push(frame, timeout)
            self.pushed += 1
        except Exception as e:  # every failure is the client's to route around
            self.failed += 1
            reason = str(e) if isinstance(e, PushError) else f"{type(e).__name__}: {e}"
            logger.info("Push of session %s to %s failed: %s", session_id[:8], target[0][-6:], reason)
            await report(target[0], reason)

    async def _link(self, pushes: SessionPushes, target: tuple[str, str]) -> PushLink:
        """The session's link to target, opened once however many pushes wait for it."""
        link = pushes.links.get(target)
        if link is not None and link.broken is None:
            return link
        opening = pushes.opening.get(target)
        if opening is None:
            opening = pushes.opening[target] = asyncio.ensure_future(self._connect(pushes, target))
            opening.add_done_callback(lambda done: _opened(pushes, target, done))
        return await asyncio.shield(opening)  # a push cancelled meanwhile leaves the others their link

    async def _connect(self, pushes: SessionPushes, target: tuple[str, str]) -> PushLink:
        if self.p2p is None:
            raise PushError("this server has no P2P node")
        old = pushes.links.pop(target, None)
        if old is not None:
            old.close()
        link = await PushLink.connect(self.p2p, *target)
        if pushes.closed:  # the session closed meanwhile
            link.close()
            raise PushError("the session closed")
        pushes.links[target] = link
        return link

    def close_session(self, session_id: str) -> None:
        """A session ended: cancel its pushes in flight and the links being opened, and close its links."""
        pushes = self._sessions.pop(session_id, None)
        if pushes is None:
            return
        pushes.closed = True
        for task in pushes.tasks:
            task.cancel()
        for opening in pushes.opening.values():
            opening.cancel()
        for link in pushes.links.values():
            link.close()


def _opened(pushes: SessionPushes, target: tuple[str, str], opening: asyncio.Future[PushLink]) -> None:
    """A link was opened, or failed to: its entry goes (its failure is each waiting push's to report)."""
    if pushes.opening.get(target) is opening:
        del pushes.opening[target]
    if not opening.cancelled():
        opening.exception()  # retrieved: the pushes that waited for it, if any are left, report it
