"""`AnswerReader`: a pushed session's answers, read in the background and matched to steps by step id.

With server-to-server push (protocol.py) a server answers steps the client never sent it (pushed by the server
before it), and reports failed pushes, unasked, on the same stream. So a push session's stream is read by one task
that files every answer under its step id: a waiter that gave up (a timeout, another hop's failure) leaves the stream
in step, and an answer that comes before anyone waits for it is kept until asked for.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

from swarmnet import protocol

Answer = tuple[list[torch.Tensor], dict[str, Any]]
PushFailure = Callable[[int, str, str], None]  # (step id, downstream peer, reason)


class StreamBroken(Exception):
    """The session's stream ended or sent something unreadable; every waiter gets it."""


class AnswerReader:
    """Reads one stream's answers and files them by step id."""

    def __init__(self, reader: asyncio.StreamReader, on_push_failure: PushFailure) -> None:
        self._reader = reader
        self._on_push_failure = on_push_failure
        self._answers: dict[int, asyncio.Future[Answer]] = {}
        self.limit = protocol.OPEN_FRAME_LIMIT  # the largest answer expected now (raised by `expect`)
        self.broken: str | None = None
        self.received_bytes = 0  # every answer's frame, as it came off the stream
        self._task = asyncio.ensure_future(self._run())

    def expect(self, max_bytes: int) -> None:
        """Allow answers up to `max_bytes` (a step about to be sent or pushed)."""
        self.limit = max(self.limit, max_bytes)

    async def answer(self, step_id: int, timeout: float) -> Answer:
        """The answer to step `step_id`; TimeoutError after `timeout` s, StreamBroken if the stream ended."""
        future = self._future(step_id)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        finally:
            if future.done():
                for old in [s for s in self._answers if s <= step_id]:
                    del self._answers[old]

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
            self._break("the stream closed (server gone)")
        except Exception as e:  # a reset stream, an undecodable answer
            self._break(f"{type(e).__name__}: {e}")

    def _file(self, answer: Answer) -> None:
        meta = answer[1]
        step_id = meta.get("step_id")
        if not isinstance(step_id, int):  # an error about the stream itself (not a step): the stream is over
            raise StreamBroken(str(protocol.response_error(meta) or meta)[:300])
        failure = meta.get("push_failed")
        if isinstance(failure, dict):
            self._on_push_failure(step_id, str(failure.get("peer")), str(failure.get("reason"))[:300])
            return
        future = self._future(step_id)
        if not future.done():
            future.set_result(answer)

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
