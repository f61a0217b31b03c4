"""The Files API's store: uploads kept in SQL, and a job's output and error files rendered from its requests.

An upload's bytes are FileChunk rows of CHUNK_BYTES each, written as the upload is read and counted, so an API
process never holds a file whole and every API and worker machine reads the same store. A job's output and error
files (OpenAI's `output_file_id`, `error_file_id`) hold no bytes: once the job is terminal its lines no longer
change, so they are streamed from the requests table (jobs.outputs) whenever they are read; their `bytes` is
counted by streaming them once when the job ends. Files belong to the API key that uploaded them (or whose job
made them); any other key gets FileNotFound, as for jobs. Like jobs.store, nothing here commits.
"""
from __future__ import annotations

import logging
import unicodedata
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from jobs import outputs
from jobs.db import SessionScope, held
from jobs.errors import FileNotFound, InvalidJob
from jobs.models import FileChunk, FilePurpose, Job, StoredFile, utcnow
from jobs.quotas import Quota, bytes_left, over_bytes

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
MAX_FILENAME = 255  # characters of an upload's name that are kept (a longer one is refused)
OUTPUT, ERROR = "output", "error"  # StoredFile.lines of a job's two files


class FileTooLarge(InvalidJob):
    """Raised while an upload is read, as soon as it passes the size limit; nothing is stored."""


def new_file_id() -> str:
    """`file-` and 24 hex digits, as OpenAI's ids look."""
    return f"file-{uuid.uuid4().hex[:24]}"


def check_filename(filename: str) -> str:
    """An upload's name as stored: at most MAX_FILENAME characters, no control characters; InvalidJob (a 400)."""
    if len(filename) > MAX_FILENAME:
        raise InvalidJob(f"the file name has {len(filename)} characters; at most {MAX_FILENAME} are kept: "
                         "rename the file", param="file")
    if any(unicodedata.category(ch) == "Cc" for ch in filename):
        raise InvalidJob(f"the file name {filename[:64]!r} holds control characters (a line break, a tab...); "
                         "rename the file", param="file")
    return filename


def store_upload(*, session: Session, pieces: Iterable[bytes], filename: str, api_key_id: int | None,
                 max_bytes: int, purpose: FilePurpose = FilePurpose.batch, quota: Quota | None = None,
                 expires_after_s: int | None = None) -> StoredFile:
    """Store an upload read piece by piece; FileTooLarge as soon as it passes `max_bytes`, InsufficientQuota as soon
    as it would take its key past `quota` (the session rolls back either way).

    The file expires `expires_after_s` after it is made (None: kept until deleted).
    """
    check_filename(filename)
    quota_left = None
    if quota is not None and api_key_id is not None:
        quota_left = bytes_left(session=session, api_key_id=api_key_id, quota=quota)
    now = utcnow()
    row = StoredFile(id=new_file_id(), api_key_id=api_key_id, purpose=purpose, filename=filename, size=0,
                     created_at=now, expires_at=expires_at(now, expires_after_s))
    session.add(row)
    session.flush()
    pending, seq = bytearray(), 0
    for piece in pieces:
        row.size += len(piece)
        _check_size(row.size, max_bytes, quota, quota_left)
        pending += piece
        while len(pending) >= CHUNK_BYTES:
            session.add(FileChunk(file_id=row.id, seq=seq, data=bytes(pending[:CHUNK_BYTES])))
            del pending[:CHUNK_BYTES]
            seq += 1
            session.flush()  # one chunk at a time reaches the database: memory stays one chunk
    if pending or seq == 0:
        session.add(FileChunk(file_id=row.id, seq=seq, data=bytes(pending)))
    session.flush()
    logger.info("File %s stored: %r, %d bytes", row.id, filename, row.size)
    return row


def _check_size(size: int, max_bytes: int, quota: Quota | None, quota_left: int | None) -> None:
    """FileTooLarge past the file limit, InsufficientQuota past what is left of the key's bytes."""
    if size > max_bytes:
        raise FileTooLarge(f"the file passed {max_bytes} bytes (SWARMBATCH_MAX_FILE_BYTES); split it into "
                           f"smaller files", param="file")
    if quota is not None and quota_left is not None and size > quota_left:
        raise over_bytes(quota.bytes - quota_left, quota)


def expires_at(created_at: datetime, after_s: int | None) -> datetime | None:
    """When a file made at `created_at` expires (None: never)."""
    return created_at + timedelta(seconds=after_s) if after_s is not None else None


def get_file(*, session: Session, file_id: str, api_key_id: int | None = None) -> StoredFile:
    """A file, if it exists and (when a key is given) belongs to that key; raises FileNotFound."""
    row = session.get(StoredFile, file_id)
    if row is None or (api_key_id is not None and row.api_key_id != api_key_id):
        raise FileNotFound(file_id)
    return row


