"""Checking a batch's lines off the request: a worker streams the job's input file from the store and adds its
requests and line errors as it goes, so `POST /v1/batches` answers at once, whatever the file's size (as OpenAI's
batches.create answers `validating`).

The file is read chunk by chunk (jobs.files.iter_upload) and line by line (jobs.input_lines): memory holds one chunk
and one commit's lines, never the file. First a scan of the whole file, before any request is made of it: its size,
its count of non-empty lines, UTF-8, and (for a batch made from an uploaded file, whose model its lines name) the
model. A file refused whole there fails the job with that one error (Lifecycle.fail_validation). Then the lines are
checked (jobs.batch_input.LineChecker) and stored LINES_PER_COMMIT (or BYTES_PER_COMMIT) at a time, each commit
with the job's cursor (`ingest_offset`, `ingest_line`: where the next line starts) moved past them, so
`request_counts` and `errors` grow while the job is validating.

Durable and idempotent: the cursor moves only in the transaction that stores the lines it passes, and only from
where this run read it (a conditional UPDATE that also requires the job to be validating still), so a worker
killed mid-way leaves the lines of its last commit stored once and the rest to check; two runs at once (a
redelivered message) cannot both store a range: the second finds the cursor moved and stops. Each commit renews
the job's dispatch hold; when a worker dies, the hold lapses and the sweep sends the job to a worker, which goes on
from the cursor (with the custom_ids already used read back from the store, so a duplicate is still found).
Workers claim none of the job's requests before its last line is checked (Lifecycle.validated).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from jobs import files, store
from jobs.batch_input import InputLimits, LineChecker, LineError, ParsedRequest, claims_custom_id, line_model
from jobs.errors import FileNotFound, InvalidJob
from jobs.input_lines import BatchFileRejected, Line, iter_lines, too_large, too_many_lines
from jobs.line_embeddings import EmbeddingModel
from jobs.models import Job, JobStatus, StoredFile, utcnow
from jobs.runtime import Runtime
from modelprep import ModelPrepError
from swarmnet.errors import ModelDirError

logger = logging.getLogger(__name__)

LINES_PER_COMMIT = 1000  # lines checked and stored per transaction (fewer when they pass BYTES_PER_COMMIT)
BYTES_PER_COMMIT = 8 * 1024 * 1024
# a task checks lines this long, then sends the job again and returns: the worker's pool process is not held for
# minutes (other jobs' tasks, and its maintenance's sweeps, run between the slices), and a task stays short
SLICE_SECONDS = 30.0


@dataclass(frozen=True)
class Ingested:
    """What a call of check_lines did: `ran` is false when the job had no lines to check (a worker goes on to claim
    its requests); `requests` is how many it has once this call checked its last line (0 otherwise); `more` says
    its slice of time ended with lines left to check (the caller sends the job again)."""

    ran: bool
    requests: int = 0
    more: bool = False


@dataclass(frozen=True)
class _Cursor:
    """Where a job's check stands: the job's model and endpoint ("" while unknown), its input file, the byte offset
    and last line read."""

    model: str
    endpoint: str
    input_file_id: str | None
    offset: int
    line: int


@dataclass
class _Chunk:
    """The lines of one commit: their requests and errors, and where the cursor moves."""

    requests: list[ParsedRequest] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)
    bytes: int = 0
    end: int = 0
    line: int = 0


def model_checks(runtime: Runtime, model: str) -> tuple[Any, InputLimits]:
    """The model's tokenizer and what one of its input files may hold; InvalidJob when the model cannot be used."""
    try:
        tokenizer = runtime.tokenizer(model)
        context = runtime_context_length(runtime, model)
        embedding = embedding_model(runtime, model)
    except (ModelPrepError, ModelDirError) as e:
        raise InvalidJob(str(e)) from e
    settings = runtime.settings
    return tokenizer, InputLimits(max_file_bytes=settings.max_file_bytes, max_lines=settings.max_lines,
                                  max_tokens_cap=settings.max_tokens_cap, context_length=context, embedding=embedding)


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


