"""Inference sessions: `ServerSession` is one stream to one server; `InferenceSession` a fault-tolerant chain.

An InferenceSession keeps its history as one `StepRecord` per completed step: the hidden states it sent to
each block boundary of its route, the positions, the rows kept and the mask columns the step added. When a
server fails, the client bans it, routes the failed hop's blocks through other servers, and replays those
records in order (same shapes, same inputs), so the replacement caches are the same as the lost ones and the
generation goes on with identical tokens. A step may keep only some rows of the batch (`keep_rows`: finished
requests leave the session); its record says so, and a replay drops the same rows.

With `verify_fraction` > 0, a sampled fraction of hop steps is checked: the records give the hop's whole input
history, which a second holder of its blocks recomputes (`verifier`). A server found lying is banned for the rest
of the process and its hop replayed through others, like a failed one.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.p2p import PeerID

from swarmclient import protocol
from swarmclient.answers import AnswerReader, PushFailure, StreamBroken
from swarmclient.data_structures import RouteHop
from swarmclient.errors import InvalidRequest, PeerFailed, PushReported, SessionTimeout, Unauthorized, WrongOutput
from swarmclient.retry import with_retries
from swarmclient.swarm import Swarm
from swarmclient.verification import Verdict, VerificationTally, sampled, stack_history
from swarmclient.verifier import HopCheck, HopVerifier

logger = logging.getLogger(__name__)


class ServerSession:
    """One `inference` stream to one server over blocks [hop.start, hop.end); not fault-tolerant.

    `open()` opens the stream; the first `step()` sends the session's open message, then the step (back to back
    when the step is small: see `_open_with`), and reads both answers. Once a step fails midway (a timeout, a
    dropped stream, a refused open), the stream may be out of step with the server, so every later step fails
    too: the caller replaces the session.

    push=True: the session is opened at `open()` for server-to-server push (protocol.py); its answers, asked for or
    pushed by the server before it, are read by an AnswerReader and matched to steps by step id (`send`, `answer`).
    A failed push that the server reports is passed to `on_push_failure`.
    """

    def __init__(self, swarm: Swarm, hop: RouteHop, *, batch_size: int, max_length: int, push: bool = False,
                 on_push_failure: PushFailure | None = None) -> None:
        self.swarm, self.hop, self.push = swarm, hop, push
        self._on_push_failure = on_push_failure or (lambda step_id, peer, reason: None)
        self._answers: AnswerReader | None = None
        self.batch_size, self.max_length = batch_size, max_length
        self.session_id = uuid.uuid4().hex
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._failure: str | None = None
        self._opened = False  # whether the open message went out (it goes with the first step)
        self.steps = 0
        self.last_compute_seconds = 0.0  # the server's own compute time of the last step
        self.last_merged = 1  # how many sessions' steps the server ran in the last step's forward

    async def open(self) -> ServerSession:
        """Open the stream; raises PeerFailed if the server cannot be reached."""
        try:
            _, self._reader, self._writer = await asyncio.wait_for(
                self.swarm.p2p.call_binary_stream_handler(PeerID.from_base58(self.hop.peer_id), protocol.RPC_INFERENCE),
                timeout=self.swarm.config.connect_timeout)
        except Exception as e:
            raise PeerFailed(self.hop.peer_id, f"cannot open a session: {type(e).__name__}: {e}") from e
        if self.push:
            await self._open_for_push()
        return self

    async def _open_for_push(self) -> None:
        """Send the open message and wait for its answer (a pushed session gets no first step from the client to go
        with it), then hand the stream's reading to an AnswerReader."""
        self._opened = True
        answer = await self._exchange([self._open_message()], self.swarm.config.connect_timeout,
                                      max_bytes=protocol.OPEN_FRAME_LIMIT)
        if not _opened(answer):
            self._failure = "the server did not open the session"
            self._output(answer, None)  # raises the refusal
            raise self._broken("the server did not open the session")
        assert self._reader is not None
        self._answers = AnswerReader(self._reader, self._on_push_failure)

    def _open_message(self) -> bytes:
        """The session's first message: its id, blocks and size (what the server reserves), and the caller's keys."""
        return protocol.encode([], {**self.swarm.auth_meta(), "open": True, "session_id": self.session_id,
                                    "start": self.hop.start, "end": self.hop.end, "batch_size": self.batch_size,
                                    "max_length": self.max_length, **({"push": True} if self.push else {})})

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
        if hidden.shape[1] == 1:  # a decode step: what routing holds the server's announced throughput to
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
        if self._failure is not None or self._answers is None or self._answers.broken is not None:
            raise PeerFailed(self.hop.peer_id, f"the session's stream broke earlier ({self._failure or 'closed'})")
        assert self._writer is not None
        self.expect(hidden.shape)
        protocol.write_frame(self._writer, protocol.encode([hidden, attention_mask, position_ids],
                                                           self._step_meta(keep_rows, step_id, route)))
        try:
            await self._writer.drain()
        except Exception as e:
            raise self._broken(f"{type(e).__name__}: {e}") from e

    def expect(self, shape: torch.Size) -> None:
        """Push mode: an answer of this shape may come (pushed steps come unasked)."""
        if self._answers is not None:
            self._answers.expect(self._answer_bytes(shape))

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
                raise (Unauthorized if code is protocol.ErrorCode.UNAUTHORIZED else PeerFailed)(
                    self.hop.peer_id, f"{code.value}: {message}")
            raise InvalidRequest(f"server {self.hop.peer_id[-8:]} refused the step: {code.value}: {message}")
        if shape is None or len(tensors) != 1 or tensors[0].shape != shape:
            raise self._broken(f"an answer of shapes {[tuple(t.shape) for t in tensors]} to a "
                               f"{tuple(shape) if shape is not None else 'open'} message")
        self.steps += 1
        self.last_compute_seconds = float(meta.get("compute_ms", 0.0)) / 1000
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
                return await protocol.read_frame(self._reader, max_bytes)
        except TimeoutError as e:
            self._failure = "timeout"
            raise SessionTimeout(self.hop.peer_id, f"no answer in {timeout:.0f} s") from e
        except asyncio.IncompleteReadError as e:
            raise self._broken("the stream closed (server gone)") from e
        except BaseException as e:  # cancelled midway, connection reset, oversized answer
            self._failure = type(e).__name__
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
            self._answers.close()
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


