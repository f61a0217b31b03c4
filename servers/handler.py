"""RPC handlers of a block server: `info`, `forward` (stateless) and `inference` (one stream = one session).

All three are raw streams of length-prefixed frames (swarmnet/protocol.py), and what a caller can make the
server take is bounded before it is taken:

- a message's length is checked before it is read: OPEN_FRAME_LIMIT until a session exists (and for info requests
  and forward headers), then what the session's (or the forward header's) shape allows; an oversized one gets an
  `invalid_request` answer and ends the stream;
- a stream's first message is authorized (`authorize`, in `_read`, the one place) before anything else is done;
- a forward's header is answered {"admitted": true} before its tensors are sent, so that a refusal never leaves
  a client's bytes unread: p2pd resets a stream ended with unread bytes, and the client then loses the answer;
- a session reserves its KV cache only once its open message is valid, within the caller's share of sessions
  and cache; a refused open takes nothing;
- a forward holds a slot (`Slots`: per caller and per server) from its header to its answer;
- a stream is closed `session_timeout` after its last accepted message (refused ones do not keep it alive), and
  after MAX_REFUSED_BEFORE_OPEN refused messages in a row before a session exists.

Every exception is turned into an in-band error response in one place (`_answer`), so a bad request never stops
the server or the stream it came on.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from servers.admission import Slots
from servers.batching import DecodeBatcher, DecodeStep
from servers.errors import RequestRejected
from servers.memory import CacheBudget
from servers.push import Pusher
from servers.span import BlockSpan
from servers.stats import ServerStats
from servers.status import ServerStatus
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
from swarmnet.protocol import ErrorCode

logger = logging.getLogger(__name__)
# log lines that tests read (sessions open at once): session id prefix first
SESSION_OPENED_LOG = "Session %s opened by %s: blocks %d:%d, batch %d, up to %d tokens"
SESSION_CLOSED_LOG = "Session %s closed after %d tokens"
MAX_REFUSED_BEFORE_OPEN = 8  # refused messages in a row after which a stream without a session is ended
LINGER_SECONDS = 3.0  # how long a stream the server ends waits for the caller to close it first (`let_go`)
LINGER_BYTES = 1 << 16  # the most it reads (and drops) meanwhile

Authorize = Callable[[str, dict[str, Any]], None]


def allow_everyone(caller: str, meta: dict[str, Any]) -> None:
    """The default `authorize`: every caller may use the server."""


@dataclass(frozen=True)
class AppliedStep:
    """A step a session applied: its answer, and what pushing it on takes (a duplicate may name a new route)."""

    step_id: int
    answer: bytes
    pushed: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # output, attention mask, position ids
    keep_rows: Any


@dataclass
class Session:
    """One client's inference session on this server."""

    session_id: str
    peer: str  # the caller that opened it
    start: int
    end: int
    batch_size: int
    max_length: int
    caches: list[Any]
    length: int = 0
    pushable: bool = False  # opened with "push": its client's route may push steps into it (push.py)
    stream: Stream | None = None  # the stream that opened it: answers to pushed steps go there
    applied: int = 0  # steps applied; a step id below it is a duplicate
    last_step: AppliedStep | None = None  # the last step applied: what a duplicate of it gets again
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one step at a time (a push and a direct step race)


def check_session_id(meta: dict[str, Any], session: Session) -> None:
    """A stream carries one session: a message naming another is refused (and changes nothing)."""
    if meta.get("session_id") != session.session_id:
        raise RequestRejected(ErrorCode.UNKNOWN_SESSION,
                              f"unknown session {str(meta.get('session_id'))[:64]!r} on this stream")


class StreamOver(Exception):
    """The stream is over: the caller ended it, sent nothing accepted for too long, or sent an oversized message."""


@dataclass
class Stream:
    """One stream of one caller: when it expires, whether its first message passed, its session, its refusals."""

    peer: str  # the caller's peer id, authenticated by libp2p
    timeout: float
    deadline: float = 0.0  # event-loop time after which the stream is closed, unless a message is accepted before
    authorized: bool = False
    session: Session | None = None
    refused: int = 0  # refused messages in a row
    ended: bool = False
    writer: asyncio.StreamWriter | None = None
    step_id: int | None = None  # the step id of the message being answered (its refusal carries it too)
    push_target: Session | None = None  # a push stream: the session it was attached to

    def __post_init__(self) -> None:
        self.accepted()

    def accepted(self) -> None:
        """A message was accepted: the stream lives `timeout` more seconds from now."""
        self.deadline = asyncio.get_running_loop().time() + self.timeout
        self.refused = 0