def list_files(*, session: Session, api_key_id: int, limit: int, after: str | None = None,
               purpose: str | None = None) -> tuple[list[StoredFile], bool]:
    """The key's files newest first, after the file `after` (a cursor); returns (page, has_more)."""
    query = select(StoredFile).where(StoredFile.api_key_id == api_key_id)
    if purpose is not None:
        query = query.where(StoredFile.purpose == purpose)
    if after is not None:
        cursor = get_file(session=session, file_id=after, api_key_id=api_key_id)
        query = query.where((StoredFile.created_at < cursor.created_at) |
                            ((StoredFile.created_at == cursor.created_at) & (StoredFile.id < cursor.id)))
    rows = list(session.scalars(query.order_by(StoredFile.created_at.desc(), StoredFile.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def delete_file(*, session: Session, row: StoredFile) -> None:
    """Delete a file and its bytes (a job made from it keeps its requests; a job's own file is just gone)."""
    delete_files(session=session, file_ids=[row.id])
    logger.info("File %s deleted", row.id)


def delete_files(*, session: Session, file_ids: list[str]) -> None:
    """Delete files and their bytes by id; ids already gone are no error (two sweeps may meet)."""
    session.execute(delete(FileChunk).where(FileChunk.file_id.in_(file_ids)))
    session.execute(delete(StoredFile).where(StoredFile.id.in_(file_ids)), execution_options={
        "synchronize_session": "fetch"})
    session.flush()


def read_upload(*, session: Session, row: StoredFile) -> bytes:
    """An uploaded file's bytes, whole (for parsing a batch; bounded by the upload limit)."""
    return b"".join(iter_upload(sessions=held(session), row=row))


def iter_upload(*, sessions: SessionScope, row: StoredFile, start: int = 0) -> Iterator[bytes]:
    """An uploaded file's chunks in order (from byte `start` on), each read in a session of its own from `sessions`
    (after the last seq read: keyset), so a client that stops reading holds no connection. FileNotFound when the
    file was deleted meanwhile: a download ends short rather than looking whole."""
    after, skip = start // CHUNK_BYTES - 1, start % CHUNK_BYTES  # every chunk but the last is CHUNK_BYTES long
    size = start - skip
    while True:
        with sessions() as session:
            chunk = session.scalars(select(FileChunk).where(FileChunk.file_id == row.id, FileChunk.seq > after)
                                    .order_by(FileChunk.seq).limit(1)).first()
            if chunk is None:
                break
            after, data = chunk.seq, chunk.data
            session.expunge(chunk)
        size += len(data)
        yield data[skip:] if skip else data
        skip = 0
    if size != row.size:
        raise FileNotFound(row.id)


def iter_content(*, sessions: SessionScope, row: StoredFile) -> Iterator[bytes]:
    """What GET /v1/files/{id}/content streams: an upload's bytes, or a job's output or error lines."""
    if row.job_id is None:
        yield from iter_upload(sessions=sessions, row=row)
        return
    with sessions() as session:
        job = session.get(Job, row.job_id)
    if job is not None:
        yield from (line.encode() for line in _job_lines(sessions, job, row.lines))


def _job_lines(sessions: SessionScope, job: Job, lines: str | None) -> Iterator[str]:
    if lines == OUTPUT:
        return outputs.iter_results(sessions=sessions, job=job)
    return outputs.iter_errors(sessions=sessions, job=job)


def attach_job_files(*, session: Session, job: Job, now: datetime | None = None) -> None:
    """Make an ended job's output and error files (each only if it has a line), counting their bytes by streaming."""
    for lines in (OUTPUT, ERROR):
        size = count = 0
        for line in _job_lines(held(session), job, lines):
            size, count = size + len(line.encode()), count + 1
        if not count:
            continue
        made = now or utcnow()
        row = StoredFile(id=new_file_id(), api_key_id=job.api_key_id, purpose=FilePurpose.batch_output,
                         filename=f"{job.id}_{lines}.jsonl", size=size, created_at=made, job_id=job.id,
                         lines=lines, expires_at=expires_at(made, job.output_expires_after_s))
        session.add(row)
        if lines == OUTPUT:
            job.output_file_id = row.id
        else:
            job.error_file_id = row.id
    session.flush()


def file_public(row: StoredFile) -> dict[str, Any]:
    """OpenAI's file object."""
    return {"id": row.id, "object": "file", "bytes": row.size, "created_at": int(row.created_at.timestamp()),
            "filename": row.filename, "purpose": str(row.purpose), "status": "processed",
            "expires_at": int(row.expires_at.timestamp()) if row.expires_at is not None else None,
            "status_details": None}