def check_lines(runtime: Runtime, job_id: str, *, lines_per_commit: int = LINES_PER_COMMIT,
                seconds: float = SLICE_SECONDS) -> Ingested:
    """Check the lines of the job that are left to check, storing requests and line errors as it goes, for about
    `seconds` (a commit's lines more at most)."""
    began = time.monotonic()
    cursor = _begin(runtime, job_id)
    if cursor is None:
        return Ingested(ran=False)
    try:
        row = _input_file(runtime, cursor)
        model = _scan(runtime, row, cursor) if cursor.offset == 0 else cursor.model
        tokenizer, limits = model_checks(runtime, model)
    except BatchFileRejected as e:
        _fail(runtime, job_id, cursor.offset, code=e.code, message=str(e), param=e.param, line=e.line)
        return Ingested(ran=True)
    except InvalidJob as e:
        _fail(runtime, job_id, cursor.offset, code="model_not_found", message=str(e), param="body.model")
        return Ingested(ran=True)
    except FileNotFound:  # deleted while the scan read it
        _fail(runtime, job_id, cursor.offset, code="file_not_found", message=_deleted(cursor.input_file_id))
        return Ingested(ran=True)
    seen, next_index = _resume_point(runtime, job_id)
    checker = LineChecker(tokenizer=tokenizer, model_name=model, limits=limits, endpoint=cursor.endpoint or None,
                          model_aliases=runtime.settings.aliases_of(model), seen=seen)
    offset = cursor.offset
    try:
        lines = iter_lines(files.iter_upload(sessions=runtime.session, row=row, start=offset), start=offset,
                           first_number=cursor.line + 1)
        for chunk in _chunks(checker, lines, offset, lines_per_commit):
            if not _commit(runtime, job_id, model, offset, chunk, next_index):
                return Ingested(ran=True)
            next_index += sum(r.n for r in chunk.requests)
            offset = chunk.end
            if time.monotonic() - began > seconds:
                logger.info("Job %s: lines checked up to %d in this slice; the rest in the next", job_id, chunk.line)
                return Ingested(ran=True, more=True)
    except FileNotFound:  # deleted while its lines were read
        _fail(runtime, job_id, offset, code="file_not_found", message=_deleted(row.id))
        return Ingested(ran=True)
    return Ingested(ran=True, requests=_finish(runtime, job_id, model, offset))


def _begin(runtime: Runtime, job_id: str) -> _Cursor | None:
    """The job's cursor, if it has lines to check (its dispatch hold renewed: this worker is on it); else None."""
    with runtime.session() as session:
        job = session.get(Job, job_id)
        if job is None or job.ingest_offset is None or job.status != JobStatus.validating:
            return None
        store.refresh_dispatch_hold(session=session, job=job, seconds=runtime.settings.lease_seconds)
        session.commit()
        logger.info("Job %s: checking its lines from line %d (byte %d) on", job.id, job.ingest_line + 1,
                    job.ingest_offset)
        return _Cursor(job.model, job.endpoint, job.input_file_id, job.ingest_offset, job.ingest_line)


def _input_file(runtime: Runtime, cursor: _Cursor) -> StoredFile:
    """The job's input file; BatchFileRejected when it is gone."""
    with runtime.session() as session:
        row = session.get(StoredFile, cursor.input_file_id) if cursor.input_file_id else None
        if row is None:
            raise BatchFileRejected(_deleted(cursor.input_file_id), code="file_not_found")
        session.expunge(row)
        return row


def _deleted(file_id: str | None) -> str:
    """The one error of a batch whose input file was deleted before all its lines were checked."""
    return f"the input file {file_id} was deleted before its lines were checked; upload it again and create a new batch"


def _scan(runtime: Runtime, row: StoredFile, cursor: _Cursor) -> str:
    """The whole-file checks, before any request is stored (size, lines, UTF-8), and the model that runs the batch:
    the job's, or (a batch made from an uploaded file) the first a line names, else the first the API serves."""
    settings = runtime.settings
    if row.size > settings.max_file_bytes:
        raise too_large(row.size, settings.max_file_bytes)
    count, named, named_on = 0, None, None
    for line in iter_lines(files.iter_upload(sessions=runtime.session, row=row)):
        count += 1
        if not cursor.model and named is None and (named := line_model(line.text)) is not None:
            named_on = line.number
    if count > settings.max_lines:
        raise too_many_lines(count, settings.max_lines)
    if cursor.model:
        return cursor.model
    model = settings.resolve_model(named or settings.api_models[0])  # an alias names its served model
    if model not in settings.api_models:
        raise BatchFileRejected(f"model {model!r} is not served here; list the models with GET /v1/models, or ask "
                                f"the operator (SWARMBATCH_API_MODELS, SWARMBATCH_MODEL_ALIASES)",
                                code="model_not_found", param="body.model", line=named_on)
    return model


def _resume_point(runtime: Runtime, job_id: str) -> tuple[dict[str, int], int]:
    """The custom_ids the job's checked lines used (its requests' and its bad lines' that named one), and its next
    request index: what a check resumed part-way goes on from."""
    with runtime.session() as session:
        seen, next_index = store.request_lines_of(session=session, job_id=job_id)
        errors = session.scalar(select(Job.line_errors).where(Job.id == job_id)) or []
    for error in errors:
        if claims_custom_id(error):
            seen.setdefault(error["custom_id"], error["line_number"])
    return seen, next_index


