"""The stream machinery of a block server: reading bounded frames, answering each message once, ending streams.

`StreamService` serves raw streams of length-prefixed frames (swarmnet/protocol.py):
- a message's length is checked before it is read (`_receive`, with the limit its caller gives); an oversized one
  gets an `invalid_request` answer and ends the stream;
- a caller (peer id) has at most `max_streams_per_peer` streams open at once: one more is answered `busy` at once
  and ended, unread;
- a stream's first message is authorized (`authorize`, in `_read`, the one place) before anything else is done,
  and a refused one ends the stream; a stranger's refusals are logged once per peer (MAX_LOGGED_STRANGERS), with
  what the caller sent escaped (%r). `authorize` names the stream's owner (the member it acts for), which
  per-caller limits count by; when the swarm file's members change, each message re-checks that its owner is still
  one (`_recheck`), and a removed member's stream is refused and ended at its next message;
- a stream is closed `session_timeout` after its last accepted message (refused ones and repeated steps do not keep
  it alive), after MAX_REFUSED_BEFORE_OPEN refused messages in a row before a session exists, and after a refusal
  that ends it (`RequestRejected.ends_stream`: a step repeated too often);
- every exception becomes an in-band error answer in one place (`_answer`), so a bad request never stops the server
  or the stream it came on.
"""
from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from servers.counters import ServerCounters
from servers.errors import RequestRejected
from servers.sessions import Session, Stream, StreamOver
from swarmnet import protocol
from swarmnet.membership import Membership
from swarmnet.protocol import ErrorCode

logger = logging.getLogger(__name__)
MAX_REFUSED_BEFORE_OPEN = 8  # refused messages in a row after which a stream without a session is ended
LINGER_SECONDS = 3.0  # how long a stream the server ends waits for the caller to close it first (`let_go`)
LINGER_BYTES = 1 << 16  # the most it reads (and drops) meanwhile
MAX_LOGGED_STRANGERS = 1000  # refused callers logged by peer id (one line each); later ones are logged at DEBUG

