"""Errors raised by block servers.

    ServerError              root
    ├── ServerConfigError    bad flags or an unusable model dir (fix the command; retrying cannot help)
    └── RequestRejected      a request failed validation or does not fit; carries the wire error code
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the protocol loads torch; ServerConfigError is raised by light modules too (servers/config.py)
    from swarmnet.protocol import ErrorCode


class ServerError(Exception):
    """Root of server errors."""


class ServerConfigError(ServerError):
    """Raised at start-up for flags or model files that cannot work; the message says what to change."""


class RequestRejected(ServerError):
    """Raised while handling a request that must be refused; `code` tells the client what to do, `ends_stream`
    whether the server ends the stream after its answer (the caller broke the rules)."""

    def __init__(self, code: ErrorCode, message: str, *, ends_stream: bool = False) -> None:
        self.code, self.ends_stream = code, ends_stream
        super().__init__(message)
