"""RPC handlers of a block server: `info`, `forward` (stateless) and `inference` (one raw stream = one session).

Every exception is turned into an in-band error response in one place (`_guard`), so a bad request never
stops the server or the stream it came on.
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
from hivemind.p2p import P2P, P2PContext
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2

from servers.access import MemberGate
from servers.batching import DecodeBatcher, DecodeStep
from servers.errors import RequestRejected
from servers.memory import CacheBudget
from servers.span import BlockSpan
from servers.stats import ServerStats
from servers.status import ServerStatus
from servers.validation import Limits, reject, validate_keep_rows, validate_session_open, validate_span, validate_step
from swarmclient import protocol
from swarmclient.protocol import ErrorCode

logger = logging.getLogger(__name__)
# log lines that tests read (sessions open at once): session id prefix first
SESSION_OPENED_LOG = "Session %s opened by %s: blocks %d:%d, batch %d, up to %d tokens"
SESSION_CLOSED_LOG = "Session %s closed after %d tokens"


@dataclass
class Session:
    """One client's inference session on this server."""

    session_id: str
    start: int
    end: int
    batch_size: int
    max_length: int
    caches: list[Any]
    length: int = 0


def check_session_id(meta: dict[str, Any], session: Session) -> None:
    """A stream carries one session: a message naming another is refused (and changes nothing)."""
    if meta.get("session_id") != session.session_id:
        raise RequestRejected(ErrorCode.UNKNOWN_SESSION,
                              f"unknown session {str(meta.get('session_id'))[:64]!r} on this stream")


@dataclass
class Stream:
    """One `inference` stream: the session it opened (at its first step) and whether the client ended it."""

    remote: str
    peer: str = ""  # the caller's full peer id (authenticated by libp2p), for the membership check
    session: Session | None = None
    ended: bool = False