def _chunks(checker: LineChecker, lines: Iterator[Line], offset: int, lines_per_commit: int) -> Iterator[_Chunk]:
    """The checked lines, a commit's worth at a time (the last chunk may be empty: it carries the file's end)."""
    chunk = _Chunk(end=offset)
    for line in lines:
        outcome = checker.check(line.number, line.text)
        if isinstance(outcome, ParsedRequest):
            chunk.requests.append(outcome)
        else:
            chunk.errors.append(outcome)
        chunk.bytes, chunk.end, chunk.line = chunk.bytes + len(line.text), line.end, line.number
        if len(chunk.requests) + len(chunk.errors) >= lines_per_commit or chunk.bytes >= BYTES_PER_COMMIT:
            yield chunk
            chunk = _Chunk(end=chunk.end, line=chunk.line)
    if chunk.requests or chunk.errors:
        yield chunk


def _fenced(session: Session, job_id: str, offset: int, *, hold: float, **values: Any) -> bool:
    """Move the job's cursor from `offset` (setting `values`) and hold its dispatch for `hold` seconds, if the cursor
    is still there and the job still validating. False: another run moved it, or the job was cancelled or expired."""
    moved = session.execute(update(Job).where(Job.id == job_id, Job.status == JobStatus.validating,
                                              Job.ingest_offset == offset)
                            .values(dispatch_after=utcnow() + timedelta(seconds=hold), **values))
    return bool(moved.rowcount)  # type: ignore[attr-defined]


def _commit(runtime: Runtime, job_id: str, model: str, offset: int, chunk: _Chunk, first_index: int) -> bool:
    """Store one chunk's requests and errors with the cursor moved past them, in one transaction."""
    with runtime.session() as session:
        if not _fenced(session, job_id, offset, ingest_offset=chunk.end, ingest_line=chunk.line, model=model,
                       hold=runtime.settings.lease_seconds):
            session.rollback()
            logger.info("Job %s: its lines from byte %d are checked elsewhere, or it stopped validating; leaving "
                        "them", job_id, offset)
            return False
        store.insert_requests(session=session, job_id=job_id, requests=chunk.requests, first_index=first_index)
        if chunk.errors:
            job = session.get(Job, job_id)
            assert job is not None
            job.line_errors = [*job.line_errors, *(e.to_dict() for e in chunk.errors)]
        session.commit()
    logger.info("Job %s: checked lines up to %d: %d requests, %d bad lines", job_id, chunk.line, len(chunk.requests),
                len(chunk.errors))
    return True


def _finish(runtime: Runtime, job_id: str, model: str, offset: int) -> int:
    """Every line is checked: the job may run (Lifecycle.validated) or fails for want of a good line; returns its
    requests (0 when it failed, or when another run finished it)."""
    with runtime.session() as session:
        if not _fenced(session, job_id, offset, model=model, hold=runtime.settings.lease_seconds):
            session.rollback()
            return 0
        job = session.get(Job, job_id)
        assert job is not None
        session.refresh(job)
        if not job.endpoint:
            job.endpoint = store.main_endpoint(session=session, job_id=job_id) or ""
        if not job.line_errors and not store.job_counts(session=session, job_id=job_id).total:
            job.line_errors = [_error("empty_file", "the input file has no non-empty line; put one JSON request "
                                                    "on each line")]
        runtime.lifecycle.validated(session, job)
        total = store.job_counts(session=session, job_id=job_id).total if job.status == JobStatus.validating else 0
        # the chains the worker sends next hold the dispatch: no sweep adds one while they claim
        store.refresh_dispatch_hold(session=session, job=job, seconds=runtime.settings.lease_seconds)
        session.commit()
        logger.info("Job %s: every line checked: %d requests, %d bad lines (%s)", job_id, total,
                    len(job.line_errors), job.status)
        return total


def _fail(runtime: Runtime, job_id: str, offset: int, *, code: str, message: str, param: str | None = None,
          line: int | None = None) -> None:
    """The file fails as a whole: the job ends failed with this one error (if its cursor is still at `offset`)."""
    with runtime.session() as session:
        if not _fenced(session, job_id, offset, hold=0):
            session.rollback()
            return
        job = session.get(Job, job_id)
        assert job is not None
        session.refresh(job)
        runtime.lifecycle.fail_validation(session, job, _error(code, message, param, line))
        session.commit()
    logger.info("Job %s failed validation: %s: %s", job_id, code, message)


def _error(code: str, message: str, param: str | None = None, line: int | None = None) -> dict[str, Any]:
    """A whole-file error as a job stores its line errors (jobs.outputs.line_error shows it OpenAI's way)."""
    return {"line_number": line, "custom_id": None, "code": code, "message": message, "param": param}
