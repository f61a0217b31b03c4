"""Errors raised by the swarm client on its way through the swarm (the root and the shared ones: swarmnet.errors).

    swarmnet.errors.SwarmError      root: anything that went wrong talking to the swarm
    ├── (swarmnet.errors)           ModelDirError, NetworkConfigError, DHTUnreachable, membership.MembershipError
    ├── MissingBlocksError          no online server holds some blocks (retry later, or start a server)
    ├── InvalidRequest              a server refused a request as malformed (a client bug; not retryable)
    ├── SwarmBusy                   every server that could serve some blocks has no room for the session now
    │                               (not retried here: the caller waits for its own sessions to end, or retries later)
    ├── PeerFailed                  a server died, timed out or is full (recoverable: route around it)
    │   ├── NoRoom                  a server has no room for the session now (cache_full / busy): routed around
    │   │                           for a moment, without a ban
    │   ├── SessionTimeout          a server did not answer within the step timeout
    │   ├── Unauthorized            a server refused us as no member of its swarm (route around; if all refuse:
    │   │                           membership.NotAMember)
    │   ├── WrongOutput             a server's output differs from other servers' (banned for good; replayed elsewhere)
    │   └── PushReported            the server before it could not push a step to it (the client sends the step
    │                               itself; not banned unless that fails too)
    ├── LieCaught                   a deferred check found a server's output wrong after the session went on with it
    │                               (banned for good; not retried here: the caller drops the tokens since its last
    │                               settled checks, e.g. a job resumes from its last checkpoint)
"""
from __future__ import annotations

from swarmnet.errors import SwarmError


class MissingBlocksError(SwarmError):
    """Raised when no online server holds some blocks; retry after a server for them joins."""

    def __init__(self, model_id: str, missing: list[tuple[int, int]]) -> None:
        self.model_id, self.missing = model_id, missing
        ranges = ", ".join(f"{a}:{b}" for a, b in missing)
        super().__init__(
            f"No online server holds blocks {ranges} of {model_id}. "
            f"Start one with 'swarmbatch serve MODEL --blocks {missing[0][0]}:{missing[0][1]} --initial-peers ...' "
            f"or check 'swarmbatch swarm status MODEL'."
        )


class InvalidRequest(SwarmError):
    """Raised when a server rejects a request as malformed; retrying the same request cannot help."""


class PeerFailed(SwarmError):
    """Raised when a server fails, disconnects or refuses for lack of room; the client routes around it."""

    def __init__(self, peer_id: str, reason: str) -> None:
        self.peer_id, self.reason = peer_id, reason
        super().__init__(f"server {peer_id[-8:]} failed: {reason}")


class SwarmBusy(SwarmError):
    """Raised when the only servers that could serve some blocks refused the session for lack of room (their KV
    cache, or this caller's share of it); the caller should wait until some of its sessions end."""


class NoRoom(PeerFailed):
    """Raised when a server refuses a session for lack of room now (cache_full, busy); the client routes around it
    for a moment, without banning it."""


class SessionTimeout(PeerFailed):
    """Raised when a server does not answer a step in time; the client routes around it."""


class Unauthorized(PeerFailed):
    """Raised when a server refuses us as no member of its swarm; the client routes around it, and says so if all do."""


class WrongOutput(PeerFailed):
    """Raised when a checked step's output differs from other servers'; the server is banned for good and the
    client replays its hop through others."""


class LieCaught(SwarmError):
    """Raised when a deferred check finds that a server's output of an earlier step was wrong (swarmclient.
    deferred_checks): the server is banned for good, and every token the session produced since the caller last
    settled its checks must be dropped and generated again (a job: from its last checkpoint)."""

    def __init__(self, peer_id: str, step: int) -> None:
        super().__init__(f"server {peer_id} gave a wrong output at step {step} or later (banned for good); the "
                         "tokens since the last checkpoint are discarded")
        self.peer_id, self.step = peer_id, step


class PushReported(PeerFailed):
    """Raised when the server before this one reports that it could not push a step here; the client then sends the
    step to this server itself (banned only if that fails too)."""
