"""`ServerSession`: one inference stream to one server over a hop's blocks; not fault-tolerant (session.py is).

Without push a step is sent and its answer read on the same stream (request, answer). With push the session is opened
at `open()` for server-to-server push (protocol.py), and its answers, asked for or pushed by the server before it,
are read in the background by an AnswerReader and matched to steps by step id (`send`, `answer`).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.p2p import PeerID

from swarmclient.answers import AnswerReader, StreamBroken
from swarmclient.errors import InvalidRequest, NoRoom, PeerFailed, SessionTimeout, Unauthorized
from swarmclient.push_audit import InputClaim
from swarmclient.swarm import Swarm
from swarmnet import protocol
from swarmnet.data_structures import RouteHop

MAX_CLAIMS = 8  # input claims of older steps than the last answer's kept (the client takes each step's at once)
# (the session whose server reported it, step id, downstream peer, reason) -> whether the report was one to expect
PushReport = Callable[["ServerSession", int, str, str], bool]


class ServerSession:
    """One `inference` stream to one server over blocks [hop.start, hop.end); not fault-tolerant.

    `open()` opens the stream; the first `step()` sends the session's open message, then the step (back to back
    when the step is small: see `_open_with`), and reads both answers. Once a step fails midway (a timeout, a
    dropped stream, a refused open), the stream may be out of step with the server, so every later step fails
    too: the caller replaces the session.

    push=True: the session is opened at `open()` for server-to-server push (protocol.py); its answers, asked for or
    pushed by the server before it, are read by an AnswerReader and matched to steps by step id (`send`, `answer`).
    A failed push that the server reports is passed to `on_push_failure`, with this session; one it returns False for
    counts against the server (answers.py).
    """

    def __init__(self, swarm: Swarm, hop: RouteHop, *, batch_size: int, max_length: int, push: bool = False,
                 on_push_failure: PushReport | None = None, background: bool = False) -> None:
        self.swarm, self.hop, self.push = swarm, hop, push
        self.background = background  # a check's session: the server computes it behind inference steps
        self._on_push_failure = on_push_failure or (lambda session, step_id, peer, reason: True)
        self._answers: AnswerReader | None = None
        self.batch_size, self.max_length = batch_size, max_length
        self.session_id = uuid.uuid4().hex
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._failure: str | None = None
        self.lost = False  # the stream ended or broke under us (not a refusal, not a timeout): `reattach` may work
        self._opened = False  # whether the open message went out (it goes with the first step)
        self.steps = 0
        self.last_compute_seconds = 0.0  # the server's own compute time of the last step
        self.last_merged = 1  # how many sessions' steps the server ran in the last step's forward
        self._received_bytes = 0  # answer frames read on this stream outside an AnswerReader
        self._answer_limit = 0  # push: the largest answer expected so far (what a resumed stream may bring again)
        self.claims: dict[int, InputClaim] = {}  # push: step id -> what its answer says of its input
        # the ring (servers/ring.py), set before `open`: a last hop's route from the first hop on, where it pushes the
        # steps it guesses; a first hop's last server, whose guesses it takes
        self.ring_to: list[list[str]] | None = None
        self.ring_from: str | None = None
        self.guessed_steps = 0  # answers to steps the ring guessed (a first hop's)

    async def open(self) -> ServerSession:
        """Open the stream; raises PeerFailed if the server cannot be reached."""
        try:
            await self._connect(self.swarm.config.connect_timeout)
        except Exception as e:
            raise PeerFailed(self.hop.peer_id, f"cannot open a session: {type(e).__name__}: {e}") from e
        await self.swarm.note_path(self.hop.peer_id)
        if self.push:
            await self._open_for_push()
        return self

    async def _connect(self, timeout: float) -> None:
        _, self._reader, self._writer = await asyncio.wait_for(
            self.swarm.p2p.call_binary_stream_handler(PeerID.from_base58(self.hop.peer_id), protocol.RPC_INFERENCE),
            timeout=timeout)

    async def reattach(self, timeout: float, step_id: int) -> int:
        """Resume the session on a new stream to the same server, after its stream was lost during step `step_id`;
        returns the steps the server applied (the caller resends the rest). Raises PeerFailed if the server does not
        resume it (gone, or it freed the session), within `timeout` s.

        With push, a step the server applied already (pushed to it) is not pushed to it again, and its answer went
        to the lost stream: it is asked for again (a message naming the step alone: a duplicate is answered
        uncomputed)."""
        self._drop_stream()
        try:
            async with asyncio.timeout(timeout):
                await self._connect(timeout)
                assert self._reader is not None and self._writer is not None
                protocol.write_frame(self._writer, protocol.encode([], {**self.swarm.auth_meta(), "resume": True,
                                                                        "session_id": self.session_id}))
                await self._writer.drain()
                frame = await protocol.read_frame(self._reader, protocol.OPEN_FRAME_LIMIT)
            meta = protocol.decode(frame)[1]
        except Exception as e:
            self._drop_stream()
            raise PeerFailed(self.hop.peer_id, f"cannot resume the session: {type(e).__name__}: {e}") from e
        applied = meta.get("applied")
        if meta.get("resumed") is not True or not isinstance(applied, int):
            self._drop_stream()
            error = protocol.response_error(meta)
            raise PeerFailed(self.hop.peer_id, "the server did not resume the session: "
                                               f"{error[0].value + ': ' + error[1] if error else meta}")
        self._failure, self.lost, self._opened = None, False, True
        if self.push:
            self._start_answers()
            if applied == step_id + 1:
                assert self._answers is not None and self._writer is not None
                self._answers.expect(step_id, self._answer_limit)
                protocol.write_frame(self._writer, protocol.encode([], {"session_id": self.session_id,
                                                                        "step_id": step_id}))
        return applied

    def _drop_stream(self) -> None:
        """Let the broken stream go (its reader too), keeping the bytes it brought in the count."""
        if self._answers is not None:
            self._answers.close()
            self._received_bytes += self._answers.received_bytes
            self._answers = None
        if self._writer is not None:
            self._writer.close()
        self._reader, self._writer, self._failure = None, None, "closed"

    @property
    def received_bytes(self) -> int:
        """Bytes of the answers this server sent on the session (its outputs travel in its compute dtype)."""
        return self._received_bytes + (self._answers.received_bytes if self._answers is not None else 0)

    async def _open_for_push(self) -> None:
        """Send the open message and wait for its answer (a pushed session gets no first step from the client to go
        with it), then hand the stream's reading to an AnswerReader."""
        self._opened = True
        answer = await self._exchange([self._open_message()], self.swarm.config.connect_timeout,
                                      max_bytes=protocol.OPEN_FRAME_LIMIT)
        if not _opened(answer):
            self._failure = "the server did not open the session"
            await self.close()  # end the stream on the loop now, not whenever the object is collected (off the loop)
            self._output(answer, None)  # raises the refusal
            raise self._broken("the server did not open the session")
        self._start_answers()

    def _start_answers(self) -> None:
        assert self._reader is not None
        self._answers = AnswerReader(self._reader, lambda step_id, peer, reason: self._on_push_failure(
            self, step_id, peer, reason))

    def _open_message(self) -> bytes:
        """The session's first message: its id, blocks and size (what the server reserves), and the caller's keys."""
        return protocol.encode([], {**self.swarm.auth_meta(), "open": True, "session_id": self.session_id,
                                    "start": self.hop.start, "end": self.hop.end, "batch_size": self.batch_size,
                                    "max_length": self.max_length, "resumable": True,
                                    **({"push": True} if self.push else {}),
                                    **({"background": True} if self.background else {}),
                                    **({"ring_to": self.ring_to} if self.ring_to else {}),
                                    **({"ring_from": self.ring_from} if self.ring_from else {})})

    async def step(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                   keep_rows: Sequence[int] | None = None, *, step_id: int | None = None) -> torch.Tensor:
        """Send one step's hidden states; returns the hop's output hidden states.

        keep_rows: first keep only these rows of the session's batch (the step's tensors have len(keep_rows) rows).
        step_id: the step's index in the session (a server applies each id once); required with push.
        """
        if self.push:
            assert step_id is not None, "a push session's steps carry step ids"
            await self.send(hidden, attention_mask, position_ids, keep_rows, step_id=step_id)
            return await self.answer(step_id, hidden.shape)
        if self._failure is not None:
            raise PeerFailed(self.hop.peer_id, f"the session's stream broke earlier ({self._failure})")
        assert self._writer is not None, "open() first"
        frame = protocol.encode([hidden, attention_mask, position_ids], self._step_meta(keep_rows, step_id, None))
        began = time.perf_counter()
        if self._opened:
            frame = await self._exchange([frame], self._timeout(hidden.shape), max_bytes=self._answer_bytes(hidden.shape))
        else:
            frame = await self._open_with(frame, self._timeout(hidden.shape), max_bytes=self._answer_bytes(hidden.shape))
        seconds = time.perf_counter() - began
        output = self._output(frame, hidden.shape)
        if hidden.shape[1] == 1 and not self.background:  # a decode step: what routing holds the server's announced
            # throughput to (a check's step runs behind the server's sessions: it says nothing of their speed)
            self.swarm.observe_step(self.hop.peer_id, self.hop.end - self.hop.start, seconds)
        return output

    def _step_meta(self, keep_rows: Sequence[int] | None, step_id: int | None, route: list[list[str]] | None
                   ) -> dict[str, Any]:
        meta: dict[str, Any] = {"session_id": self.session_id}
        if keep_rows is not None:
            meta["keep_rows"] = list(keep_rows)
        if step_id is not None:
            meta["step_id"] = step_id
        if route:
            meta["route"] = route
        return meta

    def _timeout(self, shape: torch.Size) -> float:
        config = self.swarm.config
        return config.step_timeout + config.step_timeout_per_token * shape[0] * shape[1]

    @staticmethod
    def _answer_bytes(shape: torch.Size) -> int:
        return shape[0] * shape[1] * shape[2] * 4 + (1 << 16)

    async def send(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                   keep_rows: Sequence[int] | None, *, step_id: int, route: list[list[str]] | None = None) -> None:
        """Push mode: send a step without waiting for its answer; `route` ([peer id, session id] of the next hops)
        has the server push its outputs on."""
        if self._answers is not None and self._answers.broken is not None:
            self.lost = self._answers.lost
        if self._failure is not None or self._answers is None or self._answers.broken is not None:
            raise PeerFailed(self.hop.peer_id, f"the session's stream broke earlier ({self._failure or 'closed'})")
        assert self._writer is not None
        self.expect(hidden.shape, step_id)
        protocol.write_frame(self._writer, protocol.encode([hidden, attention_mask, position_ids],
                                                           self._step_meta(keep_rows, step_id, route)))
        try:
            await self._writer.drain()
        except Exception as e:
            self.lost = isinstance(e, ConnectionError)
            raise self._broken(f"{type(e).__name__}: {e}") from e

    def expect(self, shape: torch.Size, step_id: int) -> None:
        """Push mode: an answer of this shape to step `step_id` may come (pushed steps come unasked)."""
        self._answer_limit = max(self._answer_limit, self._answer_bytes(shape))
        if self._answers is not None:
            self._answers.expect(step_id, self._answer_limit)

    async def answer(self, step_id: int, shape: torch.Size) -> torch.Tensor:
        """Push mode: this hop's output of step `step_id` (sent by the client or pushed by the server before)."""
        if self._answers is None:
            raise PeerFailed(self.hop.peer_id, f"the session's stream broke earlier ({self._failure or 'closed'})")
        try:
            _, frame_meta = answer = await self._answers.answer(step_id, self._timeout(shape))
        except TimeoutError as e:
            self._failure = "timeout"
            raise SessionTimeout(self.hop.peer_id, f"no answer to step {step_id} in {self._timeout(shape):.0f} s") from e
        except StreamBroken as e:
            self.lost = self._answers.lost
            raise self._broken(str(e)) from e
        return self._decoded_output(answer, shape)

    def fail_step(self, step_id: int, error: BaseException) -> None:
        """Push mode: stop waiting for step `step_id` (its upstream server reported that the push failed)."""
        if self._answers is not None:
            self._answers.fail(step_id, error)

    def _output(self, frame: bytes, shape: torch.Size | None) -> torch.Tensor:
        """A step's output from its answer frame; raises the server's refusal as the matching error."""
        try:
            answer = protocol.decode(frame)
        except ValueError as e:
            raise self._broken(f"an undecodable answer: {e}") from e
        return self._decoded_output(answer, shape)

    def _decoded_output(self, answer: tuple[list[torch.Tensor], dict[str, Any]], shape: torch.Size | None
                        ) -> torch.Tensor:
        tensors, meta = answer
        error = protocol.response_error(meta)
        if error is not None:
            code, message = error
            if code.retryable:
                raise failure_class(code)(self.hop.peer_id, f"{code.value}: {message}")
            raise InvalidRequest(f"server {self.hop.peer_id[-8:]} refused the step: {code.value}: {message}")
        if shape is None or len(tensors) != 1 or tensors[0].shape != shape:
            raise self._broken(f"an answer of shapes {[tuple(t.shape) for t in tensors]} to a "
                               f"{tuple(shape) if shape is not None else 'open'} message")
        self.steps += 1
        step_id = meta.get("step_id")
        if self.push and isinstance(step_id, int):  # what the server says it computed on (push_audit.py)
            self.claims[step_id] = InputClaim(meta.get("input_digest"), meta.get("push_proof"))
            for old in [s for s in self.claims if s < step_id - MAX_CLAIMS]:
                del self.claims[old]
        self.last_compute_seconds = float(meta.get("compute_ms", 0.0)) / 1000
        self.guessed_steps += meta.get("guess") is True
        self.last_merged = int(meta.get("merged", 1))
        return tensors[0]

    async def _open_with(self, step: bytes, timeout: float, *, max_bytes: int) -> bytes:
        """Open the session, then send its first step; the step's answer, or the answer refusing the open.

        A step that the server would read before a session exists (OPEN_FRAME_LIMIT) goes right behind the open
        message, unanswered yet (pipelined: no round trip); a bigger one waits for the open's answer, so that a
        refused open never leaves bytes in flight that the server will not read (it would end the stream, and
        p2pd's reset would lose its answer).
        """
        self._opened = True
        pipelined = len(step) <= protocol.OPEN_FRAME_LIMIT
        answer = await self._exchange([self._open_message(), step] if pipelined else [self._open_message()], timeout,
                                      max_bytes=protocol.OPEN_FRAME_LIMIT)
        if not _opened(answer):  # its refusal stands for the step's answer; the stream is out of step from now on
            self._failure = "the server did not open the session"
            await self.close()  # end the stream on the loop now, not whenever the object is collected (off the loop)
            return answer
        return await self._exchange([] if pipelined else [step], timeout, max_bytes=max_bytes)

    async def _exchange(self, frames: list[bytes], timeout: float, *, max_bytes: int) -> bytes:
        """Write the messages at once, then read one answer; any failure breaks the session for good."""
        assert self._reader is not None and self._writer is not None
        try:
            async with asyncio.timeout(timeout):  # no extra task per step, unlike wait_for
                if frames:
                    protocol.write_frames(self._writer, frames)
                    await self._writer.drain()
                frame = await protocol.read_frame(self._reader, max_bytes)
                self._received_bytes += len(frame)
                return frame
        except TimeoutError as e:
            self._failure = "timeout"
            raise SessionTimeout(self.hop.peer_id, f"no answer in {timeout:.0f} s") from e
        except asyncio.IncompleteReadError as e:
            self.lost = True
            raise self._broken("the stream closed (server gone)") from e
        except BaseException as e:  # cancelled midway, connection reset, oversized answer
            self._failure, self.lost = type(e).__name__, isinstance(e, ConnectionError)
            if isinstance(e, Exception):
                raise PeerFailed(self.hop.peer_id, f"{type(e).__name__}: {e}") from e
            raise

    def _broken(self, reason: str) -> PeerFailed:
        self._failure = reason
        return PeerFailed(self.hop.peer_id, reason)

    async def close(self) -> None:
        """Free the session on the server, then end the stream.

        The server answers a `close` message once the session's cache is back in its budget, so a session opened
        right after this returns finds the room. A stream that never opened a session, or broke earlier, is only
        ended (the server frees a session when it sees the end); a server that does not answer within
        `close_timeout` is left to do the same.
        """
        if self._writer is None:
            return
        if self._answers is not None:  # it waits for the next message's length: nothing of one is lost
            await self._answers.stop()  # (a reader two coroutines wait on refuses the second)
        writer, reader, self._writer = self._writer, self._reader, None
        in_sync, self._failure = self._failure is None and self._opened, "closed"  # a broken stream may be mid-message
        try:
            if in_sync:
                assert reader is not None
                async with asyncio.timeout(self.swarm.config.close_timeout):
                    protocol.write_frame(writer, protocol.encode([], {"session_id": self.session_id, "close": True}))
                    await writer.drain()
                    await protocol.read_frame(reader, protocol.OPEN_FRAME_LIMIT)
        except Exception:  # the server may already be gone: nothing left to free
            pass
        finally:
            writer.close()


def failure_class(code: protocol.ErrorCode) -> type[PeerFailed]:
    """The PeerFailed a retryable refusal stands for: no member, no room now, or a plain failure."""
    if code is protocol.ErrorCode.UNAUTHORIZED:
        return Unauthorized
    if code in (protocol.ErrorCode.CACHE_FULL, protocol.ErrorCode.BUSY):
        return NoRoom
    return PeerFailed


def _opened(answer: bytes) -> bool:
    """Whether an answer to an open message says the session is open."""
    try:
        return protocol.decode(answer)[1].get("opened") is True
    except ValueError:
        return False


def close_in_background(session: ServerSession, pending: set[asyncio.Future[None]]) -> None:
    """Close `session` without waiting for it; `pending` holds the closing task until it is done (the event loop keeps
    only weak references to tasks)."""
    task = asyncio.ensure_future(session.close())
    pending.add(task)
    task.add_done_callback(pending.discard)
