"""Concurrency slots of one API process: how many submissions, uploads and downloads one key, and all keys, hold.

Each kind has a per-key bound (SWARMBATCH_MAX_SUBMISSIONS_PER_KEY, _UPLOADS_PER_KEY, _DOWNLOADS_PER_KEY); a
request finding none of its key's slots free gets 429 with Retry-After at once, before its body is read or its
answer is streamed. Submissions have a process-wide bound too (SWARMBATCH_MAX_CONCURRENT_SUBMISSIONS), taken only
once the body is in (jobs.api.limits bounds its size and time): it bounds the work of storing bodies (the lines are
checked by workers, jobs.ingest), so a key trickling a body holds its own slot and nobody else's. A download's slot
is held until its last byte is sent (or the client goes, or takes nothing for SWARMBATCH_SEND_DEADLINE_SECONDS:
jobs.api.send_deadline), an upload's and a submission's until the route returns. A download whose file is deleted
(or whose outputs expire) while it streams has its connection aborted: the client sees an incomplete answer, never
a short one that looks whole.

The counts live in this process's memory: with several API processes (uvicorn workers, replicas) a key may hold
the bound in each (docs/security.md "API limits"). They need no broker and cannot leak across a crash.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from jobs.api.deps import ApiKeyDep
from jobs.api.limits import ApiRefusal
from jobs.api.send_deadline import abort_connection
from jobs.errors import JobsError
from jobs.settings import Settings

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 5
DISCONNECT_WAIT_SECONDS = 5.0
CUT_SHORT_LOG = "%s %r: what the answer streams went while it was sent (%s); connection aborted, the answer cut short"


@dataclass(frozen=True)
class SlotKind:
    """What a kind of slot bounds, for its refusal: the error type, what is counted, the setting that bounds it."""

    error: str
    what: str
    setting: str


SUBMISSIONS = SlotKind("TooManySubmissions", "batch submissions", "MAX_SUBMISSIONS_PER_KEY")
ALL_SUBMISSIONS = SlotKind("TooManySubmissions", "batch submissions", "MAX_CONCURRENT_SUBMISSIONS")
UPLOADS = SlotKind("TooManyUploads", "file uploads", "MAX_UPLOADS_PER_KEY")
DOWNLOADS = SlotKind("TooManyDownloads", "downloads", "MAX_DOWNLOADS_PER_KEY")


class Slots:
    """Up to `per_key` slots held by one owner (a key id), and `total` by all; a try that finds none fails at once."""

    def __init__(self, kind: SlotKind, *, per_key: int | None = None, total: int | None = None) -> None:
        self.kind, self.per_key, self.total = kind, per_key, total
        self._held: Counter[int | None] = Counter()
        self._lock = threading.Lock()  # released from whichever thread ends the request

    def try_acquire(self, owner: int | None = None) -> bool:
        """Take a slot for `owner` if one is free, without waiting."""
        with self._lock:
            if self.per_key is not None and self._held[owner] >= self.per_key:
                return False
            if self.total is not None and sum(self._held.values()) >= self.total:
                return False
            self._held[owner] += 1
            return True

    def release(self, owner: int | None = None) -> None:
        """Give a slot back."""
        with self._lock:
            self._held[owner] -= 1
            if self._held[owner] <= 0:
                del self._held[owner]

    def held(self, owner: int | None = None) -> int:
        """How many slots `owner` holds now."""
        with self._lock:
            return self._held[owner]

    def refusal(self) -> ApiRefusal:
        """The 429 of a try that found no slot free."""
        bound = self.per_key if self.per_key is not None else self.total
        whose = "of this API key are" if self.per_key is not None else "are already"
        return ApiRefusal(429, self.kind.error,
                          f"{bound} {self.kind.what} {whose} in progress on this server "
                          f"(SWARMBATCH_{self.kind.setting}); retry in {RETRY_AFTER_SECONDS} s",
                          headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


@dataclass
class ApiSlots:
    """The slots of one app."""

    submissions: Slots  # per key, from the body's first byte
    all_submissions: Slots  # all keys, once the body is in
    uploads: Slots
    downloads: Slots

    @classmethod
    def of(cls, settings: Settings) -> ApiSlots:
        """The operator's bounds."""
        return cls(submissions=Slots(SUBMISSIONS, per_key=settings.max_submissions_per_key),
                   all_submissions=Slots(ALL_SUBMISSIONS, total=settings.max_concurrent_submissions),
                   uploads=Slots(UPLOADS, per_key=settings.max_uploads_per_key),
                   downloads=Slots(DOWNLOADS, per_key=settings.max_downloads_per_key))