def _opened(answer: bytes) -> bool:
    """Whether an answer to an open message says the session is open."""
    try:
        return protocol.decode(answer)[1].get("opened") is True
    except ValueError:
        return False


@dataclass(frozen=True, eq=False)
class StepRecord:
    """One completed step of an InferenceSession: what a replay sends a replacement server again, in order."""

    inputs: dict[int, torch.Tensor]  # block index where a hop starts -> the hidden states sent to that hop
    position_ids: torch.Tensor
    keep_rows: tuple[int, ...] | None  # the rows the step kept first (None: all of them)
    # the attention mask's columns this step added; a step that starts a row set (the first step, or one with
    # keep_rows) holds its whole mask. Within a row set each step's mask extends the previous one, so the
    # columns rebuild every step's mask without keeping one full mask per step (quadratic in the length).
    mask_columns: torch.Tensor
    length: int  # tokens processed after this step (prompt included)

    @classmethod
    def of(cls, inputs: dict[int, torch.Tensor], attention_mask: torch.Tensor, position_ids: torch.Tensor,
           keep_rows: Sequence[int] | None, *, past: int) -> StepRecord:
        """The record of a step sent with this mask after `past` tokens."""
        if keep_rows is not None or past == 0:
            columns = attention_mask
        else:  # a copy: a view would keep the caller's whole mask alive
            columns = attention_mask[:, past:].clone()
        return cls(inputs, position_ids, None if keep_rows is None else tuple(keep_rows), columns,
                   attention_mask.shape[1])


def step_masks(history: Sequence[StepRecord]) -> Iterator[torch.Tensor]:
    """Each step's whole attention mask, rebuilt from the columns the steps added."""
    mask: torch.Tensor | None = None
    for record in history:
        if mask is None or record.keep_rows is not None:  # a row set starts: the record holds its whole mask
            mask = record.mask_columns
        else:
            mask = torch.cat([mask, record.mask_columns], dim=1)
        yield mask


