"""A deadline on each piece of an answer: a client that takes none of it for SWARMBATCH_SEND_DEADLINE_SECONDS
loses its connection.

uvicorn writes each piece the app sends into the connection's buffer, and makes the app's next `send` wait while
that buffer is full: a client that stops reading a download holds the route's `send`, and with it the key's
download slot (jobs.api.slots), for as long as it keeps its socket open. `deadline_send` wraps the server's `send`
so that a send still waiting after the deadline (the client took nothing of the piece before it, at most a 1 MiB
chunk or a page of 200 requests, for that long) aborts the connection: the socket is reset and what was buffered
for it dropped, the stream ends on the disconnect that follows, and the slot is given back. The deadline counts
from each send, not from the request: a large download read at any steady pace goes on for as long as it takes.

It wraps `send` outside Starlette's own middleware (jobs.api.main.ApiApp), so that it holds the server's own
`send`: uvicorn's (a bound method of the request's cycle) carries the connection's transport, which is aborted.
Under another server, an expired send raises SendTimedOut instead, and the server closes the connection (the ASGI
rule for an app that fails after its answer started).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import Any

from starlette.types import Message, Scope, Send

logger = logging.getLogger(__name__)

SEND_DEADLINE_LOG = "%s %r: the client took nothing of the answer for %g s (SWARMBATCH_SEND_DEADLINE_SECONDS); " \
                    "connection aborted"


ABORT = "swarmbatch.abort_connection"  # the scope's key of the request's connection-abort


def abort_connection(scope: Scope) -> bool:
    """Reset the request's connection, for an answer that started and cannot go on (the file it streams was
    deleted); whether that could be done here (else the caller raises, and the server closes the connection)."""
    abort = scope.get(ABORT)
    return bool(abort is not None and abort())


class SendTimedOut(Exception):
    """Raised from `send` when a piece waited past the deadline and the connection could not be aborted here."""


def deadline_send(scope: Scope, send: Send, seconds: float) -> Send:
    """`send` for one HTTP request, under the deadline: a piece still waiting after `seconds` aborts the connection.
    The scope gets the means to abort it from inside the app too (`abort_connection`)."""
    aborted = False
    scope[ABORT] = lambda: _abort(send)

    async def timed_send(message: Message) -> None:
        nonlocal aborted
        if aborted:  # the connection is gone: the rest is dropped, and the stream ends on the disconnect
            return
        try:
            async with asyncio.timeout(seconds):
                await send(message)
        except TimeoutError:
            aborted = True
            logger.warning(SEND_DEADLINE_LOG, scope.get("method", "?"), scope.get("path", ""), seconds)
            if not _abort(send):
                raise SendTimedOut(f"the client took nothing of the answer for {seconds:g} s") from None

    return timed_send


def _abort(send: Send) -> bool:
    """Reset the connection that `send` writes to (uvicorn's), dropping what it buffered; whether it was found."""
    # uvicorn's request cycle holds the connection's transport: asyncio's, or uvloop's (which is no asyncio.Transport)
    transport: Any = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None or not callable(getattr(transport, "abort", None)):
        return False
    sock = transport.get_extra_info("socket")
    if sock is not None:  # linger 0: close() resets the connection and frees the kernel's buffer at once
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except (OSError, AttributeError):  # not a socket's options: abort() alone
            pass
    transport.abort()
    return True