StreamServer = Callable[[Stream, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def let_go(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """End a stream once the caller has closed its side, or after LINGER_SECONDS or LINGER_BYTES.

    p2pd resets a stream that the server closes (or half-closes) while the caller still holds it open, and a reset
    loses the answers still in flight: measured, about 1 in 500 one-request streams lost its answer that way, none
    of 5400 with this wait. A caller closes as soon as it has its last answer; what it sends meanwhile is read and
    dropped, up to LINGER_BYTES.
    """
    try:
        async with asyncio.timeout(LINGER_SECONDS):
            left = LINGER_BYTES
            while left > 0 and (chunk := await reader.read(min(left, 1 << 16))):
                left -= len(chunk)
    except (TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()


@dataclass
class BlockHandler:
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
    # who may use the server: called with the caller's peer id and its stream's first message's meta; raises
    # RequestRejected(UNAUTHORIZED) to refuse (an in-band error; nothing is reserved or computed)
    authorize: Authorize = allow_everyone
    stats: ServerStats = field(default_factory=ServerStats)
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "swarmbatch-compute"))
    sessions: dict[str, Session] = field(default_factory=dict)
    pusher: Pusher = field(default_factory=Pusher)
    # this server's round trips to the servers that may follow it (servers/neighbours.py), for its info answer
    next_rtts: Callable[[], dict[str, float]] = dict
    # who this server may push a session's hidden states to (a private swarm's members only; everyone if open)
    may_push_to: Callable[[str], bool] = lambda peer: True

    def __post_init__(self) -> None:
        # a merged forward holds at most as many rows as one session may have
        self.batcher = DecodeBatcher(self.span, wait_ms=self.batch_wait_ms, max_rows=self.limits.max_batch_size,
                                     stats=self.stats, max_merge_tokens=self.max_merge_tokens)
        self.forwards = Slots("forwards in flight", per_caller=self.max_forwards_per_peer,
                              total=self.max_queued_forwards)

    async def register(self, p2p: P2P) -> None:
        """Add the RPCs to a P2P node (whose streams also carry this server's pushes)."""
        self.pusher.p2p = p2p
        await p2p.add_binary_stream_handler(protocol.RPC_PUSH, self.rpc_push)
        await p2p.add_binary_stream_handler(protocol.RPC_INFO, self.rpc_info)
        await p2p.add_binary_stream_handler(protocol.RPC_FORWARD, self.rpc_forward)
        await p2p.add_binary_stream_handler(protocol.RPC_INFERENCE, self.rpc_inference)

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

    # ---- streams ---------------------------------------------------------------------------------------------
    async def _serve(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     serve: StreamServer) -> None:
        stream = Stream(peer=str(info.peer_id), timeout=self.session_timeout, writer=writer)
        try:
            await serve(stream, reader, writer)
        except (StreamOver, ConnectionError):  # over, or the caller went away while we computed
            pass
        finally:
            if stream.session is not None:
                self._close(stream.session)
            await let_go(reader, writer)

    async def _receive(self, stream: Stream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       limit: int) -> bytes:
        """The stream's next message, of at most `limit` bytes; raises StreamOver when there is none to answer."""
        try:
            async with asyncio.timeout_at(stream.deadline):  # no extra task per step, unlike wait_for
                return await protocol.read_frame(reader, limit)
        except (asyncio.IncompleteReadError, ConnectionError):
            raise StreamOver from None  # the caller ended the stream (or died)
        except TimeoutError:
            logger.info("No message accepted from %s for %.0f s; closing its stream", stream.peer[-6:], stream.timeout)
            raise StreamOver from None
        except protocol.FrameTooLarge as e:  # the stream cannot be resynchronized: answer, then end it
            self.stats.record_error(ErrorCode.INVALID.value)
            protocol.write_frame(writer, protocol.encode_error(ErrorCode.INVALID, str(e)))
            raise StreamOver from None

    async def _reply(self, stream: Stream, writer: asyncio.StreamWriter, handle: Callable[[], Awaitable[bytes]]
                     ) -> None:
        """Answer one message; only an accepted one keeps the stream alive, and too many refusals end it."""
        stream.step_id = None
        answer, error = await self._answer(handle)
        if error is None:
            stream.accepted()
        else:
            if stream.step_id is not None:  # a push client files answers by step id (swarmclient/answers.py)
                answer = protocol.encode([], {**protocol.decode_meta(answer), "step_id": stream.step_id})
            stream.refused += 1
            if stream.session is None and stream.refused >= MAX_REFUSED_BEFORE_OPEN:
                logger.info("Ending the stream of %s after %d refused messages (last: %s)", stream.peer[-6:],
                            stream.refused, error.value)
                stream.ended = True
        protocol.write_frame(writer, answer)
        await writer.drain()

    def _read(self, frame: bytes, stream: Stream) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """Decode a message. A stream's first message is authorized here, the one place, before anything is done
        with it; until one passes, each message is taken for the first (and refused like it)."""
        tensors, meta = protocol.decode(frame)
        if not stream.authorized:
            self.authorize(stream.peer, meta)
            stream.authorized = True
        return tensors, meta

    # ---- info and forward ------------------------------------------------------------------------------------
    async def _serve_info(self, stream: Stream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frame = await self._receive(stream, reader, writer, protocol.OPEN_FRAME_LIMIT)
        await self._reply(stream, writer, lambda: self._info(frame, stream))

    async def _info(self, frame: bytes, stream: Stream) -> bytes:
        self._read(frame, stream)
        return protocol.encode([], {**self.status().info_answer(), "next_rtts": self.next_rtts(),
                                    "cache_tokens_for_caller": self.budget.tokens_for(stream.peer)})

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
        shape = validate_forward_header(meta, self.limits)
        with self.forwards.hold(stream.peer):
            # admitted: the client sends the tensors only now, so a refused header leaves nothing unread (a stream
            # ended with unread bytes is reset by p2pd, and the client would lose the answer saying why)
            protocol.write_frame(writer, protocol.encode([], {"admitted": True}))
            await writer.drain()
            stream.accepted()  # its tensors have `session_timeout` to arrive
            limit = protocol.step_frame_limit(batch=shape.batch_size, tokens=shape.length, mask_length=shape.length,
                                              hidden_size=self.limits.hidden_size, itemsize=shape.dtype.itemsize)
            tensors, _ = protocol.decode(await self._receive(stream, reader, writer, limit))
            hidden, mask, positions = validate_forward(tensors, shape, self.limits)
            output = await self._compute(hidden, mask, positions, None, shape.start, shape.end)
        return protocol.encode([output])

    # ---- inference -------------------------------------------------------------------------------------------
    async def _serve_inference(self, stream: Stream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                               ) -> None:
        while not stream.ended:
            frame = await self._receive(stream, reader, writer, self._frame_limit(stream))
            await self._reply(stream, writer, lambda: self._message(frame, stream))  # noqa: B023 - awaited here

    # ---- push (the upstream side is push.py) ----------------------------------------------------------------------
    async def _serve_push(self, stream: Stream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """An attach message (authorized like any stream's first message), then pushed steps of that session."""
        attach = await self._receive(stream, reader, writer, protocol.OPEN_FRAME_LIMIT)
        await self._reply(stream, writer, lambda: self._attach(attach, stream))
        while stream.push_target is not None and not stream.ended:
            session = stream.push_target
            limit = protocol.step_frame_limit(batch=session.batch_size, tokens=session.max_length - session.length,
                                              mask_length=session.max_length, hidden_size=self.limits.hidden_size)
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

    def _frame_limit(self, stream: Stream) -> int:
        """The largest message the stream may send now: small until a session is open, then a step of it."""
        session = stream.session
        if session is None:
            return protocol.OPEN_FRAME_LIMIT
        return protocol.step_frame_limit(batch=session.batch_size, tokens=session.max_length - session.length,
                                         mask_length=session.max_length, hidden_size=self.limits.hidden_size)

    async def _message(self, frame: bytes, stream: Stream) -> bytes:
        """Answer one message of a stream: the open message, a step, or the client's request to end the session."""
        tensors, meta = self._read(frame, stream)
        if isinstance(meta.get("step_id"), int):
            stream.step_id = meta["step_id"]
        if meta.get("close"):
            return self._end(meta, stream)
        if meta.get("open"):
            return self._open(tensors, meta, stream)
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
        session_id, batch_size, max_length = validate_session_open(meta, self.limits)
        start, end = validate_span(meta, self.limits)
        if session_id in self.sessions:
            raise reject(f"session {session_id!r} is already open on another stream")
        held = sum(s.peer == stream.peer for s in self.sessions.values())
        if held >= self.max_sessions_per_peer:
            raise RequestRejected(ErrorCode.BUSY, f"this caller already has {held} sessions open here, the most one "
                                                  f"caller may have; close one or use another server")
        caches = self.span.new_caches(start, end)
        self.budget.reserve(session_id, owner=stream.peer, batch_size=batch_size, max_length=max_length,
                            num_blocks=end - start)
        session = stream.session = self.sessions[session_id] = Session(
            session_id, stream.peer, start, end, batch_size, max_length, caches, pushable=meta.get("push") is True,
            stream=stream)
        logger.info(SESSION_OPENED_LOG, session_id[:8], stream.peer[-6:], start, end, batch_size, max_length)
        return protocol.encode([], {"opened": True, "session_id": session.session_id})

    async def _step(self, tensors: list[torch.Tensor], meta: dict[str, Any], stream: Stream) -> bytes:
        session = stream.session
        if session is None:
            raise RequestRejected(ErrorCode.UNKNOWN_SESSION, "no session is open on this stream: send an open message first")
        check_session_id(meta, session)
        return await self._apply(session, tensors, meta)

    async def _apply(self, session: Session, tensors: list[torch.Tensor], meta: dict[str, Any]) -> bytes:
        """Apply one step to a session, once per step id (a duplicate gets the first answer again), and push its
        outputs on along the step's route."""
        step_id, route = validate_step_id(meta.get("step_id")), validate_route(meta.get("route"))
        if route and not session.pushable:
            raise reject("a step with a 'route' needs a session opened with \"push\": true")
        if route and not self.may_push_to(route[0][0]):
            raise RequestRejected(ErrorCode.UNAUTHORIZED, f"this server pushes to members of its swarm only, and "
                                  f"{route[0][0][:64]} is none: route through member servers")
        async with session.lock:
            if step_id is not None and step_id != session.applied:
                applied = self._repeated(session, step_id)
            else:
                answer, output, mask, positions = await self._compute_step(session, tensors, meta)
                session.applied += 1
                applied = AppliedStep(-1 if step_id is None else step_id, answer, (output, mask, positions),
                                      meta.get("keep_rows"))
                if step_id is not None:
                    session.last_step = applied
        if route:  # a duplicate too: its first push may have failed (the client then names a new next hop)
            self._push_on(session, step_id, route, *applied.pushed, applied.keep_rows)
        return applied.answer

    def _repeated(self, session: Session, step_id: int) -> AppliedStep:
        """A step id other than the next one: the last step, applied once already; else a refusal."""
        if session.last_step is not None and session.last_step.step_id == step_id:
            return session.last_step
        raise reject(f"step {step_id} is out of order: session {session.session_id[:8]} expects step {session.applied}")

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

    async def _compute_step(self, session: Session, tensors: list[torch.Tensor], meta: dict[str, Any]
                            ) -> tuple[bytes, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(answer, output, mask, positions) of one validated step."""
        keep_rows = validate_keep_rows(meta.get("keep_rows"), session.batch_size)
        hidden, mask, positions = validate_step(
            tensors, batch_size=session.batch_size if keep_rows is None else len(keep_rows), past=session.length,
            max_length=session.max_length, hidden_size=self.limits.hidden_size)
        if keep_rows is not None:  # only after the whole step is valid, so a refused step changes nothing
            self._keep_rows(session, keep_rows)
        began = time.perf_counter()
        if hidden.shape[1] == 1:
            output, merged = await self._decode(session, hidden, mask, positions)
        else:
            output, merged = await self._compute(hidden, mask, positions, session.caches, session.start, session.end), 1
        session.length += hidden.shape[1]
        # the compute time lets clients (and bench/swarm.py) tell network overhead from compute
        answer = protocol.encode([output], {"cache_len": session.length, "merged": merged, "step_id": meta.get("step_id"),
                                            "compute_ms": (time.perf_counter() - began) * 1000})
        return answer, output, mask, positions

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
        return output.float(), merged

    def _close(self, session: Session) -> None:
        self.pusher.close_session(session.session_id)
        self.sessions.pop(session.session_id, None)
        self.budget.release(session.session_id)
        logger.info(SESSION_CLOSED_LOG, session.session_id[:8], session.length)

    async def _compute(self, hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                       caches: list[Any] | None, start: int, end: int) -> torch.Tensor:
        if hidden.shape[1] == 1:
            # a decode step is short: running it here saves the thread hand-off (~0.8 ms a hop); the executor
            # has one thread anyway, so no concurrency is lost. Long prefills go to the executor so that the
            # event loop keeps answering pings and announcing meanwhile.
            output = self.span(hidden, mask, positions, caches, start, end)
        else:
            loop = asyncio.get_running_loop()
            output = await loop.run_in_executor(self.executor, self.span, hidden, mask, positions, caches, start, end)
        self.stats.record_step(tokens=hidden.shape[0] * hidden.shape[1])
        return output.float()

    async def _answer(self, handle: Callable[[], Awaitable[bytes]]) -> tuple[bytes, ErrorCode | None]:
        """The one place where exceptions become error responses: (the answer, the error code if refused)."""
        try:
            return await handle(), None
        except StreamOver:
            raise
        except RequestRejected as e:
            logger.info("Rejected a request: %s: %s", e.code.value, e)
            return self._error(e.code, str(e))
        except (ValueError, TypeError, IndexError) as e:  # undecodable tensors or metadata
            return self._error(ErrorCode.INVALID, f"malformed request: {type(e).__name__}: {e}")
        except Exception as e:
            logger.exception("Request failed")
            return self._error(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")

    def _error(self, code: ErrorCode, message: str) -> tuple[bytes, ErrorCode]:
        self.stats.record_error(code.value)
        return protocol.encode_error(code, message), code
