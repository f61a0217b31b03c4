"""Submitting a batch file: store the job and enqueue its work, its lines checked before (`submit_batch`: the CLI,
the demo) or after, by a worker (`submit_unchecked`: the REST API, which so answers at once; jobs.ingest).

The job is committed before its work is enqueued. If the broker then fails, `submit_unchecked` returns the job all
the same, since it exists: the workers' sweep dispatches a validating job with lines to check, or pending requests,
and no dispatch hold (jobs.worker.sweep); `submit_batch` raises, so the CLI still says the broker is down (exit 3). A
submission under an idempotency key returns the job first stored under it instead of making another, so a client
retrying after a lost answer gets its job once; the same key with a different batch is an IdempotencyConflict.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from jobs import files, store
from jobs.batch_input import ParsedBatch, parse_batch_file
from jobs.durations import parse_window
from jobs.errors import IdempotencyConflict, InvalidJob
from jobs.ingest import model_checks
from jobs.input_lines import BatchFileRejected
from jobs.line_checks import MAX_METADATA_KEY, MAX_METADATA_PAIRS, MAX_METADATA_VALUE
from jobs.models import Job, StoredFile
from jobs.queue import ENQUEUE_ERRORS, enqueue_job
from jobs.quotas import Quota
from jobs.retention import retention
from jobs.runtime import Runtime
from jobs.store import create_job

logger = logging.getLogger(__name__)


def check_metadata(metadata: object) -> dict[str, str]:
    """The user's metadata as stored: at most 16 pairs of strings, keys up to 64 characters, values up to 512.

    Raises InvalidJob (a 400; nothing is created) with one line naming the first thing wrong.
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise InvalidJob(f"metadata must be an object of string keys and values, not {type(metadata).__name__}")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidJob(f"metadata may hold at most {MAX_METADATA_PAIRS} pairs, not {len(metadata)}")
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise InvalidJob(f"metadata keys must be strings, not {type(key).__name__}")
        if len(key) > MAX_METADATA_KEY:
            raise InvalidJob(f"metadata key {_clip(key)!r} is longer than {MAX_METADATA_KEY} characters")
        if not isinstance(value, str):
            raise InvalidJob(f"metadata value of {key!r} must be a string, not {type(value).__name__}")
        if len(value) > MAX_METADATA_VALUE:
            raise InvalidJob(f"metadata value of {key!r} is longer than {MAX_METADATA_VALUE} characters")
    return dict(metadata)


def _clip(value: object, length: int = 20) -> str:
    text = str(value)
    return text if len(text) <= length else text[:length] + "..."


@dataclass(frozen=True)
class Submitted:
    """The job of a submission, and whether an earlier submission under the same idempotency key made it."""

    job: Job
    replayed: bool = False


Pieces = Callable[[], Iterable[bytes]]  # a file's bytes, in pieces, read afresh at each call


def submit_batch(runtime: Runtime, data: bytes, *, model: str, filename: str | None = None,
                 api_key_id: int | None = None, completion_window: str = "24h",
                 metadata: dict[str, Any] | None = None, idempotency_key: str | None = None) -> Job:
    """Parse and store a JSONL batch, then enqueue it; raises InvalidJob (nothing created) if anything is refused.

    Refused: a window or metadata out of bounds, an unusable model, a file without one usable line.
    A broker error after the commit is raised (the stored job is dispatched by the next sweep all the same).
    """
    return submit(runtime, data, model=model, filename=filename, api_key_id=api_key_id,
                  completion_window=completion_window, metadata=metadata, idempotency_key=idempotency_key,
                  raise_enqueue_errors=True).job


