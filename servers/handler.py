"""RPC handlers of a block server: `info`, `forward` (stateless), `inference` (one stream = one session) and `push`.

All are raw streams of length-prefixed frames, served by the stream machinery of servers/streams.py (bounded reads,
authorization of a stream's first message, one place where exceptions become error answers), with push streams in
servers/push_receiver.py. What a caller can make the server take is bounded before it is taken:

- a message's length is checked before it is read: OPEN_FRAME_LIMIT until a session exists (and for info requests
  and forward headers), then what the session's (or the forward header's) shape allows;
- a forward's header is answered {"admitted": true} before its tensors are sent, so that a refusal never leaves
  a client's bytes unread: p2pd resets a stream ended with unread bytes, and the client then loses the answer;
- a caller is its owner: the member it acts for (servers/access.py), so that the per-caller limits below hold per
  member, however many peer ids its credentials are made for;
- a session reserves its KV cache only once its open message is valid, within the caller's share of sessions
  and cache; a refused open takes nothing;
- cache lent to a caller alone is taken back once another caller waits: when a caller is refused room while
  another holds more than its share, the borrower's newest sessions over its share are ended (`busy`)
  `lent_cache_grace` seconds later, unless they ended by then (its client replays them elsewhere);
- a forward holds a slot (`Slots`: per caller and per server) from its header to its answer, declares at most
  `max_forward_tokens` tokens (rows x length), and its tensors must come at FORWARD_MIN_RATE;
- a session opened "resumable" whose stream is lost (not ended by the server) is detached for `session_grace`
  seconds, its cache still counted against its owner's share, then freed; a new stream of the same caller (peer id)
  may take it over with a resume message, answered with the steps applied; anyone else is told it is unknown;
- a step applied before (a duplicate) is answered again uncomputed, keeps no stream alive, is pushed on only where
  its push failed (push_receiver.py), and its MAX_DUPLICATES_PER_STEP + 1st copy ends the stream.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from servers.admission import Slots
from servers.background import background_executor
from servers.batching import DecodeBatcher, DecodeStep
from servers.counters import ServerCounters
from servers.errors import RequestRejected
from servers.memory import CacheBudget
from servers.push import Pusher
from servers.push_receiver import PushReceiver
from servers.ring import RingGuesser, confirm_guess, ring_of
from servers.sessions import (
    SESSION_CLOSED_LOG,
    SESSION_DETACHED_LOG,
    SESSION_EXPIRED_LOG,
    SESSION_OPENED_LOG,
    SESSION_RESUMED_LOG,
    AppliedStep,
    Session,
    Stream,
    check_session_id,
)
from servers.span import BlockSpan
from servers.status import ServerStatus
from servers.streams import Authorize, allow_everyone
from servers.validation import (
    Limits,
    reject,
    validate_forward,
    validate_forward_header,
    validate_keep_rows,
    validate_route,
    validate_session_open,
    validate_span,
    validate_step,
    validate_step_id,
)
from swarmnet import protocol
from swarmnet.membership import Membership
from swarmnet.protocol import ErrorCode
from swarmnet.push_proof import input_digest, proof_signer

logger = logging.getLogger(__name__)
# copies of one step a session takes (from its client or pushed) before its stream is ended: a client sends a step
# at most once per attempt (ClientConfig.max_retries = 8), and the server before may push it once more each time
MAX_DUPLICATES_PER_STEP = 16
# an admitted forward's tensors must arrive within FORWARD_GRACE s plus their declared bytes at this rate (bytes/s):
# a caller cannot hold a forward slot by sending its header and then nothing (or a trickle)
FORWARD_MIN_RATE = 256 * 1024
FORWARD_GRACE = 10.0
# each RPC and the handler method that serves it
RPCS = {protocol.RPC_PUSH: "rpc_push", protocol.RPC_INFO: "rpc_info", protocol.RPC_FORWARD: "rpc_forward",
        protocol.RPC_INFERENCE: "rpc_inference"}


@dataclass
class BlockHandler(PushReceiver):
    """Serves one BlockSpan over P2P."""

    span: BlockSpan
    limits: Limits
    budget: CacheBudget  # also caps each caller's share of the cache
    status: Callable[[], ServerStatus]  # the server's status, which the `info` RPC answers with
    session_timeout: float = 300.0  # a stream with no accepted message for this long is closed (its session freed)
    batch_wait_ms: float = 2.0  # how long a decode step waits for other sessions' steps to merge with; 0 = never
    max_merge_tokens: int = 2048  # a session caching more (rows x length) is never merged: copying it costs more
    max_sessions_per_peer: int = 16
    max_queued_forwards: int = 4    # forwards admitted and not yet answered (uploading, waiting or computing)
    max_forwards_per_peer: int = 2
    max_forward_tokens: int = 16384  # rows x length of one forward; more is refused as invalid_request
    max_streams_per_peer: int = 128  # streams one peer id may hold open at once (all RPCs); more are refused busy
    lent_cache_grace: float = 10.0  # seconds a borrower's over-share sessions live on once another caller waits
    session_grace: float = 0.0  # seconds a resumable session outlives its lost stream (detached); 0 = freed at once
    # who may use the server: called with the caller's peer id and its stream's first message's meta, returns the
    # owner it acts for (the member); raises RequestRejected(UNAUTHORIZED) to refuse (an in-band error; nothing is
    # reserved or computed)
    authorize: Authorize = allow_everyone
    # the members `authorize` checks by: when they change, open streams re-check their owners (streams.py)
    membership: Membership = field(default_factory=Membership.open)
    streams_by_peer: Counter[str] = field(default_factory=Counter)
    stats: ServerCounters = field(default_factory=ServerCounters)
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "swarmbatch-compute"))
    # stateless forwards (other clients' checks, embeddings) compute here, behind inference steps (background.py)
    background: ThreadPoolExecutor = field(default_factory=background_executor)
    sessions: dict[str, Session] = field(default_factory=dict)
    refused_strangers: set[str] = field(default_factory=set)  # callers refused as no member, logged once each
    pusher: Pusher = field(default_factory=Pusher)
    # this server's round trips to the servers that may follow it (servers/neighbours.py), for its info answer
    next_rtts: Callable[[], dict[str, float]] = dict
    # who this server may push a session's hidden states to (a private swarm's members only; everyone if open)
    may_push_to: Callable[[str], bool] = lambda peer: True
    # whose pushes into our sessions it accepts (a private swarm's server members only: never a client's key)
    may_push_here: Callable[[str], bool] = lambda peer: True
    # set while the server moves its span elsewhere ("A:B"): new sessions and forwards are refused as busy
    moving_to: str | None = None
    guesser: RingGuesser | None = None  # --ring on a span that ends at the last block: the model's head (ring.py)

    def __post_init__(self) -> None:
        # a merged forward holds at most as many rows as one session may have
        self.batcher = DecodeBatcher(self.span, wait_ms=self.batch_wait_ms, max_rows=self.limits.max_batch_size,
                                     stats=self.stats, max_merge_tokens=self.max_merge_tokens)
        self.forwards = Slots("forwards in flight", per_caller=self.max_forwards_per_peer,
                              total=self.max_queued_forwards)
        self._reclaim: asyncio.TimerHandle | None = None  # the lent cache's reclaim, once scheduled

    async def settle(self, seconds: float) -> None:
        """Wait up to `seconds` for the open sessions and the forwards in flight to end (new ones are refused
        meanwhile only if `moving_to` is set)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while (self.sessions or self.forwards.in_use) and loop.time() < deadline:
            await asyncio.sleep(0.1)

    def end_sessions(self) -> int:
        """End the streams of the sessions still open (their clients fail over); returns how many were ended."""
        for session in [s for s in self.sessions.values() if s.stream is None]:  # detached: nobody to tell
            self._close(session)
        ended = [s for s in self.sessions.values() if s.stream is not None and s.stream.writer is not None]
        for session in ended:
            assert session.stream is not None and session.stream.writer is not None
            session.stream.ended = True  # freed, not detached
            session.stream.writer.close()  # its read fails at once: the session is freed as on a client's hang-up
        return len(ended)

    def _reclaim_lent_cache_later(self) -> None:
        """A caller was refused room: if some caller holds more than its share (it was lent cache), end its newest
        sessions over its share `lent_cache_grace` s from now, unless they have ended by then."""
        if self._reclaim is None and self.budget.borrowers():
            self._reclaim = asyncio.get_running_loop().call_later(self.lent_cache_grace, self._reclaim_lent_cache)

    def _reclaim_lent_cache(self) -> None:
        """End each borrower's newest sessions until it holds no more than its share (its clients fail over)."""
        self._reclaim = None
        for owner, excess in self.budget.borrowers().items():
            for session in sorted((s for s in self.sessions.values() if s.owner == owner),
                                  key=lambda s: s.opened, reverse=True):
                if excess <= 0:
                    break
                excess -= self.budget.held(session.session_id)
                if session.stream is None:  # detached: freed now, nobody to tell
                    self._close(session)
                else:
                    logger.info("Ending session %s of %s: its cache was lent, and another caller waits for it",
                                session.session_id[:8], session.peer[-6:])
                    self._end_stream(session.stream, ErrorCode.BUSY, "this server lent your session cache beyond "
                                     "your share, and another caller now waits for it: session ended; route around")

    def _refuse_while_moving(self) -> None:
        if self.moving_to is not None:
            raise RequestRejected(ErrorCode.BUSY, f"this server is moving to blocks {self.moving_to}; route around it")

    async def rpc_info(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """This server's announcement, limits and load."""
        await self._serve(info, reader, writer, self._serve_info)

    async def rpc_forward(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                          ) -> None:
        """A whole sequence through blocks [start, end), statelessly: a header, then its tensors."""
        await self._serve(info, reader, writer, self._serve_forward)

    async def rpc_inference(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                            ) -> None:
        """One session per stream: an open message, then steps, then the client's `close`; the KV cache lives until
        the client closes the session, the stream ends, or nothing is accepted on it for `session_timeout`."""
        await self._serve(info, reader, writer, self._serve_inference)

    async def rpc_push(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Another server's pushes into one session of ours: an attach message naming it, then steps (push.py)."""
        await self._serve(info, reader, writer, self._serve_push)

    # ---- info and forward ------------------------------------------------------------------------------------
    async def _serve_info(self, stream: Stream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frame = await self._receive(stream, reader, writer, protocol.OPEN_FRAME_LIMIT)
        await self._reply(stream, writer, lambda: self._info(frame, stream))

    async def _info(self, frame: bytes, stream: Stream) -> bytes:
        self._read(frame, stream)
        return protocol.encode([], {**self.status().info_answer(), "next_rtts": self.next_rtts(),
                                    "cache_tokens_for_caller": self.budget.tokens_for(stream.owner)})

    async def _serve_forward(self, stream: Stream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                             ) -> None:
        header = await self._receive(stream, reader, writer, protocol.OPEN_FRAME_LIMIT)
        await self._reply(stream, writer, lambda: self._forward(header, stream, reader, writer))

    async def _forward(self, header: bytes, stream: Stream, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> bytes:
        """Admit a forward on its header, then read exactly the tensors it declared and run them."""
        tensors, meta = self._read(header, stream)
        if tensors:
            raise reject("a forward header carries no tensors: send them in the next message")
        self._refuse_while_moving()
        shape = validate_forward_header(meta, self.limits, max_tokens=self.max_forward_tokens)
        with self.forwards.hold(stream.owner):
            # admitted: the client sends the tensors only now, so a refused header leaves nothing unread (a stream
            # ended with unread bytes is reset by p2pd, and the client would lose the answer saying why)
            protocol.write_frame(writer, protocol.encode([], {"admitted": True}))
            await writer.drain()
            limit = protocol.step_frame_limit(batch=shape.batch_size, tokens=shape.length, mask_length=shape.length,
                                              hidden_size=self.limits.hidden_size, itemsize=shape.dtype.itemsize)
            stream.accepted(within=FORWARD_GRACE + limit / FORWARD_MIN_RATE)  # its tensors' time to arrive
            tensors, _ = protocol.decode(await self._receive(stream, reader, writer, limit))
            hidden, mask, positions = validate_forward(tensors, shape, self.limits)
            output = await self._compute(hidden, mask, positions, None, shape.start, shape.end, self.background)
        return protocol.encode([output])

    # ---- inference -------------------------------------------------------------------------------------------
    async def _serve_inference(self, stream: Stream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                               ) -> None:
        while not stream.ended:
            frame = await self._receive(stream, reader, writer, self._frame_limit(stream))
            await self._reply(stream, writer, lambda: self._message(frame, stream))  # noqa: B023 - awaited here

    def _frame_limit(self, stream: Stream) -> int:
        """The largest message the stream may send now: small until a session is open, then a step of it."""
        if stream.session is None:
            return protocol.OPEN_FRAME_LIMIT
        return stream.session.step_frame_limit(self.limits.hidden_size)

    async def _message(self, frame: bytes, stream: Stream) -> bytes:
        """Answer one message of a stream: the open message, a step, or the client's request to end the session."""
        tensors, meta = self._read(frame, stream)
        if isinstance(meta.get("step_id"), int):
            stream.step_id = meta["step_id"]
        if meta.get("close"):
            return self._end(meta, stream)
        if meta.get("open"):
            return self._open(tensors, meta, stream)
        if meta.get("resume"):
            return await self._resume(tensors, meta, stream)
        return await self._step(tensors, meta, stream)

    def _end(self, meta: dict[str, Any], stream: Stream) -> bytes:
        """Free the stream's session now and say so: the client's `close()` returns once the cache is back."""
        if stream.session is not None:
            check_session_id(meta, stream.session)
            self._close(stream.session)
            stream.session = None
        stream.ended = True
        return protocol.encode([], {"closed": True})

    def _open(self, tensors: list[torch.Tensor], meta: dict[str, Any], stream: Stream) -> bytes:
        """Check an open message whole, then reserve the session's cache: a refused one takes nothing."""
        if stream.session is not None:
            raise reject(f"this stream already carries session {stream.session.session_id[:8]}; open another stream")
        if tensors:
            raise reject("an open message carries no tensors: send the first step after it")
        self._refuse_while_moving()
        session_id, batch_size, max_length = validate_session_open(meta, self.limits)
        start, end = validate_span(meta, self.limits)
        if meta.get("background") is True and any(key in meta for key in ("push", "ring_to", "ring_from")):
            raise reject("a background session (a check) takes no push and no ring: open it without them")
        if session_id in self.sessions:
            raise reject(f"session {session_id!r} is already open on another stream")
        held = sum(s.owner == stream.owner for s in self.sessions.values())
        if held >= self.max_sessions_per_peer:
            raise RequestRejected(ErrorCode.BUSY, f"this caller already has {held} sessions open here, the most one "
                                                  f"caller may have; close one or use another server")
        caches = self.span.new_caches(start, end, max_length)
        try:
            self.budget.reserve(session_id, owner=stream.owner, batch_size=batch_size, max_length=max_length,
                                num_blocks=end - start)
        except RequestRejected:
            self._reclaim_lent_cache_later()
            raise
        ring_route, ring_from = ring_of(meta, start, end, self.guesser, self.may_push_to, self.may_push_here)
        session = stream.session = self.sessions[session_id] = Session(
            session_id, stream.peer, stream.owner, start, end, batch_size, max_length, caches,
            pushable=meta.get("push") is True, resumable=meta.get("resumable") is True, stream=stream,
            ring_route=ring_route, ring_from=ring_from, background=meta.get("background") is True)
        logger.info(SESSION_OPENED_LOG, session_id[:8], stream.peer[-6:], start, end, batch_size, max_length)
        answer: dict[str, Any] = {"opened": True, "session_id": session.session_id}
        if "ring_to" in meta or "ring_from" in meta:  # asked to join the ring (ring.py): whether it did
            answer["ring"] = ring_route is not None or ring_from is not None
        return protocol.encode([], answer)

    async def _resume(self, tensors: list[torch.Tensor], meta: dict[str, Any], stream: Stream) -> bytes:
        """Take over a session of this caller (the same peer id) on this new stream: a detached one, or one whose
        old stream the server has not seen end yet (that stream carries it no more). Answers how many steps the
        session applied, so that its client resends only the rest. Another caller's session is as unknown as one
        that never was."""
        if stream.session is not None or tensors:
            raise reject("a resume message comes first on a new stream, without tensors")
        session_id = str(meta.get("session_id"))
        session = self.sessions.get(session_id)
        if session is None or not session.resumable or (session.peer, session.owner) != (stream.peer, stream.owner):
            raise RequestRejected(ErrorCode.UNKNOWN_SESSION, f"no session {session_id[:64]!r} to resume here")
        async with session.lock:  # a step under way on the old stream is applied first
            if self.sessions.get(session_id) is not session:
                raise RequestRejected(ErrorCode.UNKNOWN_SESSION, f"no session {session_id[:64]!r} to resume here")
            old = session.stream
            if old is not None:
                old.session, old.ended = None, True
                if old.writer is not None:
                    old.writer.close()
            if session.expiry is not None:
                session.expiry.cancel()
                session.expiry = None
            session.stream, stream.session = stream, session
        logger.info(SESSION_RESUMED_LOG, session_id[:8], stream.peer[-6:], session.applied, session.length)
        return protocol.encode([], {"resumed": True, "session_id": session_id, "applied": session.applied,
                                    "cache_len": session.length})

    def _stream_ended(self, stream: Stream, session: Session) -> None:
        """A stream carrying a session ended: the session is detached if its stream was lost (the caller's side
        ended or broke, not the server's doing) and it may be resumed; else freed."""
        if not (stream.lost and not stream.ended and session.resumable and self.session_grace > 0
                and session.stream is stream and self.sessions.get(session.session_id) is session):
            self._close(session)
            return
        session.stream = None
        session.expiry = asyncio.get_running_loop().call_later(self.session_grace, self._expire, session)
        logger.info(SESSION_DETACHED_LOG, session.session_id[:8], session.peer[-6:], session.applied,
                    self.session_grace)

    def _expire(self, session: Session) -> None:
        """The grace of a detached session is over: free it (its cache goes back to the budget)."""
        session.expiry = None
        if session.stream is None and self.sessions.get(session.session_id) is session:
            logger.info(SESSION_EXPIRED_LOG, session.session_id[:8], self.session_grace)
            self._close(session, quiet=True)

    async def _step(self, tensors: list[torch.Tensor], meta: dict[str, Any], stream: Stream) -> bytes:
        session = stream.session
        if session is None:
            raise RequestRejected(ErrorCode.UNKNOWN_SESSION, "no session is open on this stream: send an open message first")
        check_session_id(meta, session)
        return await self._apply(session, tensors, meta, stream)

    async def _apply(self, session: Session, tensors: list[torch.Tensor], meta: dict[str, Any], stream: Stream
                     ) -> bytes:
        """Apply one step to a session, once per step id (a duplicate gets the first answer again, and keeps no
        stream alive), and push its outputs on along the step's route."""
        step_id, route = validate_step_id(meta.get("step_id")), validate_route(meta.get("route"))
        if route and not session.pushable:
            raise reject("a step with a 'route' needs a session opened with \"push\": true")
        if route and step_id is None:
            raise reject("a step with a 'route' needs a 'step_id'")
        if route and not self.may_push_to(route[0][0]):
            raise RequestRejected(ErrorCode.UNAUTHORIZED, f"this server pushes to members of its swarm only, and "
                                  f"{route[0][0][:64]} is none: route through member servers")
        confirmed = False
        async with session.lock:
            if step_id is not None and step_id != session.applied:
                applied, stream.repeated = self._repeated(session, step_id), True
                # the client's own copy of a guessed step: it confirms the guess (its answer went out already: the
                # client is told so in a few bytes) or ends the ring (the client gets the guessed step's answer)
                confirmed = stream.push_target is None and confirm_guess(session, applied, tensors, meta)
            else:
                pusher = stream.peer if stream.push_target is not None else None
                answer, output, mask, positions, digest = await self._compute_step(session, tensors, meta, pusher)
                session.applied += 1
                applied = AppliedStep(-1 if step_id is None else step_id, answer, (output, mask, positions),
                                      meta.get("keep_rows"), unconfirmed=digest if _guessed(meta, pusher) else None)
                if step_id is not None:
                    session.last_step = applied
                    self._guess_next(session, applied)
        # a duplicate too, where its first push failed: the client may name a replacement next hop, or a guessed
        # step's push failed before its client sent it (the report came when the client could not act on it)
        if route:
            await self._push_on(session, applied, route)
        return protocol.encode([], {"step_id": step_id, "confirmed": True}) if confirmed else applied.answer

    def _repeated(self, session: Session, step_id: int) -> AppliedStep:
        """A step id other than the next one: the last step, applied once already; else a refusal. Past
        MAX_DUPLICATES_PER_STEP copies of it, the stream is ended (no client retries a step that often)."""
        last = session.last_step
        if last is None or last.step_id != step_id:
            raise reject(f"step {step_id} is out of order: session {session.session_id[:8]} expects step "
                         f"{session.applied}")
        last.duplicates += 1
        if last.duplicates > MAX_DUPLICATES_PER_STEP:
            raise RequestRejected(ErrorCode.INVALID, f"step {step_id} of session {session.session_id[:8]} came "
                                                     f"{last.duplicates} times; ending the stream", ends_stream=True)
        return last

    async def _compute_step(self, session: Session, tensors: list[torch.Tensor], meta: dict[str, Any],
                            pusher: str | None) -> tuple[bytes, torch.Tensor, torch.Tensor, torch.Tensor, bytes | None]:
        """(answer, output, mask, positions, input digest) of one validated step (pushed by `pusher`, or the
        client's: None); a push session's answer names the digest of its input, and says whether it was the ring's
        guess."""
        keep_rows = validate_keep_rows(meta.get("keep_rows"), session.batch_size)
        hidden, mask, positions = validate_step(
            tensors, batch_size=session.batch_size if keep_rows is None else len(keep_rows), past=session.length,
            max_length=session.max_length, hidden_size=self.limits.hidden_size)
        bound = self._bind_input(session, meta, hidden, mask, positions, keep_rows, pusher)
        if keep_rows is not None:  # only after the whole step is valid, so a refused step changes nothing
            self._keep_rows(session, keep_rows)
        began = time.perf_counter()
        if session.background:  # a check: behind the inference steps, on the background thread (background.py)
            output, merged = await self._compute(hidden, mask, positions, session.caches, session.start, session.end,
                                                 self.background), 1
        elif hidden.shape[1] == 1:
            output, merged = await self._decode(session, hidden, mask, positions)
        else:
            output, merged = await self._compute(hidden, mask, positions, session.caches, session.start, session.end), 1
        session.length += hidden.shape[1]
        if _guessed(meta, pusher):
            bound["guess"] = True
        # the compute time lets clients (and bench/swarm.py) tell network overhead from compute
        answer = protocol.encode([output], {"cache_len": session.length, "merged": merged, "step_id": meta.get("step_id"),
                                            "compute_ms": (time.perf_counter() - began) * 1000, **bound})
        return answer, output, mask, positions, bound.get("input_digest")

    def _guess_next(self, session: Session, applied: AppliedStep) -> None:
        """The ring (ring.py): after a decode step of a last hop's session, push the next step, guessed from its
        output, to the session's first hop, unless the session is full. Not after a longer step: a prompt may come as
        several (through a relay), and the next would be more of it. A failed guess push ends the ring for the
        session, untold: the client sends that step itself anyway."""
        route = session.ring_route
        if route is None or self.guesser is None or self.pusher.identity is None or self.pusher.p2p is None or \
                session.length >= session.max_length or applied.pushed[0].shape[1] != 1:
            return
        guessed = self.guesser.next_step(*applied.pushed)
        (peer, target), rest = route[0], route[1:]
        frame = self._push_frame(session, target, applied.step_id + 1, guessed, None, rest, guess=True)

        async def ring_off(downstream: str, reason: str) -> None:
            logger.info("Ring of session %s off: its guess push to %s failed (%s)", session.session_id[:8],
                        downstream[-6:], reason)
            session.ring_route = None
        self.pusher.push_later(session.session_id, (peer, target), frame, ring_off, tokens=guessed[0].shape[0])

    @staticmethod
    def _bind_input(session: Session, meta: dict[str, Any], hidden: torch.Tensor, mask: torch.Tensor,
                    positions: torch.Tensor, keep_rows: list[int] | None, pusher: str | None) -> dict[str, Any]:
        """What a push session's answer says of the input it was computed on (swarmnet/push_proof.py): its digest,
        and for a pushed step the pusher's proof, checked here first (an unproven push is refused, before it changes
        anything: its client then sends the step itself)."""
        if not session.pushable:
            return {}
        step_id = meta.get("step_id")
        digest = input_digest(hidden, mask, positions, keep_rows, step_id)
        if pusher is None:
            return {"input_digest": digest}
        signer = None if not isinstance(step_id, int) else proof_signer(
            meta.get("push_proof"), owner=session.peer, target_session=session.session_id, step_id=step_id,
            digest=digest)
        if signer is None or signer.peer_id != pusher:
            raise reject("a pushed step needs a push proof: the pushing server's signature of this input for this "
                         "session's client")
        return {"input_digest": digest, "push_proof": meta["push_proof"]}

    def _keep_rows(self, session: Session, rows: list[int]) -> None:
        """Drop the other rows of the session's caches; the freed cache goes back to the budget."""
        index = torch.tensor(rows, dtype=torch.long)
        for cache in session.caches:
            cache.batch_select_indices(index)
        session.batch_size = len(rows)
        self.budget.shrink(session.session_id, batch_size=session.batch_size, max_length=session.max_length,
                           num_blocks=session.end - session.start)

    async def _decode(self, session: Session, hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
                      ) -> tuple[torch.Tensor, int]:
        """A decode step, merged with other sessions' steps on the same blocks when they come together."""
        peers = sum((s.start, s.end) == (session.start, session.end) for s in self.sessions.values())
        output, merged = await self.batcher.run(DecodeStep(hidden, mask, positions, session.caches),
                                                session.start, session.end, peers=peers)
        self.stats.record_step(tokens=hidden.shape[0])
        return output, merged  # in the span's compute dtype: what travels (bfloat16/float16 halve float32's bytes)

    def _close(self, session: Session, *, quiet: bool = False) -> None:
        if session.expiry is not None:
            session.expiry.cancel()
            session.expiry = None
        self.pusher.close_session(session.session_id)
        self.sessions.pop(session.session_id, None)
        self.budget.release(session.session_id)
        if not quiet:
            logger.info(SESSION_CLOSED_LOG, session.session_id[:8], session.length)

    async def _compute(self, hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                       caches: list[Any] | None, start: int, end: int, executor: ThreadPoolExecutor | None = None
                       ) -> torch.Tensor:
        if hidden.shape[1] == 1 and executor is None:
            # a decode step is short: running it here saves the thread hand-off (~0.8 ms a hop); the executor
            # has one thread anyway, so no concurrency is lost. Long prefills go to the executor so that the
            # event loop keeps answering pings and announcing meanwhile.
            output = self.span(hidden, mask, positions, caches, start, end)
        else:
            loop = asyncio.get_running_loop()
            output = await loop.run_in_executor(executor or self.executor, self.span, hidden, mask, positions, caches,
                                                start, end)
        self.stats.record_step(tokens=hidden.shape[0] * hidden.shape[1])
        return output


def _guessed(meta: dict[str, Any], pusher: str | None) -> bool:
    """Whether a step is the ring's guess (pushed, and marked so: ring.py)."""
    return pusher is not None and meta.get("guess") is True
