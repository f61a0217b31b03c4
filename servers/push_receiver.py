"""Push, the receiving side: another server's stream of pushed steps into a session of ours (the sending side is
push.py), and pushing our own outputs on along a step's route.

A push stream starts with an attach message naming a session its client opened with "push": true; each pushed step
is applied like the client's own (once per step id), its answer goes to the client on the session's own stream, and
the pusher gets {"accepted": step_id}.
"""
from __future__ import annotations

import asyncio
from abc import abstractmethod
from typing import Any

import torch

from servers.errors import RequestRejected
from servers.push import Pusher
from servers.sessions import Session, Stream, check_session_id
from servers.streams import StreamService
from servers.validation import Limits, reject, validate_step_id
from swarmnet import protocol
from swarmnet.protocol import ErrorCode


class PushReceiver(StreamService):
    """Push streams (`_serve_push`) and the push of a step's outputs on to the next hop (`_push_on`)."""

    sessions: dict[str, Session]
    limits: Limits
    pusher: Pusher

    @abstractmethod
    async def _apply(self, session: Session, tensors: list[torch.Tensor], meta: dict[str, Any]) -> bytes:
        """Apply one step to a session, once per step id, and push its outputs on (the handler's)."""

    async def _serve_push(self, stream: Stream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """An attach message (authorized like any stream's first message), then pushed steps of that session."""
        attach = await self._receive(stream, reader, writer, protocol.OPEN_FRAME_LIMIT)
        await self._reply(stream, writer, lambda: self._attach(attach, stream))
        while stream.push_target is not None and not stream.ended:
            limit = stream.push_target.step_frame_limit(self.limits.hidden_size)
            frame = await self._receive(stream, reader, writer, limit)
            await self._reply(stream, writer, lambda: self._pushed(frame, stream))  # noqa: B023 - awaited here

    async def _attach(self, frame: bytes, stream: Stream) -> bytes:
        """Attach a push stream to a session that its client opened for push (a member's stream: `_read`)."""
        tensors, meta = self._read(frame, stream)
        session = self.sessions.get(str(meta.get("session_id")))
        if tensors or meta.get("attach") is not True:
            raise reject("a push stream starts with {\"attach\": true, \"session_id\"} and no tensors")
        if session is None or not session.pushable:
            raise RequestRejected(ErrorCode.UNKNOWN_SESSION, f"no session {str(meta.get('session_id'))[:64]!r} "
                                                             "open for push here")
        stream.push_target = session
        return protocol.encode([], {"attached": True})

    async def _pushed(self, frame: bytes, stream: Stream) -> bytes:
        """Apply a pushed step to the attached session; its answer goes to the session's client, the pusher gets
        {"accepted": step_id}."""
        session = stream.push_target
        assert session is not None
        tensors, meta = self._read(frame, stream)
        if self.sessions.get(session.session_id) is not session:
            stream.push_target = None
            raise RequestRejected(ErrorCode.UNKNOWN_SESSION, f"session {session.session_id[:8]} is closed")
        check_session_id(meta, session)
        if validate_step_id(meta.get("step_id")) is None:
            raise reject("a pushed step needs a 'step_id'")
        answer = await self._apply(session, tensors, meta)
        if session.stream is not None:
            session.stream.accepted()  # the client's stream carries no message of its own for pushed steps
        await self._tell_client(session, answer)
        return protocol.encode([], {"accepted": meta["step_id"]})

    def _push_on(self, session: Session, step_id: int | None, route: list[tuple[str, str]], output: torch.Tensor,
                 mask: torch.Tensor, positions: torch.Tensor, keep_rows: Any) -> None:
        """Push a step's outputs to the next hop of its route, in the background; a failure is told the client."""
        (peer, target), rest = route[0], route[1:]
        meta: dict[str, Any] = {"session_id": target, "step_id": step_id, "route": [list(hop) for hop in rest]}
        if keep_rows is not None:
            meta["keep_rows"] = keep_rows
        frame = protocol.encode([output, mask, positions], meta)

        async def report(downstream: str, reason: str) -> None:
            await self._tell_client(session, protocol.encode([], {
                "session_id": session.session_id, "step_id": step_id,
                "push_failed": {"peer": downstream, "reason": reason[:500]}}))
        self.pusher.push_later(session.session_id, (peer, target), frame, report)

    async def _tell_client(self, session: Session, frame: bytes) -> None:
        """Write a message the client did not ask for on the session's own stream (push answers and reports)."""
        writer = session.stream.writer if session.stream is not None else None
        if writer is None or writer.is_closing() or self.sessions.get(session.session_id) is not session:
            return
        protocol.write_frame(writer, frame)
        try:
            await writer.drain()
        except ConnectionError:
            pass