def submit(runtime: Runtime, data: bytes, *, model: str, filename: str | None = None, api_key_id: int | None = None,
           completion_window: str = "24h", metadata: dict[str, Any] | None = None,
           idempotency_key: str | None = None, raise_enqueue_errors: bool = False,
           endpoint: str | None = None, output_expires_after_s: int | None = None) -> Submitted:
    """submit_batch, saying whether the job is an earlier one returned again for its idempotency key.

    The lines are checked here, before the job is stored (the CLI, the demo: a file of the user's own machine);
    `data` is stored as the job's input file in the same transaction, so every job has an input file. With an
    `endpoint`, lines of another url are line errors. A broker error after the commit is logged and the job
    returned, unless `raise_enqueue_errors`.
    """
    model = runtime.settings.resolve_model(model)  # an alias (SWARMBATCH_MODEL_ALIASES) names its served model
    window, metadata = parse_window(completion_window), check_metadata(metadata)
    fingerprint = _fingerprint(lambda: [data], model=model, filename=filename, completion_window=completion_window,
                               metadata=metadata, input_file_id=None, endpoint=endpoint) if idempotency_key else None
    if earlier := _earlier_job(runtime, idempotency_key, fingerprint):
        return Submitted(earlier, replayed=True)
    parsed = _parse(runtime, data, model, endpoint)

    def make(session: Session) -> Job:
        input_file_id = _store_input(runtime, session, lambda: [data], filename, api_key_id).id
        return create_job(session=session, parsed=parsed, model=model, api_key_id=api_key_id,
                          completion_window_s=window, checkpoint_every=runtime.settings.checkpoint_every,
                          input_filename=filename, metadata=metadata, idempotency_key=idempotency_key,
                          input_file_id=input_file_id)
    submitted = _store_job(runtime, make, idempotency_key, fingerprint, api_key_id, output_expires_after_s)
    if not submitted.replayed:
        _enqueue_committed(runtime, submitted.job, tasks=runtime.settings.tasks_for(len(parsed.requests)),
                           raise_errors=raise_enqueue_errors)
    return submitted


def submit_unchecked(runtime: Runtime, *, model: str | None, pieces: Pieces | None = None,
                     input_file_id: str | None = None, filename: str | None = None, api_key_id: int | None = None,
                     completion_window: str = "24h", metadata: dict[str, Any] | None = None,
                     idempotency_key: str | None = None, endpoint: str | None = None,
                     output_expires_after_s: int | None = None) -> Submitted:
    """The REST API's submission: the job is stored with its lines unchecked, and a worker checks them (jobs.ingest),
    so the answer comes at once whatever the file's size; what cannot be known without reading the file (a bad
    line, too many lines, the model the lines name) shows on the job as it is checked, as with OpenAI.

    The input is the stored file `input_file_id` (OpenAI's batches.create: `model` None, as its lines name it) or
    `pieces`, stored here as the job's input file (an API key's within its quota, expiring as its uploads do;
    its outputs expire after `output_expires_after_s` or SWARMBATCH_OUTPUT_RETENTION_SECONDS, the shorter).
    A broker error after the commit is logged and the job returned: the workers' sweep dispatches it.
    """
    model = runtime.settings.resolve_model(model) if model is not None else None
    window, metadata = parse_window(completion_window), check_metadata(metadata)
    fingerprint = _fingerprint(pieces or (lambda: []), model=model, filename=filename,
                               completion_window=completion_window, metadata=metadata, input_file_id=input_file_id,
                               endpoint=endpoint) if idempotency_key else None
    if earlier := _earlier_job(runtime, idempotency_key, fingerprint):
        return Submitted(earlier, replayed=True)

    def make(session: Session) -> Job:
        file_id = input_file_id or _store_input(runtime, session, pieces or (lambda: []), filename, api_key_id).id
        return create_job(session=session, parsed=None, model=model or "", endpoint=endpoint or "",
                          api_key_id=api_key_id, completion_window_s=window,
                          checkpoint_every=runtime.settings.checkpoint_every, input_filename=filename,
                          metadata=metadata, idempotency_key=idempotency_key, input_file_id=file_id)
    submitted = _store_job(runtime, make, idempotency_key, fingerprint, api_key_id, output_expires_after_s)
    if not submitted.replayed:  # one chain: its worker checks the lines, then sends as many as the requests need
        _enqueue_committed(runtime, submitted.job, tasks=1, raise_errors=False)
    return submitted


