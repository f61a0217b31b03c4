"""Bounds on a request body: its size (413) and the time it may take to arrive (408); the API's refusal error.

`BodyLimit` is ASGI middleware, not a route check: Starlette reads a multipart body whole (spooled to disk) and
`request.body()` reads a JSON one whole before any route code runs, so the limits must sit under them, on
`receive`. A declared Content-Length over the limit is answered before one byte of the body is read (a client
sending `Expect: 100-continue` never sends it); a body without one (chunked) is counted as it arrives and refused
as soon as the count passes the limit. A body that is not whole SWARMBATCH_BODY_DEADLINE_SECONDS after its
request's head arrived (one that trickles in at a byte a second) is cut off with a 408. Every such answer closes
the connection, so uvicorn stops reading the body rather than draining it. Concurrent requests are bounded
per key in jobs.api.slots.
"""
from __future__ import annotations

import asyncio

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


class _BodyTimedOut(Exception):
    """Raised from `receive` when a body is not whole by its deadline; BodyLimit turns it into the 408."""


class BodyLimit:
    """ASGI middleware: 413 for a request body over `max_bytes`, without reading more of it than the limit; 408 for
    one not whole `deadline` seconds after the request's head."""

    def __init__(self, app: ASGIApp, max_bytes: int, deadline: float) -> None:
        self.app, self.max_bytes, self.deadline = app, max_bytes, deadline

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse on the declared length at once, else count what arrives."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(f"the request body is {declared} bytes")(scope, receive, send)
            return
        received, whole, started = 0, False, False
        deadline = asyncio.get_running_loop().time() + self.deadline

        async def counting_receive() -> Message:
            nonlocal received, whole
            if whole:  # after the body, receive() waits for a disconnect (a streamed answer listens): no deadline
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise _BodyTimedOut from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                whole = not message.get("more_body", False)
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except (_BodyTooLarge, _BodyTimedOut) as refused:
            if started:  # cannot happen with our routes (they answer after reading the body); never send twice
                raise
            answer = (self._refuse(f"the request body passed {self.max_bytes} bytes")
                      if isinstance(refused, _BodyTooLarge) else self._too_slow(received))
            await answer(scope, receive, send)

    def _too_slow(self, received: int) -> JSONResponse:
        """The 408, closing the connection: the rest of the body is never read."""
        refusal = ApiRefusal(408, "RequestTimeout", f"the request body did not arrive within {self.deadline:g} s "
                                                    f"(SWARMBATCH_BODY_DEADLINE_SECONDS; {received} bytes came); "
                                                    f"send it again from a faster link, or split the batch",
                             headers={"Connection": "close"})
        return refusal.response()

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
