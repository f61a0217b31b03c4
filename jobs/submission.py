"""Submitting a batch file: validate every line against the model, create the job, enqueue its work.

The job is committed before its work is enqueued. If the broker then fails, `submit` (the REST API) returns the job
all the same, since it exists: the workers' sweep dispatches a validating job with pending requests and no dispatch hold
(jobs.worker.sweep); `submit_batch` (the CLI, the demo) raises, so the CLI still says the broker is down (exit 3). A
submission under an idempotency key returns the job first stored under it instead of making another, so a client
retrying after a lost answer gets its job once; the same key with a different batch is an IdempotencyConflict.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from jobs import files, store
from jobs.batch_input import BatchFileRejected, InputLimits, ParsedBatch, parse_batch_file
from jobs.durations import parse_window
from jobs.errors import IdempotencyConflict, InvalidJob
from jobs.line_embeddings import EmbeddingModel
from jobs.models import Job, StoredFile
from jobs.queue import ENQUEUE_ERRORS, enqueue_job
from jobs.quotas import Quota
from jobs.retention import retention
from jobs.runtime import Runtime
from jobs.store import create_job
from modelprep import ModelPrepError
from swarmnet.errors import ModelDirError

logger = logging.getLogger(__name__)



# the user's metadata, in OpenAI's shape: it is stored and shown back, never read by the service
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


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
           input_file_id: str | None = None, endpoint: str | None = None,
           output_expires_after_s: int | None = None) -> Submitted:
    """submit_batch, saying whether the job is an earlier one returned again for its idempotency key.

    `input_file_id` names the stored file `data` was read from (OpenAI's batches.create); without one, `data` is
    stored as a file of its own in the job's transaction, so every job has an input file. With an `endpoint`,
    lines of another url are line errors. A broker error after the commit is logged and the job returned, unless
    `raise_enqueue_errors`. An API key's stored input counts against its quota, and its files expire (jobs.retention:
    the input after SWARMBATCH_UPLOAD_RETENTION_SECONDS, the outputs after `output_expires_after_s` or
    SWARMBATCH_OUTPUT_RETENTION_SECONDS, the shorter).
    """
    model = runtime.settings.resolve_model(model)  # an alias (SWARMBATCH_MODEL_ALIASES) names its served model
    window = parse_window(completion_window)
    metadata = check_metadata(metadata)
    fingerprint = None
    if idempotency_key is not None:
        fingerprint = _fingerprint(data, model=model, filename=filename, completion_window=completion_window,
                                   metadata=metadata, input_file_id=input_file_id, endpoint=endpoint)
        if earlier := _earlier_job(runtime, idempotency_key, fingerprint):
            return Submitted(earlier, replayed=True)
    parsed = _parse(runtime, data, model, endpoint)
    with runtime.session() as session:
        try:
            if input_file_id is None:
                input_file_id = _store_input(runtime, session, data, filename, api_key_id).id
            job = create_job(session=session, parsed=parsed, model=model, api_key_id=api_key_id,
                             completion_window_s=window, checkpoint_every=runtime.settings.checkpoint_every,
                             input_filename=filename, metadata=metadata, idempotency_key=idempotency_key,
                             input_file_id=input_file_id)
            job.idempotency_fingerprint = fingerprint
            if api_key_id is not None:
                job.output_expires_after_s = retention(output_expires_after_s,
                                                       runtime.settings.output_retention_seconds)
            # the tasks enqueued below are the job's chains: no sweep adds one while they claim (see hold_dispatch)
            store.refresh_dispatch_hold(session=session, job=job, seconds=runtime.settings.lease_seconds)
            session.commit()
        except IntegrityError:
            session.rollback()
            # a concurrent submission under the same key committed first: its job is the one
            if idempotency_key is None or fingerprint is None or \
                    (earlier := _earlier_job(runtime, idempotency_key, fingerprint)) is None:
                raise
            return Submitted(earlier, replayed=True)
    _enqueue_committed(runtime, job, parsed, raise_errors=raise_enqueue_errors)
    return Submitted(job)


def _store_input(runtime: Runtime, session: Session, data: bytes, filename: str | None,
                 api_key_id: int | None) -> StoredFile:
    """A submitted batch's bytes as its input file: an API key's within its quota, expiring as its uploads do."""
    keyed = api_key_id is not None
    return files.store_upload(session=session, pieces=_pieces(data), api_key_id=api_key_id,
                              filename=filename or "batch.jsonl", max_bytes=runtime.settings.max_file_bytes,
                              quota=Quota.of(runtime.settings) if keyed else None,
                              expires_after_s=retention(None, runtime.settings.upload_retention_seconds)
                              if keyed else None)


def _pieces(data: bytes) -> list[bytes]:
    return [data[i:i + files.CHUNK_BYTES] for i in range(0, len(data), files.CHUNK_BYTES)]


def _parse(runtime: Runtime, data: bytes, model: str, endpoint: str | None = None) -> ParsedBatch:
    """The file's lines checked against the model; InvalidJob when the model or the file is refused."""
    try:
        tokenizer = runtime.tokenizer(model)
        context = runtime_context_length(runtime, model)
        embedding = embedding_model(runtime, model)
    except (ModelPrepError, ModelDirError) as e:
        raise InvalidJob(str(e)) from e
    limits = InputLimits(max_file_bytes=runtime.settings.max_file_bytes, max_lines=runtime.settings.max_lines,
                         max_tokens_cap=runtime.settings.max_tokens_cap, context_length=context, embedding=embedding)
    try:
        return parse_batch_file(data, tokenizer=tokenizer, model_name=model, limits=limits, endpoint=endpoint,
                                model_aliases=runtime.settings.aliases_of(model))
    except BatchFileRejected as e:
        raise InvalidJob(str(e)) from e