def _slots(request: Request) -> ApiSlots:
    slots: ApiSlots = request.app.state.slots
    return slots


def _hold(slots: Slots, owner: int | None) -> Iterator[None]:
    """Hold one slot until the route returns; its 429 when none is free."""
    if not slots.try_acquire(owner):
        raise slots.refusal()
    try:
        yield
    finally:
        slots.release(owner)


def submission_slot(request: Request, key: ApiKeyDep) -> Iterator[None]:
    """One of the key's submission slots, from before the body is read until the job is stored."""
    yield from _hold(_slots(request).submissions, key.id)


def parsing_slot(request: Request) -> Iterator[None]:
    """One of the process's submission slots, once the body is in, until the job is stored."""
    yield from _hold(_slots(request).all_submissions, None)


def upload_slot(request: Request, key: ApiKeyDep) -> Iterator[None]:
    """One of the key's upload slots, from before the body is read until the file is stored."""
    yield from _hold(_slots(request).uploads, key.id)


# "function" scope: a slot is given back when the route returns, not after its response is sent
SubmissionSlotDep = Annotated[None, Depends(submission_slot, scope="function")]
ParsingSlotDep = Annotated[None, Depends(parsing_slot, scope="function")]
UploadSlotDep = Annotated[None, Depends(upload_slot, scope="function")]


class DownloadSlot:
    """A download slot of the key, given back when its answer has been sent, or by the route if it sends none."""

    def __init__(self, slots: Slots, owner: int) -> None:
        self.slots, self.owner, self.streaming, self._released = slots, owner, False, False

    def release(self) -> None:
        """Give the slot back (once)."""
        if not self._released:
            self._released = True
            self.slots.release(self.owner)

    def stream(self, content: Iterator[bytes] | Iterator[str], media_type: str) -> StreamingResponse:
        """The streamed answer, which holds the slot until its last byte is sent or the client goes."""
        self.streaming = True
        return _SlotResponse(content, media_type=media_type, slot=self)


class _SlotResponse(StreamingResponse):
    """A StreamingResponse that gives its download slot back however the stream ends."""

    def __init__(self, content: Iterator[bytes] | Iterator[str], *, media_type: str, slot: DownloadSlot) -> None:
        super().__init__(content, media_type=media_type)
        self.slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except JobsError as gone:  # what it streams went meanwhile (the file deleted, the outputs expired)
            if not abort_connection(scope):
                raise
            logger.warning(CUT_SHORT_LOG, scope.get("method", "?"), scope.get("path", ""), type(gone).__name__)
            await _disconnected(receive)
        finally:
            self.slot.release()


async def _disconnected(receive: Receive) -> None:
    """Until the server has seen the aborted connection go (it then takes the unfinished answer for the client's
    leaving, not for the app's fault); a few seconds at most."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DISCONNECT_WAIT_SECONDS):
            while (await receive())["type"] != "http.disconnect":
                pass


async def download_slot(request: Request, key: ApiKeyDep) -> AsyncIterator[DownloadSlot]:
    """One of the key's download slots; handed to the answer by `DownloadSlot.stream`, else given back when the
    route returns (a 404)."""
    slots = _slots(request).downloads
    if not slots.try_acquire(key.id):
        raise slots.refusal()
    slot = DownloadSlot(slots, key.id)
    try:
        yield slot
    finally:
        if not slot.streaming:
            slot.release()


DownloadSlotDep = Annotated[DownloadSlot, Depends(download_slot, scope="function")]