class InferenceSession:
    """A chain of server sessions covering blocks [0, num_blocks) that survives server failures."""

    def __init__(self, swarm: Swarm, *, batch_size: int, max_length: int,
                 verification: VerificationTally | None = None) -> None:
        self.swarm, self.batch_size, self.max_length = swarm, batch_size, max_length
        self.verification = verification or VerificationTally()  # checked outputs: counts, shared by a job's lanes
        self._verifier = HopVerifier(swarm, self.verification, uuid.uuid4().hex)
        self._open_batch_size = batch_size               # a (replacement) server session opens with it, then replays
        self._sessions: dict[int, ServerSession] = {}   # hop start -> live session
        self._closing: set[asyncio.Future[None]] = set()  # sessions being closed in the background
        self._broken: set[int] = set()                   # hop starts whose server failed
        self._history: list[StepRecord] = []             # every completed step, in order: what a replay sends
        self.failovers = 0

    @property
    def position(self) -> int:
        """Tokens processed so far (prompt included)."""
        return self._history[-1].length if self._history else 0

    @property
    def last_compute_seconds(self) -> float:
        """The servers' own compute time of the last step, summed over the route (the rest was network and waits)."""
        return sum(session.last_compute_seconds for session in self._sessions.values())

    @property
    def route(self) -> list[RouteHop]:
        """The current hops, in block order."""
        return [self._sessions[start].hop for start in sorted(self._sessions)]

    # ---- sync facade (runs on the swarm's event loop) ---------------------------------------------------
    def __enter__(self) -> InferenceSession:
        self.swarm.loop.run(self.open())
        return self

    def __exit__(self, *exc: object) -> None:
        self.swarm.loop.run(self.close())

    def step(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             keep_rows: list[int] | None = None) -> torch.Tensor:
        """Run one step (a prefill of T tokens or a decode token) through all blocks; returns final hidden states.

        keep_rows: first drop every other row of the session's batch (sorted, unique indices of the current
        rows); the step's tensors then have len(keep_rows) rows, and so has the session from then on.
        """
        return self.swarm.loop.run(self.astep(hidden, attention_mask, position_ids, keep_rows))

    # ---- async core -----------------------------------------------------------------------------------
    async def open(self) -> None:
        """Find a route and open a session with each of its servers."""
        await with_retries(lambda: self._open_range(0, self.swarm.num_blocks), config=self.swarm.config,
                           on_failure=self._on_failure)

    async def close(self) -> None:
        """Close every server session."""
        await asyncio.gather(*(s.close() for s in self._sessions.values()), return_exceptions=True)
        self._sessions.clear()

    async def astep(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    keep_rows: list[int] | None = None) -> torch.Tensor:
        """Async `step`."""
        keep_rows = self._check_keep_rows(keep_rows)
        self._check_step(hidden, attention_mask, position_ids,
                         self.batch_size if keep_rows is None else len(keep_rows))
        hidden = hidden.float().contiguous()
        attention_mask, position_ids = attention_mask.long(), position_ids.long()
        if self.swarm.config.push:
            return await self._astep_pushed(hidden, attention_mask, position_ids, keep_rows)
        inputs: dict[int, torch.Tensor] = {}
        position = 0
        while position < self.swarm.num_blocks:
            hidden_in = hidden
            hidden, position_next = await with_retries(
                lambda: self._step_hop(position, hidden_in, attention_mask, position_ids, keep_rows),  # noqa: B023 - awaited now
                config=self.swarm.config, on_failure=self._on_failure)
            inputs[position] = hidden_in
            position = position_next
        self._record(inputs, attention_mask, position_ids, keep_rows)
        return hidden

    def _record(self, inputs: dict[int, torch.Tensor], attention_mask: torch.Tensor, position_ids: torch.Tensor,
                keep_rows: list[int] | None) -> None:
        """Add a completed step to the history that a replay feeds a replacement server."""
        self._history.append(StepRecord.of(inputs, attention_mask, position_ids, keep_rows, past=self.position))
        if keep_rows is not None:
            self.batch_size = len(keep_rows)

    def _check_keep_rows(self, keep_rows: list[int] | None) -> list[int] | None:
        if keep_rows is None:
            return None
        rows = [int(i) for i in keep_rows]
        if not rows or rows != sorted(set(rows)) or rows[0] < 0 or rows[-1] >= self.batch_size:
            raise InvalidRequest(f"keep_rows must be sorted unique row indices in [0, {self.batch_size}), "
                                 f"got {rows[:16]}")
        return rows

    def _check_step(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    batch_size: int) -> None:
        batch, length = hidden.shape[0], hidden.shape[1]
        if batch != batch_size or attention_mask.shape != (batch, self.position + length) or \
                position_ids.shape != (batch, length):
            raise InvalidRequest(
                f"step shapes do not fit the session: hidden {tuple(hidden.shape)}, mask {tuple(attention_mask.shape)},"
                f" positions {tuple(position_ids.shape)} at position {self.position} with batch {batch_size}")
        if attention_mask.shape[1] > self.max_length:
            raise InvalidRequest(f"the session is {self.max_length} tokens long; step would reach "
                                 f"{attention_mask.shape[1]}")

    async def _step_hop(self, position: int, hidden: torch.Tensor, attention_mask: torch.Tensor,
                        position_ids: torch.Tensor, keep_rows: list[int] | None) -> tuple[torch.Tensor, int]:
        if position in self._broken or self.swarm.bans.banned_for_good(self._sessions[position].hop.peer_id):
            await self._repair(position)
        session = self._sessions[position]
        try:
            output = await session.step(hidden, attention_mask, position_ids, keep_rows, step_id=len(self._history))
        except PeerFailed:
            self._broken.add(position)
            raise
        if sampled(self.swarm.config.verify_fraction, self._verifier.key, len(self._history), position):
            await self._check(session.hop, hidden, attention_mask, position_ids, keep_rows, output)
        self.swarm.bans.forgive(session.hop.peer_id)
        return output, session.hop.end

    async def _check(self, hop: RouteHop, hidden: torch.Tensor, attention_mask: torch.Tensor,
                     position_ids: torch.Tensor, keep_rows: list[int] | None, output: torch.Tensor) -> None:
        """Have another holder recompute this hop step; raises WrongOutput if the hop's server is found lying."""
        history = [(record.inputs[hop.start], record.position_ids, record.keep_rows) for record in self._history]
        whole, positions = stack_history([*history, (hidden, position_ids, None if keep_rows is None else tuple(keep_rows))])
        verdict = await self._verifier.check(HopCheck(hop, whole, attention_mask, positions, output), len(self._history))
        if verdict is Verdict.CHECKED_FAULTY:
            self._broken.add(hop.start)
            raise WrongOutput(hop.peer_id, "its output differs from other servers' (banned for good)")

    # ---- push: the client sends a step to the first hop only; each server pushes its outputs to the next -------------
    async def _astep_pushed(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                            keep_rows: list[int] | None) -> torch.Tensor:
        """`astep` with server-to-server push. Every hop's outputs still come back (its answer), so the history
        records each hop's inputs as without push: a failover replays them and a check recomputes them."""
        step_id = len(self._history)
        boundaries: dict[int, torch.Tensor] = {0: hidden}  # block index -> this step's hidden states there
        await with_retries(lambda: self._push_attempt(step_id, boundaries, attention_mask, position_ids, keep_rows),
                           config=self.swarm.config, on_failure=self._on_failure)
        self._record({hop.start: boundaries[hop.start] for hop in self.route}, attention_mask, position_ids, keep_rows)
        return boundaries[self.swarm.num_blocks]

    async def _push_attempt(self, step_id: int, boundaries: dict[int, torch.Tensor], attention_mask: torch.Tensor,
                            position_ids: torch.Tensor, keep_rows: list[int] | None) -> None:
        """Repair broken hops, then send the step to the first hop whose outputs are missing, with the route on."""
        for start in sorted(self._sessions):
            session = self._sessions.get(start)
            if session is not None and (start in self._broken or self.swarm.bans.banned_for_good(session.hop.peer_id)):
                await self._repair(start)  # the replacement has not run this step: its outputs and later ones go
                for block in [b for b in boundaries if session.hop.start < b <= session.hop.end]:
                    del boundaries[block]
        hops = self.route
        first = next(i for i, hop in enumerate(hops) if hop.end not in boundaries)
        pending = hops[first:]
        shape = boundaries[0].shape
        for hop in pending:
            self._sessions[hop.start].expect(shape)
        head = self._sessions[pending[0].start]
        sent = time.perf_counter()
        try:
            await head.send(boundaries[pending[0].start], attention_mask, position_ids, keep_rows, step_id=step_id,
                            route=[[hop.peer_id, self._sessions[hop.start].session_id] for hop in pending[1:]])
        except PeerFailed:
            self._broken.add(head.hop.start)
            raise
        arrivals = await self._collect(step_id, pending, boundaries, shape)
        if shape[1] == 1:  # a decode step: each hop's time, from its input's arrival to its answer (network included)
            for hop, began, ended in zip(pending, [sent, *arrivals], arrivals, strict=False):
                if ended > began:  # answers travel separately: one may overtake the one before it
                    self.swarm.observe_step(hop.peer_id, hop.end - hop.start, ended - began)
        for hop in pending:
            if sampled(self.swarm.config.verify_fraction, self._verifier.key, step_id, hop.start):
                await self._check_pushed(hop, boundaries, attention_mask, position_ids, keep_rows)
            self.swarm.bans.forgive(hop.peer_id)

    async def _collect(self, step_id: int, hops: list[RouteHop], boundaries: dict[int, torch.Tensor],
                       shape: torch.Size) -> list[float]:
        """Wait for each hop's outputs of the step; the first failure stops the wait (a reported push included).
        Returns when each hop's answer came (perf_counter), in route order."""
        waits = {asyncio.ensure_future(self._sessions[hop.start].answer(step_id, shape)): hop for hop in hops}
        arrived: dict[int, float] = {}
        try:
            while waits:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    hop = waits.pop(task)
                    try:
                        boundaries[hop.end] = task.result()
                        arrived[hop.start] = time.perf_counter()
                    except PushReported:
                        raise
                    except PeerFailed:
                        self._broken.add(hop.start)
                        raise
        finally:
            for task in waits:
                task.cancel()
        return [arrived[hop.start] for hop in hops]

    def _push_failed(self, step_id: int, peer_id: str, reason: str) -> None:
        """A server reports that it could not push step `step_id` to `peer_id`: stop waiting for that server."""
        for session in self._sessions.values():
            if session.hop.peer_id == peer_id:
                session.fail_step(step_id, PushReported(peer_id, f"the server before it could not push: {reason}"))

    async def _check_pushed(self, hop: RouteHop, boundaries: dict[int, torch.Tensor], attention_mask: torch.Tensor,
                            position_ids: torch.Tensor, keep_rows: list[int] | None) -> None:
        """A sampled hop's check; found lying, its outputs and every later hop's (computed from them) are redone."""
        try:
            await self._check(hop, boundaries[hop.start], attention_mask, position_ids, keep_rows, boundaries[hop.end])
        except WrongOutput:
            for later in self.route:
                if later.start >= hop.start:
                    self._broken.add(later.start)
            for block in [b for b in boundaries if b > hop.start]:
                del boundaries[block]
            raise

    async def _on_failure(self, exc: BaseException) -> None:
        if isinstance(exc, PushReported):  # not its fault yet: the step goes to it directly next
            logger.info("Server %s: %s; sending the step to it directly", exc.peer_id[-8:], exc.reason)
            return
        if isinstance(exc, PeerFailed) and not isinstance(exc, WrongOutput):  # the verifier banned it for good
            duration = self.swarm.ban(exc)
            logger.warning("Server %s failed (%s); banned for %.0f s, routing around it",
                           exc.peer_id[-8:], exc.reason, duration)

    async def _repair(self, position: int) -> None:
        """Replace the failed hop starting at `position` with a new route, and replay its history."""
        failed = self._sessions.pop(position)
        self._close_later(failed)
        self._broken.discard(position)
        hops: list[RouteHop] = []
        try:
            hops = await self._open_range(failed.hop.start, failed.hop.end)
            await self._replay(hops)
        except BaseException:
            # drop the half-made replacement; the range stays broken so the next attempt repairs it again
            for hop in hops:
                self._close_later(self._sessions.pop(hop.start))
            self._sessions[position] = failed
            self._broken.add(position)
            raise
        self.failovers += 1

    def _close_later(self, session: ServerSession) -> None:
        """Close a session in the background (the loop keeps only weak references to tasks: hold it here)."""
        task = asyncio.ensure_future(session.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _open_range(self, start: int, end: int) -> list[RouteHop]:
        hops = await self.swarm.route(start, end, session_tokens=self._open_batch_size * self.max_length)
        sessions = [ServerSession(self.swarm, hop, batch_size=self._open_batch_size, max_length=self.max_length,
                                  push=self.swarm.config.push, on_push_failure=self._push_failed) for hop in hops]
        opened = await asyncio.gather(*(s.open() for s in sessions), return_exceptions=True)
        failure = next((r for r in opened if isinstance(r, BaseException)), None)
        if failure is not None:
            await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
            raise failure
        for session in sessions:
            self._sessions[session.hop.start] = session
        return hops

    async def _replay(self, hops: list[RouteHop]) -> None:
        """Feed the new hops every past step's inputs, in order, so their caches match the lost ones."""
        replayed: list[StepRecord] = []
        for step_id, (record, mask) in enumerate(zip(self._history, step_masks(self._history), strict=True)):
            inputs, hidden = dict(record.inputs), record.inputs[hops[0].start]
            for hop in hops:
                inputs[hop.start] = hidden  # a new hop boundary gets its inputs recorded for later replays
                hidden = await self._sessions[hop.start].step(hidden, mask, record.position_ids, record.keep_rows,
                                                              step_id=step_id)
            replayed.append(dataclasses.replace(record, inputs=inputs))
        self._history = replayed  # only once the whole replay worked: a failed one leaves the history as it was
        if replayed:
            logger.info("Replayed %d steps to %s", len(replayed),
                        ", ".join(f"{h.start}:{h.end}@{h.peer_id[-6:]}" for h in hops))