def _enqueue_committed(runtime: Runtime, job: Job, parsed: ParsedBatch, *, raise_errors: bool) -> None:
    """Enqueue a committed job's work; a broker failure is logged (or raised): the job exists and a sweep sends it."""
    try:
        enqueue_job(runtime.celery, job.id, tasks=runtime.settings.tasks_for(len(parsed.requests)))
    except ENQUEUE_ERRORS as e:
        with runtime.session() as session:  # no chain was sent: the next sweep must dispatch the job at once
            store.release_dispatch_hold(session=session, job_id=job.id)
            session.commit()
        if raise_errors:
            raise
        logger.warning("Job %s is stored but its work could not be enqueued (%s); the workers' next sweep "
                       "dispatches it", job.id, " ".join(str(e).split()) or type(e).__name__)


def _fingerprint(data: bytes, **fields: Any) -> str:
    """sha256 of everything submitted: the same idempotency key must come with the same batch."""
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode())
    digest.update(b"\n")
    digest.update(data)
    return digest.hexdigest()


def _earlier_job(runtime: Runtime, idempotency_key: str, fingerprint: str) -> Job | None:
    """The job stored under the key, if any; IdempotencyConflict when it was made from another batch."""
    with runtime.session() as session:
        job = session.scalar(select(Job).where(Job.idempotency_key == idempotency_key))
    if job is not None and job.idempotency_fingerprint != fingerprint:
        raise IdempotencyConflict(f"this Idempotency-Key was first used for another batch (job {job.id}); "
                                  f"send a new key with a new batch")
    return job


def runtime_context_length(runtime: Runtime, model: str) -> int:
    """The model's context length, from its config."""
    from swarmnet.model_spec import ModelSpec

    return ModelSpec.open(runtime.model_dir(model)).max_length



def embedding_model(runtime: Runtime, model: str) -> EmbeddingModel:
    """What the model's embeddings can be: its hidden size and its pooling (swarmclient.pooling)."""
    from swarmclient.pooling import read_pooling
    from swarmnet.model_spec import ModelSpec

    spec = ModelSpec.open(runtime.model_dir(model))
    return EmbeddingModel(spec.config.hidden_size, read_pooling(spec.path, spec.config))
