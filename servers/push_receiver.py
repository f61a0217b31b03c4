"""Push, the receiving side: another server's stream of pushed steps into a session of ours (the sending side is
push.py), and pushing our own outputs on along a step's route.

A push stream starts with an attach message naming a session its client opened with "push": true; each pushed step
is applied like the client's own (once per step id) once its push proof checks out (swarmnet/push_proof.py: signed by
the pushing server for this session's client and this input), its answer goes to the client on the session's own
stream with that proof, and the pusher gets {"accepted": step_id}. Our own pushes carry our proof. A step the ring
guessed (ring.py) is applied only where `takes_guess` says so; else it is dropped (the pusher gets "dropped": true).

A duplicate (a step id applied before, from the client or pushed) is never computed again, and is pushed on only
where that step's push failed, or to a replacement hop while the step has fewer than MAX_PUSH_TARGETS targets; after
MAX_DUPLICATES_PER_STEP copies of one step the stream is ended (handler.py).
"""
from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from servers.errors import RequestRejected
from servers.faults import noisy
from servers.push import Pusher
from servers.ring import takes_guess
from servers.sessions import AppliedStep, Session, Stream, check_session_id
from servers.streams import StreamService
from servers.validation import Limits, reject, validate_step_id
from swarmnet import protocol
from swarmnet.protocol import ErrorCode
from swarmnet.push_proof import input_digest, sign_push

MAX_PUSH_TARGETS = 3  # hops one step may be pushed to: its route's first, then replacements the client names


class PushReceiver(StreamService):
    """Push streams (`_serve_push`) and the push of a step's outputs on to the next hop (`_push_on`)."""

    sessions: dict[str, Session]
    limits: Limits
    pusher: Pusher
    may_push_here: Callable[[str], bool]

    @abstractmethod
    async def _apply(self, session: Session, tensors: list[torch.Tensor], meta: dict[str, Any], stream: Stream
                     ) -> bytes:
        """Apply one step to a session, once per step id, and push its outputs on (the handler's); a repeated step
        marks `stream.repeated`."""

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
        if not self.may_push_here(stream.peer):
            raise RequestRejected(ErrorCode.UNAUTHORIZED, f"this server takes pushes from the server members of its "
                                                          f"swarm only, and {stream.peer[:64]} is none")
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
        if session.stream is not None and not self._still_member(session.stream):  # its client was removed
            self._end_stream(session.stream, ErrorCode.UNAUTHORIZED, f"{session.stream.owner} is no longer a member "
                             "of this server's swarm (removed from its swarm file): its streams are ended")
            self.sessions.pop(session.session_id, None)  # no step more, though its stream ends a moment later
        if self.sessions.get(session.session_id) is not session:
            stream.push_target = None
            raise RequestRejected(ErrorCode.UNKNOWN_SESSION, f"session {session.session_id[:8]} is closed")
        check_session_id(meta, session)
        if validate_step_id(meta.get("step_id")) is None:
            raise reject("a pushed step needs a 'step_id'")
        if meta.get("guess") is True and not takes_guess(session, stream.peer, meta["step_id"]):
            return protocol.encode([], {"accepted": meta["step_id"], "dropped": True})  # the client sends it itself
        answer = await self._apply(session, tensors, meta, stream)
        if session.stream is not None and not stream.repeated:
            session.stream.accepted()  # the client's stream carries no message of its own for pushed steps
        await self._tell_client(session, answer)
        return protocol.encode([], {"accepted": meta["step_id"]})

    async def _push_on(self, session: Session, applied: AppliedStep, route: list[tuple[str, str]]) -> None:
        """Push a step's outputs to the next hop of its route, in the background, unless a push of it there is
        under way or done already; a failure is told the client, which then sends the step on itself."""
        (peer, target), rest = route[0], route[1:]
        if not may_push_again(applied, (peer, target)) or self.sessions.get(session.session_id) is not session:
            return
        applied.targets[(peer, target)] = False
        output, mask, positions = applied.pushed
        output = noisy(output, self.pusher.noise)  # TEST-ONLY (servers/faults.py): None leaves it alone
        frame = self._push_frame(session, target, applied.step_id, (output, mask, positions), applied.keep_rows, rest)

        async def report(downstream: str, reason: str) -> None:
            applied.targets[(peer, target)] = True  # a duplicate of the step may push it there again
            await self._tell_client(session, protocol.encode([], {
                "session_id": session.session_id, "step_id": applied.step_id,
                "push_failed": {"peer": downstream, "reason": reason[:500]}}))
        tokens = output.shape[0] * output.shape[1]
        if not self.pusher.push_later(session.session_id, (peer, target), frame, report, tokens=tokens):
            await report(peer, f"{ErrorCode.BUSY.value}: {self.pusher.max_in_flight} pushes of this session in flight")

    def _push_frame(self, session: Session, target: str, step_id: int,
                    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor], keep_rows: Any,
                    rest: list[tuple[str, str]], **extra: Any) -> bytes:
        """A step of `session` (hidden states, mask, positions) as pushed into session `target`, routed on along
        `rest`, with this server's proof of it for the session's client."""
        meta: dict[str, Any] = {"session_id": target, "step_id": step_id, "route": [list(hop) for hop in rest], **extra}
        if keep_rows is not None:
            meta["keep_rows"] = keep_rows
        if self.pusher.identity is not None:  # (a server always has one; a handler built in a test may not)
            meta["push_proof"] = sign_push(self.pusher.identity, owner=session.peer, upstream_session=session.session_id,
                                           target_session=target, step_id=step_id,
                                           digest=input_digest(*tensors, keep_rows, step_id))
        return protocol.encode(list(tensors), meta)

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


def may_push_again(applied: AppliedStep, target: tuple[str, str]) -> bool:
    """Whether a step (a duplicate, or a first copy: no targets yet) is pushed to target: where its push failed, or
    to a new target while it has fewer than MAX_PUSH_TARGETS."""
    failed = applied.targets.get(target)
    return len(applied.targets) < MAX_PUSH_TARGETS if failed is None else failed