# (caller's peer id, its first message's meta) -> the owner it acts for; raises RequestRejected(UNAUTHORIZED)
Authorize = Callable[[str, dict[str, Any]], str]
StreamServer = Callable[[Stream, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def allow_everyone(caller: str, meta: dict[str, Any]) -> str:
    """The default `authorize`: every caller may use the server, on its own account."""
    return caller


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


class StreamService(ABC):
    """Serves streams of frames: bounded reads, authorization of the first message, one answer per message."""

    session_timeout: float
    authorize: Authorize
    membership: Membership  # whose changes make open streams re-check their owner (the one `authorize` checks by)
    max_streams_per_peer: int
    streams_by_peer: Counter[str]  # streams open now, per caller
    stats: ServerCounters
    refused_strangers: set[str]  # callers refused as no member, already logged once

    @abstractmethod
    def _stream_ended(self, stream: Stream, session: Session) -> None:
        """Free, or detach, the session of a stream that ended (the handler's)."""

    async def _serve(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     serve: StreamServer) -> None:
        stream = Stream(peer=str(info.peer_id), timeout=self.session_timeout, writer=writer)
        if self.streams_by_peer[stream.peer] >= self.max_streams_per_peer:  # answered, then let go: nothing is read
            protocol.write_frame(writer, self._error(ErrorCode.BUSY, f"this caller already has "
                                                     f"{self.max_streams_per_peer} streams open here, the most one "
                                                     "caller may have; close one")[0])
            logger.debug("Refused a stream of %s: %d open", stream.peer[-8:], self.max_streams_per_peer)
            await let_go(reader, writer)
            return
        self.streams_by_peer[stream.peer] += 1
        try:
            await serve(stream, reader, writer)
        except StreamOver:
            pass
        except ConnectionError:  # the caller went away while we computed
            stream.lost = True
        finally:
            self.streams_by_peer[stream.peer] -= 1
            if not self.streams_by_peer[stream.peer]:
                del self.streams_by_peer[stream.peer]
            if stream.session is not None:
                self._stream_ended(stream, stream.session)
            await let_go(reader, writer)

    def _end_stream(self, stream: Stream, code: ErrorCode, message: str) -> None:
        """End a stream from the server's side now, with an error answer saying why: its read fails at once, and its
        session (if any) is freed as on a client's hang-up. The client routes around this server."""
        if stream.writer is None or stream.writer.is_closing():
            return
        stream.ended = True  # its session is freed, never detached
        self.stats.record_error(code.value)
        protocol.write_frame(stream.writer, protocol.encode_error(code, message))
        stream.writer.close()

    async def _receive(self, stream: Stream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       limit: int) -> bytes:
        """The stream's next message, of at most `limit` bytes; raises StreamOver when there is none to answer."""
        try:
            async with asyncio.timeout_at(stream.deadline):  # no extra task per step, unlike wait_for
                return await protocol.read_frame(reader, limit)
        except (asyncio.IncompleteReadError, ConnectionError):
            stream.lost = True
            raise StreamOver from None  # the caller ended the stream (or died, or a relay reset it)
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
        stream.step_id, stream.repeated = None, False
        answer, error = await self._answer(handle, stream)
        if error is None:
            if not stream.repeated:  # a repeated step is answered, but keeps nothing alive
                stream.accepted()
        else:
            if stream.step_id is not None:  # a push client files answers by step id (swarmclient/answers.py)
                answer = protocol.encode([], {**protocol.decode_meta(answer), "step_id": stream.step_id})
            stream.refused += 1
            if error is ErrorCode.UNAUTHORIZED and not stream.authorized:  # nothing it sends next can pass either
                stream.ended = True
            elif stream.session is None and stream.refused >= MAX_REFUSED_BEFORE_OPEN:
                logger.info("Ending the stream of %s after %d refused messages (last: %s)", stream.peer[-6:],
                            stream.refused, error.value)
                stream.ended = True
        protocol.write_frame(writer, answer)
        await writer.drain()

    def _read(self, frame: bytes, stream: Stream) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """Decode a message. A stream's first message is authorized here, the one place, before anything is done
        with it; until one passes, each message is taken for the first (and refused like it)."""
        if stream.authorized:
            self._recheck(stream)
        tensors, meta = protocol.decode(frame)
        if not stream.authorized:
            stream.owner = self.authorize(stream.peer, meta)
            stream.authorized, stream.generation = True, self.membership.generation
        return tensors, meta

    def _recheck(self, stream: Stream) -> None:
        """Refuse, and end, an authorized stream whose owner the swarm file no longer lists (checked only when the
        members changed since the stream's last check: an integer comparison per message otherwise)."""
        if not self._still_member(stream):
            raise RequestRejected(ErrorCode.UNAUTHORIZED, f"{stream.owner} is no longer a member of this server's "
                                  "swarm (removed from its swarm file): its streams are ended", ends_stream=True)

    def _still_member(self, stream: Stream) -> bool:
        generation = self.membership.generation
        if generation == stream.generation:
            return True
        if not self.membership.allows(stream.owner):
            return False
        stream.generation = generation
        return True

    async def _answer(self, handle: Callable[[], Awaitable[bytes]], stream: Stream) -> tuple[bytes, ErrorCode | None]:
        """The one place where exceptions become error responses: (the answer, the error code if refused)."""
        try:
            return await handle(), None
        except StreamOver:
            raise
        except RequestRejected as e:
            self._log_refusal(stream, e)
            stream.ended = stream.ended or e.ends_stream
            return self._error(e.code, str(e))
        except (ValueError, TypeError, IndexError) as e:  # undecodable tensors or metadata
            return self._error(ErrorCode.INVALID, f"malformed request: {type(e).__name__}: {e}")
        except Exception as e:
            logger.exception("Request failed")
            return self._error(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")

    def _log_refusal(self, stream: Stream, refusal: RequestRejected) -> None:
        """One line per refusal, what the caller sent escaped; a stranger (refused before authorization) once."""
        stranger = refusal.code is ErrorCode.UNAUTHORIZED and not stream.authorized
        if stranger and (stream.peer in self.refused_strangers or len(self.refused_strangers) >= MAX_LOGGED_STRANGERS):
            logger.debug("Refused %s again: %r", stream.peer[-8:], str(refusal))
            return
        if stranger:
            self.refused_strangers.add(stream.peer)
        logger.info("Refused a request of %s: %s: %r", stream.peer[-8:], refusal.code.value, str(refusal))

    def _error(self, code: ErrorCode, message: str) -> tuple[bytes, ErrorCode]:
        self.stats.record_error(code.value)
        return protocol.encode_error(code, message), code
