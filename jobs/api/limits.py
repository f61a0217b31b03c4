"""Bounds on what one caller can make an API process hold: body size (413) and concurrent submissions (429).

`BodyLimit` is ASGI middleware, not a route check: Starlette reads a multipart body whole (spooled to disk) and
`request.body()` reads a JSON one whole before any route code runs, so the limit must sit under them, on
`receive`. A declared Content-Length over the limit is answered before one byte of the body is read (a client
sending `Expect: 100-continue` never sends it); a body without one (chunked) is counted as it arrives and refused
as soon as the count passes the limit. Both answers close the connection, so uvicorn stops reading the body
rather than draining it.
"""
from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobs.api.error_body import error_response

# a request body carries the JSONL file plus multipart framing and the form's text fields (model, metadata...), or
# the same requests as a JSON array: this much room on top of SWARMBATCH_MAX_FILE_BYTES; the file itself is still
# checked exactly once it is read (jobs.batch_input, a 400)
BODY_OVERHEAD_BYTES = 64 * 1024
RETRY_AFTER_SECONDS = 5


class ApiRefusal(Exception):
    """Raised in the API to refuse a request with `status`, the app's error body and extra headers."""

    def __init__(self, status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.headers = status, kind, message, headers or {}

    def response(self) -> JSONResponse:
        """OpenAI's error body, as every error of the app (jobs.api.error_body)."""
        return error_response(self.status, self.kind, self.message, headers=self.headers)


class _BodyTooLarge(Exception):
    """Raised from `receive` when a streamed body passes the limit; BodyLimit turns it into the 413."""


class BodyLimit:
    """ASGI middleware: 413 for a request body over `max_bytes`, without reading more of it than the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse on the declared length at once, else count what arrives."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(f"the request body is {declared} bytes")(scope, receive, send)
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if started:  # cannot happen with our routes (they answer after reading the body); never send twice
                raise
            await self._refuse(f"the request body passed {self.max_bytes} bytes")(scope, receive, send)

    def _refuse(self, what: str) -> JSONResponse:
        """The 413; `Connection: close` makes uvicorn drop the connection instead of reading the rest."""
        limit = self.max_bytes - BODY_OVERHEAD_BYTES
        refusal = ApiRefusal(413, "RequestTooLarge", f"{what}; the limit is {self.max_bytes} "
                                                     f"(SWARMBATCH_MAX_FILE_BYTES={limit} plus "
                                                     f"{BODY_OVERHEAD_BYTES} for the form); split the batch "
                                                     f"into smaller files", headers={"Connection": "close"})
        return refusal.response()


def _content_length(scope: Scope) -> int | None:
    """The declared body length (h11 has already refused a malformed one)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value)
    return None


class SubmissionSlots:
    """A bounded count of submissions in progress in this process; a try that finds none free fails at once."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = threading.BoundedSemaphore(size)  # released from whichever thread ends the request

    def try_acquire(self) -> bool:
        """Take a slot if one is free, without waiting."""
        return self._free.acquire(blocking=False)

    def release(self) -> None:
        """Give a slot back."""
        self._free.release()


async def submission_slot(request: Request) -> AsyncIterator[None]:
    """Hold a slot from before the body is read until the job is stored; 429 with Retry-After when none is free.

    Held while the body arrives too, so the slots bound the memory of bodies being parsed as well as the CPU of
    parsing and tokenizing them.
    """
    slots: SubmissionSlots = request.app.state.submission_slots
    if not slots.try_acquire():
        raise ApiRefusal(429, "TooManySubmissions",
                         f"{slots.size} batch submissions are already in progress on this server "
                         f"(SWARMBATCH_MAX_CONCURRENT_SUBMISSIONS); retry in {RETRY_AFTER_SECONDS} s",
                         headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    try:
        yield
    finally:
        slots.release()


# "function" scope: the slot is given back when the route returns, not after its response is sent
SubmissionSlotDep = Annotated[None, Depends(submission_slot, scope="function")]
