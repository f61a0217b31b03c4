"""What a block server keeps per stream and per inference session: Stream, Session, AppliedStep.

A stream carries at most one session (the one its open message created or its resume message took over, or, for a
push stream, the one it attached to); a session lives from its open message until its client closes it or its stream
ends. A session opened "resumable" whose stream is lost (the caller's side ended or broke, not the server's doing)
is detached instead: kept, cache and all, for the server's session grace, for its caller to resume on a new stream
(handler.py); then freed.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from servers.errors import RequestRejected
from swarmnet import protocol
from swarmnet.protocol import ErrorCode

# log lines that tests read (sessions open at once): session id prefix first
SESSION_OPENED_LOG = "Session %s opened by %s: blocks %d:%d, batch %d, up to %d tokens"
SESSION_CLOSED_LOG = "Session %s closed after %d tokens"
SESSION_DETACHED_LOG = "Session %s of %s detached: its stream was lost after %d steps; kept %g s for it to resume"
SESSION_RESUMED_LOG = "Session %s resumed by %s on a new stream at step %d (%d tokens), not replayed"
SESSION_EXPIRED_LOG = "Session %s freed: its client did not resume it within %g s"


@dataclass(eq=False)
class AppliedStep:
    """A step a session applied: its answer, what pushing it on takes, where it was pushed, how often it came again."""

    step_id: int
    answer: bytes
    pushed: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # output, attention mask, position ids
    keep_rows: Any
    # (peer, session) its outputs were pushed to -> whether that push failed (then a duplicate may push it again)
    targets: dict[tuple[str, str], bool] = field(default_factory=dict)
    duplicates: int = 0  # copies of it that came since it was applied (from its client or pushed)
    # a step the ring guessed (ring.py): the digest of its input until its client's own copy came and matched; None
    # for a step its client sent, or a guess it confirmed
    unconfirmed: bytes | None = None


@dataclass
class Session:
    """One client's inference session on this server."""

    session_id: str
    peer: str  # the caller that opened it
    owner: str  # the member it acts for (its caller's owner: what its cache and its count go to)
    start: int
    end: int
    batch_size: int
    max_length: int
    caches: list[Any]
    length: int = 0
    pushable: bool = False  # opened with "push": its client's route may push steps into it (push.py)
    resumable: bool = False  # opened with "resumable": kept detached for a while when its stream is lost
    # the ring (ring.py): a last hop's whole route from the first hop on, where it pushes each next step it guesses;
    # a first hop's last server, whose guesses it takes (None: no ring, or the ring is off for this session)
    ring_route: list[tuple[str, str]] | None = None
    ring_from: str | None = None
    # opened with "background": another client's warm check (swarmclient/warm_checks.py): its steps compute on the
    # background thread, behind inference steps, like a stateless forward, and are never merged with others
    background: bool = False
    stream: Stream | None = None  # the stream it answers on (pushed steps' answers go there); None while detached
    expiry: asyncio.TimerHandle | None = None  # while detached: when it is freed unless resumed
    applied: int = 0  # steps applied; a step id below it is a duplicate
    last_step: AppliedStep | None = None  # the last step applied: what a duplicate of it gets again
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one step at a time (a push and a direct step race)
    opened: float = field(default_factory=time.monotonic)  # when: lent cache is taken back from the newest first

    def step_frame_limit(self, hidden_size: int) -> int:
        """The largest step message this session may still be sent: its rows, its remaining tokens."""
        return protocol.step_frame_limit(batch=self.batch_size, tokens=self.max_length - self.length,
                                         mask_length=self.max_length, hidden_size=hidden_size)


def check_session_id(meta: dict[str, Any], session: Session) -> None:
    """A stream carries one session: a message naming another is refused (and changes nothing)."""
    if meta.get("session_id") != session.session_id:
        raise RequestRejected(ErrorCode.UNKNOWN_SESSION,
                              f"unknown session {str(meta.get('session_id'))[:64]!r} on this stream")


class StreamOver(Exception):
    """The stream is over: the caller ended it, sent nothing accepted for too long, or sent an oversized message."""


@dataclass
class Stream:
    """One stream of one caller: when it expires, whether its first message passed, its session, its refusals."""

    peer: str  # the caller's peer id, authenticated by libp2p
    timeout: float
    owner: str = ""  # whom the caller acts for, once its first message passed (a member; until then its peer id)
    generation: int = 0  # the membership's generation when the owner was last found a member
    deadline: float = 0.0  # event-loop time after which the stream is closed, unless a message is accepted before
    authorized: bool = False
    session: Session | None = None
    refused: int = 0  # refused messages in a row
    ended: bool = False  # set by the server (a close, a refusal that ends it, `_end_stream`): its session is freed
    lost: bool = False  # the caller's side ended or broke (not the server's doing): its session may be detached
    writer: asyncio.StreamWriter | None = None
    step_id: int | None = None  # the step id of the message being answered (its refusal carries it too)
    repeated: bool = False  # the message being answered repeats a step applied before: it keeps no stream alive
    push_target: Session | None = None  # a push stream: the session it was attached to

    def __post_init__(self) -> None:
        self.owner = self.owner or self.peer
        self.accepted()

    def accepted(self, within: float | None = None) -> None:
        """A message was accepted: the stream lives `timeout` more seconds from now (or `within`, if shorter)."""
        self.deadline = asyncio.get_running_loop().time() + min(self.timeout, within or self.timeout)
        self.refused = 0
