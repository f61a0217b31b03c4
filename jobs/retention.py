"""Retention: when an API key's files expire, and the sweep step that deletes expired files and revoked keys' files.

As OpenAI: an upload may say `expires_after: {"anchor": "created_at", "seconds": N}` and a batch
`output_expires_after` (the same shape; the anchor is the output file's creation), N from 1 hour to 30 days. The
operator's SWARMBATCH_UPLOAD_RETENTION_SECONDS and SWARMBATCH_OUTPUT_RETENTION_SECONDS apply when none is asked, and
bound what is asked (the shorter wins); files without a key (the CLI's) never expire. A job's output and error
files hold no bytes (jobs.files): when one expires, its job's outputs are deleted from the requests too (texts,
token ids, prompts, bodies; the counts and usage stay), and the job's results and errors read 410 from then on.

A revoked key's files are deleted by the next sweep whatever their expiry, files made later for its jobs likewise.

`DELETE /v1/files/{id}` of a job's output or error file does what its expiry does (`delete_file`): both of the job's
files and the outputs they are rendered from go, so no file id or results URL of the job still shows its lines; the
batch object keeps the ids (as OpenAI's does), which then answer 404, and its results and errors 410.
"""
from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from jobs import files
from jobs.errors import InvalidJob
from jobs.files import delete_files
from jobs.models import ApiKey, Job, Request, StoredFile

logger = logging.getLogger(__name__)

ANCHOR = "created_at"
MIN_SECONDS, MAX_SECONDS = 3600, 30 * 24 * 3600  # OpenAI's bounds of expires_after.seconds
FILES_PER_SWEEP = 500  # files one sweep deletes at most (the next sweep goes on)


def asked_seconds(value: Any, param: str) -> int | None:
    """The seconds of an `expires_after`-shaped object (None when absent); InvalidJob (400) naming `param` when
    it is not {"anchor": "created_at", "seconds": 3600..2592000}."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("anchor", ANCHOR) != ANCHOR or set(value) - {"anchor", "seconds"}:
        raise InvalidJob(f"{param} must be {{\"anchor\": \"created_at\", \"seconds\": N}} (got {str(value)[:80]!r})",
                         param=param)
    seconds = _whole(value.get("seconds"))  # a form field is a string
    if seconds is None or not MIN_SECONDS <= seconds <= MAX_SECONDS:
        raise InvalidJob(f"{param}.seconds must be a whole number from {MIN_SECONDS} (1 hour) to {MAX_SECONDS} "
                         f"(30 days) (got {value.get('seconds')!r})", param=f"{param}.seconds")
    return seconds


def _whole(value: object) -> int | None:
    """A whole number given as one or as its digits; None otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        return None
    try:
        return int(value)
    except ValueError:
        return None


def retention(asked: int | None, operator: int) -> int | None:
    """The seconds a key's file is kept: the shorter of what was asked and the operator's (0: no bound)."""
    bounds = [s for s in (asked, operator or None) if s is not None]
    return min(bounds) if bounds else None


def expire_files(*, session: Session, now: datetime, limit: int = FILES_PER_SWEEP) -> int:
    """Delete up to `limit` files that expired or whose key is revoked, purging the outputs of the jobs whose output
    or error file goes; returns how many files went. The caller commits."""
    revoked = select(ApiKey.id).where(ApiKey.revoked_at.is_not(None))
    rows = session.execute(select(StoredFile.id, StoredFile.job_id).where(
        or_(StoredFile.expires_at <= now, StoredFile.api_key_id.in_(revoked))).limit(limit)).all()
    if not rows:
        return 0
    purge_outputs(session=session, job_ids={job_id for _, job_id in rows if job_id is not None}, now=now)
    delete_files(session=session, file_ids=[file_id for file_id, _ in rows])
    logger.info("Retention: %d expired files deleted", len(rows))
    return len(rows)


def delete_file(*, session: Session, row: StoredFile, now: datetime) -> None:
    """A key's deletion of one of its files: an upload's bytes; for a job's output or error file, both of the job's
    files and the job's outputs (as when they expire). The caller commits."""
    if row.job_id is None:
        files.delete_file(session=session, row=row)
        return
    purge_outputs(session=session, job_ids={row.job_id}, now=now)
    job_files = list(session.scalars(select(StoredFile.id).where(StoredFile.job_id == row.job_id)))
    delete_files(session=session, file_ids=job_files)
    logger.info("Files %s of job %s deleted, and its outputs", ", ".join(job_files), row.job_id)


def purge_outputs(*, session: Session, job_ids: set[str], now: datetime) -> None:
    """Delete what the jobs' requests hold beyond their counts (texts, token ids, logprobs, prompts, bodies)."""
    if not job_ids:
        return
    session.execute(update(Request).where(Request.job_id.in_(job_ids)).values(
        output_text=None, generated_ids=[], generated_logprobs=None, prompt_ids=[], body={}, last_error=None),
        execution_options={"synchronize_session": False})
    session.execute(update(Job).where(Job.id.in_(job_ids), Job.outputs_expired_at.is_(None))
                    .values(outputs_expired_at=now), execution_options={"synchronize_session": False})
