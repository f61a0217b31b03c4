"""`AnswerReader`: a pushed session's answers, read in the background and matched to steps by step id.

With server-to-server push (protocol.py) a server answers steps the client never sent it (pushed by the server
before it), and reports failed pushes, unasked, on the same stream. So a push session's stream is read by one task
that files every answer under its step id: a waiter that gave up (a timeout, another hop's failure) leaves the stream
in step, and an answer that comes before anyone waits for it is kept until asked for.

Only answers to steps the client sent (`expect`) and has not taken yet are kept: a late copy of one taken already
(a duplicate step's) is dropped, and an answer to a step never sent, or a push failure that the client does not act
on (`PushFailure` returns False), is a stray. After MAX_STRAYS of them the server is taken for faulty: the stream
breaks, every waiter gets StreamBroken, and the client bans the server and routes around it as for any broken stream.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

from swarmnet import protocol

Answer = tuple[list[torch.Tensor], dict[str, Any]]
# (step id, downstream peer, reason) -> whether the report was one to expect (False: counted against the server)
PushFailure = Callable[[int, str, str], bool]
MAX_STRAYS = 8  # answers to steps never sent and unexpected push reports a server may send before it is taken for faulty


class StreamBroken(Exception):
    """The session's stream ended or sent something unreadable; every waiter gets it."""


class AnswerReader:
    """Reads one stream's answers and files them by step id."""

    def __init__(self, reader: asyncio.StreamReader, on_push_failure: PushFailure) -> None:
        self._reader = reader
        self._on_push_failure = on_push_failure
        self._answers: dict[int, asyncio.Future[Answer]] = {}
        self._expected: set[int] = set()  # step ids sent (to this server or one before it) and not taken yet
        self._taken = -1  # the highest step id whose answer was taken
        self.strays = 0
        self.limit = protocol.OPEN_FRAME_LIMIT  # the largest answer expected now (raised by `expect`)
        self.broken: str | None = None
        self.lost = False  # the stream ended or broke under us (not a refusal): the session may be resumed
        self.received_bytes = 0  # every answer's frame, as it came off the stream
        self._task = asyncio.ensure_future(self._run())

    def expect(self, step_id: int, max_bytes: int) -> None:
        """Step `step_id` is about to be sent here or pushed: its answer (up to `max_bytes`) is one to keep."""
        self.limit = max(self.limit, max_bytes)
        self._expected.add(step_id)

    @property
    def pending(self) -> int:
        """Answers waited for or kept, not taken yet."""
        return len(self._answers)

    async def answer(self, step_id: int, timeout: float) -> Answer:
        """The answer to step `step_id`; TimeoutError after `timeout` s, StreamBroken if the stream ended."""
        future = self._future(step_id)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        finally:
            if future.done():
                for old in [s for s in self._answers if s <= step_id]:
                    del self._answers[old]
                self._expected = {s for s in self._expected if s > step_id}
                self._taken = max(self._taken, step_id)

    def fail(self, step_id: int, error: BaseException) -> None:
        """Make the waiter of `step_id` fail now (an upstream server could not push it); a later answer still counts."""
        future = self._answers.get(step_id)
        if future is not None and not future.done():  # an answer already in stays: the push did land after all
            del self._answers[step_id]
            future.set_exception(error)
            future.exception()  # retrieved: nobody else may be waiting

    def _future(self, step_id: int) -> asyncio.Future[Answer]:
        if self.broken is not None:
            raise StreamBroken(self.broken)
        future = self._answers.get(step_id)
        if future is None:
            future = self._answers[step_id] = asyncio.get_running_loop().create_future()
        return future

    async def _run(self) -> None:
        try:
            while True:
                length = int.from_bytes(await self._reader.readexactly(8), "big")
                if length > self.limit:
                    raise protocol.FrameTooLarge(f"an answer of {length} bytes (expected at most {self.limit})")
                self.received_bytes += length
                self._file(protocol.decode(await self._reader.readexactly(length)))
        except asyncio.CancelledError:
            self._break("closed")
            raise
        except asyncio.IncompleteReadError:
            self.lost = True
            self._break("the stream closed (server gone)")
        except ConnectionError as e:  # a reset stream
            self.lost = True
            self._break(f"{type(e).__name__}: {e}")
        except Exception as e:  # an undecodable answer, an error about the stream
            self._break(f"{type(e).__name__}: {e}")

    def _file(self, answer: Answer) -> None:
        meta = answer[1]
        step_id = meta.get("step_id")
        if not isinstance(step_id, int):  # an error about the stream itself (not a step): the stream is over
            raise StreamBroken(str(protocol.response_error(meta) or meta)[:300])
        if meta.get("confirmed") is True:  # the ring's guess of a step was ours: its answer came before (ring.py)
            return
        failure = meta.get("push_failed")
        if isinstance(failure, dict):
            peer = str(failure.get("peer"))
            if not self._on_push_failure(step_id, peer, str(failure.get("reason"))[:300]):
                self._stray(f"a push failure of step {step_id} naming {peer[-8:]!r}, not its next hop")
            return
        if step_id in self._expected or step_id in self._answers:
            future = self._future(step_id)
            if not future.done():
                future.set_result(answer)
        elif step_id > self._taken:  # (a late copy of an answer taken already is dropped: a duplicate step's)
            self._stray(f"an answer to step {step_id}, never sent")

    def _stray(self, what: str) -> None:
        """Count a message the client did not ask for; past MAX_STRAYS, take the server for faulty."""
        self.strays += 1
        if self.strays > MAX_STRAYS:
            raise StreamBroken(f"the server sent {what} ({self.strays} unasked messages): taken for faulty")

    def _break(self, reason: str) -> None:
        self.broken = reason
        for future in self._answers.values():
            if not future.done():
                future.set_exception(StreamBroken(reason))
                future.exception()
        self._answers.clear()

    def close(self) -> None:
        """Stop reading."""
        self._task.cancel()

    async def stop(self) -> None:
        """Stop reading, and wait until the reader is free for someone else (a session's close answer)."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