def _store_job(runtime: Runtime, make: Callable[[Session], Job], idempotency_key: str | None,
               fingerprint: str | None, api_key_id: int | None, output_expires_after_s: int | None) -> Submitted:
    """Commit the job `make` stores, or return the job a concurrent submission under the same key committed first."""
    with runtime.session() as session:
        try:
            job = make(session)
            job.idempotency_fingerprint = fingerprint
            if api_key_id is not None:
                job.output_expires_after_s = retention(output_expires_after_s,
                                                       runtime.settings.output_retention_seconds)
            # the tasks enqueued next are the job's chains: no sweep adds one while they claim (see hold_dispatch)
            store.refresh_dispatch_hold(session=session, job=job, seconds=runtime.settings.lease_seconds)
            session.commit()
        except IntegrityError:
            session.rollback()
            # a concurrent submission under the same key committed first: its job is the one
            if (earlier := _earlier_job(runtime, idempotency_key, fingerprint)) is None:
                raise
            return Submitted(earlier, replayed=True)
    return Submitted(job)


def _store_input(runtime: Runtime, session: Session, pieces: Pieces, filename: str | None,
                 api_key_id: int | None) -> StoredFile:
    """A submitted batch's bytes as its input file: an API key's within its quota, expiring as its uploads do."""
    keyed = api_key_id is not None
    return files.store_upload(session=session, pieces=pieces(), api_key_id=api_key_id,
                              filename=filename or "batch.jsonl", max_bytes=runtime.settings.max_file_bytes,
                              quota=Quota.of(runtime.settings) if keyed else None,
                              expires_after_s=retention(None, runtime.settings.upload_retention_seconds)
                              if keyed else None)


def _parse(runtime: Runtime, data: bytes, model: str, endpoint: str | None = None) -> ParsedBatch:
    """The file's lines checked against the model; InvalidJob when the model or the file is refused."""
    tokenizer, limits = model_checks(runtime, model)
    try:
        return parse_batch_file(data, tokenizer=tokenizer, model_name=model, limits=limits, endpoint=endpoint,
                                model_aliases=runtime.settings.aliases_of(model))
    except BatchFileRejected as e:
        raise InvalidJob(str(e)) from e


def _enqueue_committed(runtime: Runtime, job: Job, *, tasks: int, raise_errors: bool) -> None:
    """Enqueue a committed job's work; a broker failure is logged (or raised): the job exists and a sweep sends it."""
    try:
        enqueue_job(runtime.celery, job.id, tasks=tasks)
    except ENQUEUE_ERRORS as e:
        with runtime.session() as session:  # no chain was sent: the next sweep must dispatch the job at once
            store.release_dispatch_hold(session=session, job_id=job.id)
            session.commit()
        if raise_errors:
            raise
        logger.warning("Job %s is stored but its work could not be enqueued (%s); the workers' next sweep "
                       "dispatches it", job.id, " ".join(str(e).split()) or type(e).__name__)


def _fingerprint(pieces: Pieces, **fields: Any) -> str:
    """sha256 of everything submitted: the same idempotency key must come with the same batch."""
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode())
    digest.update(b"\n")
    for piece in pieces():
        digest.update(piece)
    return digest.hexdigest()


def _earlier_job(runtime: Runtime, idempotency_key: str | None, fingerprint: str | None) -> Job | None:
    """The job stored under the key, if any (None without a key); IdempotencyConflict when it was made from another
    batch."""
    if idempotency_key is None or fingerprint is None:
        return None
    with runtime.session() as session:
        job = session.scalar(select(Job).where(Job.idempotency_key == idempotency_key))
    if job is not None and job.idempotency_fingerprint != fingerprint:
        raise IdempotencyConflict(f"this Idempotency-Key was first used for another batch (job {job.id}); "
                                  f"send a new key with a new batch")
    return job