@dataclass
class BlockHandler:
    """Serves one BlockSpan over P2P."""

    span: BlockSpan
    limits: Limits
    budget: CacheBudget
    status: Callable[[], ServerStatus]  # the server's status, which the `info` RPC answers with
    session_timeout: float = 300.0
    batch_wait_ms: float = 2.0  # how long a decode step waits for other sessions' steps to merge with; 0 = never
    max_merge_tokens: int = 2048  # a session caching more (rows x length) is never merged: copying it costs more
    stats: ServerStats = field(default_factory=ServerStats)
    gate: MemberGate = field(default_factory=MemberGate.open)  # membership: checked first by info, forward, inference
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "swarmbatch-compute"))
    sessions: dict[str, Session] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # a merged forward holds at most as many rows as one session may have
        self.batcher = DecodeBatcher(self.span, wait_ms=self.batch_wait_ms, max_rows=self.limits.max_batch_size,
                                     stats=self.stats, max_merge_tokens=self.max_merge_tokens)

    async def register(self, p2p: P2P) -> None:
        """Add the three RPCs to a P2P node."""
        await p2p.add_protobuf_handler(protocol.RPC_INFO, self.rpc_info, runtime_pb2.ExpertRequest)
        await p2p.add_protobuf_handler(protocol.RPC_FORWARD, self.rpc_forward, runtime_pb2.ExpertRequest)
        await p2p.add_binary_stream_handler(protocol.RPC_INFERENCE, self.rpc_inference)

    @property
    def max_frame_bytes(self) -> int:
        """The largest step message a valid session can send: a full batch of hidden states, mask and positions."""
        rows, length = self.limits.max_batch_size, self.limits.max_length
        return rows * length * (self.limits.hidden_size * 4 + 16) + (1 << 16)

    async def rpc_info(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """This server's announcement, limits and load."""
        return runtime_pb2.ExpertResponse(metadata=await self._guard(lambda: self._info(request.metadata, context)))

    async def _info(self, frame: bytes, context: P2PContext) -> bytes:
        self.gate.check(context.remote_id.to_base58(), protocol.decode_meta(frame))  # membership, before all else
        return protocol.encode([], self.status().info_answer())

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext
                          ) -> runtime_pb2.ExpertResponse:
        """A whole sequence through blocks [start, end), statelessly."""
        return runtime_pb2.ExpertResponse(
            metadata=await self._guard(lambda: self._forward(request.metadata, context.remote_id.to_base58())))

    async def _forward(self, frame: bytes, caller: str) -> bytes:
        self.gate.check(caller, protocol.decode_meta(frame))  # membership, before the tensors are even decoded
        tensors, meta = protocol.decode(frame)
        start, end = validate_span(meta, self.limits)
        batch = tensors[0].shape[0] if tensors and tensors[0].ndim == 3 else 0
        if not 1 <= batch <= self.limits.max_batch_size:
            raise reject(f"batch size must be in [1, {self.limits.max_batch_size}], got {batch}")
        hidden, mask, positions = validate_step(tensors, batch_size=batch, past=0, max_length=self.limits.max_length,
                                                hidden_size=self.limits.hidden_size)
        output = await self._compute(hidden, mask, positions, None, start, end)
        return protocol.encode([output])

    async def rpc_inference(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                            ) -> None:
        """One session per stream: each message is a step, or the client's `close`; the KV cache lives until
        the client closes the session, the stream ends, or the session idles past `session_timeout`."""
        stream = Stream(remote=str(info.peer_id)[-6:], peer=info.peer_id.to_base58())
        try:
            while not stream.ended:
                try:
                    async with asyncio.timeout(self.session_timeout):  # no extra task per step, unlike wait_for
                        frame = await protocol.read_frame(reader, self.max_frame_bytes)
                except (asyncio.IncompleteReadError, ConnectionError):
                    break  # the client closed the stream (or died)
                except TimeoutError:
                    logger.info("Session idle for %.0f s; closing it", self.session_timeout)
                    break
                except protocol.FrameTooLarge as e:  # the stream cannot be resynchronized: answer, then end it
                    self.stats.record_error(ErrorCode.INVALID.value)
                    protocol.write_frame(writer, protocol.encode_error(ErrorCode.INVALID, str(e)))
                    break
                protocol.write_frame(writer, await self._guard(lambda: self._message(frame, stream)))  # noqa: B023 - awaited here
                await writer.drain()
        except ConnectionError:  # the client went away while we computed: nothing to answer
            pass
        finally:
            if stream.session is not None:
                self._close(stream.session)
            writer.close()

    async def _message(self, frame: bytes, stream: Stream) -> bytes:
        """Answer one message of a stream: a step, or the client's request to end the session."""
        if stream.session is None:  # membership: the message that opens a session, before it is decoded or reserved
            self.gate.check(stream.peer, protocol.decode_meta(frame))
        tensors, meta = protocol.decode(frame)
        if meta.get("close"):
            return self._end(meta, stream)
        return await self._step(tensors, meta, stream)

    def _end(self, meta: dict[str, Any], stream: Stream) -> bytes:
        """Free the stream's session now and say so: the client's `close()` returns once the cache is back."""
        if stream.session is not None:
            check_session_id(meta, stream.session)
            self._close(stream.session)
            stream.session = None
        stream.ended = True
        return protocol.encode([], {"closed": True})

    async def _step(self, tensors: list[torch.Tensor], meta: dict[str, Any], stream: Stream) -> bytes:
        session = stream.session or self._open(meta, stream.remote)
        stream.session = session
        check_session_id(meta, session)
        if (meta.get("start"), meta.get("end")) != (session.start, session.end):
            raise reject(f"the session serves blocks {session.start}:{session.end}, not {meta.get('start')}:{meta.get('end')}")
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
        return protocol.encode([output], {"cache_len": session.length, "merged": merged,
                                          "compute_ms": (time.perf_counter() - began) * 1000})

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

    def _open(self, meta: dict[str, Any], remote: str) -> Session:
        session_id, batch_size, max_length = validate_session_open(meta, self.limits)
        start, end = validate_span(meta, self.limits)
        if session_id in self.sessions:
            raise reject(f"session {session_id!r} is already open on another stream")
        self.budget.reserve(session_id, batch_size=batch_size, max_length=max_length, num_blocks=end - start)
        session = Session(session_id, start, end, batch_size, max_length, self.span.new_caches(start, end))
        self.sessions[session_id] = session
        logger.info(SESSION_OPENED_LOG, session_id[:8], remote, start, end, batch_size, max_length)
        return session

    def _close(self, session: Session) -> None:
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

    async def _guard(self, handle: Callable[[], Awaitable[bytes]]) -> bytes:
        """The one place where exceptions become error responses (frames)."""
        try:
            return await handle()
        except RequestRejected as e:
            self.stats.record_error(e.code.value)
            logger.info("Rejected a request: %s: %s", e.code.value, e)
            return protocol.encode_error(e.code, str(e))
        except (ValueError, TypeError, IndexError) as e:  # undecodable tensors or metadata
            self.stats.record_error(ErrorCode.INVALID.value)
            return protocol.encode_error(ErrorCode.INVALID, f"malformed request: {type(e).__name__}: {e}")
        except Exception as e:
            self.stats.record_error(ErrorCode.INTERNAL.value)
            logger.exception("Request failed")
            return protocol.encode_error(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
