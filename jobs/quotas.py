"""Per-key quotas of the Files API: how many files, and how many bytes, one API key may keep.

What counts is what GET /v1/files lists for the key: its uploads, the input files of its batches, and their output
and error files (whose `bytes` were counted when they were made). An upload or a submission is refused with
InsufficientQuota (HTTP 429, OpenAI's `insufficient_quota`) before it stores a file when the key's count is at
the limit, and as soon as the bytes it stores pass what is left; output files, which hold a job's finished work,
are never refused. Two uploads of one key at once each see what was committed before they started, so together
they may pass the bytes limit by at most one upload (SWARMBATCH_MAX_UPLOADS_PER_KEY bounds how many).
"""
from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from jobs.errors import InsufficientQuota
from jobs.models import StoredFile
from jobs.settings import Settings

HINT = "delete files you no longer need (DELETE /v1/files/{id}), or ask the operator to raise it"


@dataclass(frozen=True)
class Quota:
    """How much one key may keep."""

    files: int
    bytes: int

    @classmethod
    def of(cls, settings: Settings) -> Quota:
        """The operator's quota (SWARMBATCH_MAX_FILES_PER_KEY, SWARMBATCH_MAX_STORED_BYTES_PER_KEY)."""
        return cls(files=settings.max_files_per_key, bytes=settings.max_stored_bytes_per_key)


@dataclass(frozen=True)
class Usage:
    """What one key keeps now."""

    files: int
    bytes: int


def usage_of(*, session: Session, api_key_id: int) -> Usage:
    """The key's files and the sum of their bytes."""
    files, size = session.execute(select(func.count(), func.coalesce(func.sum(StoredFile.size), 0))
                                  .where(StoredFile.api_key_id == api_key_id)).one()
    return Usage(files=int(files), bytes=int(size))


def bytes_left(*, session: Session, api_key_id: int, quota: Quota) -> int:
    """The bytes a new file of the key may have; InsufficientQuota when the key may store no further file."""
    usage = usage_of(session=session, api_key_id=api_key_id)
    if usage.files >= quota.files:
        raise InsufficientQuota(f"this API key keeps {usage.files} files, its quota "
                                f"(SWARMBATCH_MAX_FILES_PER_KEY={quota.files}); {HINT}")
    if usage.bytes >= quota.bytes:
        raise over_bytes(usage.bytes, quota)
    return quota.bytes - usage.bytes


def over_bytes(stored: int, quota: Quota) -> InsufficientQuota:
    """The refusal of a file that would take the key past its bytes quota."""
    return InsufficientQuota(f"this API key would keep more than {quota.bytes} bytes of files, its quota "
                             f"(SWARMBATCH_MAX_STORED_BYTES_PER_KEY; {stored} are stored); {HINT}")
