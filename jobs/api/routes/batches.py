"""`/v1/batches`: submit, list, inspect, read results and errors of, and cancel the caller's jobs."""
from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Response
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session

from jobs import files, outputs, store
from jobs.api.batch_request import REQUEST_BODY, SubmissionDep
from jobs.api.deps import ApiKeyDep, RuntimeDep, SessionDep, require_served_model
from jobs.api.slots import DownloadSlotDep, ParsingSlotDep, SubmissionSlotDep
from jobs.errors import InvalidJob, OutputsExpired
from jobs.models import ApiKey, FilePurpose, Job, StoredFile
from jobs.retention import asked_seconds
from jobs.submission import submit_unchecked

router = APIRouter(prefix="/v1/batches", tags=["batches"])

JSONL = "application/jsonl"
Responses = dict[int | str, dict[str, Any]]
ERRORS: Responses = {400: {"description": "InvalidJob: the batch is refused whole (a bad body, a model the operator "
                                          "does not serve); nothing was created. Its lines are checked after the "
                                          "answer: a file that fails then ends the batch `failed`."},
          401: {"description": "No API key, or an unknown one."}}
SUBMIT_ERRORS: Responses = {
    **ERRORS,
    404: {"description": "FileNotFound: input_file_id is no file of this API key."},
    409: {"description": "IdempotencyConflict: the Idempotency-Key was first used with another batch."},
    413: {"description": "RequestTooLarge: the body is over SWARMBATCH_MAX_FILE_BYTES (+64 KiB for the form); "
                         "refused before it is read, or as soon as a streamed body passes the limit."},
    408: {"description": "RequestTimeout: the body did not arrive within SWARMBATCH_BODY_DEADLINE_SECONDS."},
    429: {"description": "TooManySubmissions: the key's SWARMBATCH_MAX_SUBMISSIONS_PER_KEY, or the server's "
                         "SWARMBATCH_MAX_CONCURRENT_SUBMISSIONS, are in progress; retry after Retry-After seconds. "
                         "InsufficientQuota: the key keeps as many files or bytes as it may; delete some."}}
MAX_IDEMPOTENCY_KEY_CHARS = 255  # stored as api:<key id>:<key> in jobs.idempotency_key, a String(300)
NOT_FOUND: Responses = {404: {"description": "JobNotFound: no such job for this API key."}}
STREAMED: Responses = {200: {"content": {JSONL: {}}, "description": "One JSON line per request, in input order."},
                       410: {"description": "OutputsExpired: the batch's outputs passed their retention."},
                       429: {"description": "TooManyDownloads: SWARMBATCH_MAX_DOWNLOADS_PER_KEY of this key are "
                                            "streaming; retry after Retry-After seconds."}}


def idempotency_key(key: ApiKeyDep, header: Annotated[str | None, Header(
        alias="Idempotency-Key", description="Any string up to 255 characters: a retry with the same key and "
                                             "the same batch returns the first job instead of making another."
        )] = None) -> str | None:
    """The header scoped to the caller's API key, so two keys' values can neither collide nor probe each other."""
    if header is None:
        return None
    if not 0 < len(header) <= MAX_IDEMPOTENCY_KEY_CHARS:
        raise InvalidJob(f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} characters "
                         f"(got {len(header)})")
    return f"api:{key.id}:{header}"


@router.post("", openapi_extra=REQUEST_BODY, responses=SUBMIT_ERRORS)
def create_batch(key: ApiKeyDep, scoped_key: Annotated[str | None, Depends(idempotency_key)],
                 _slot: SubmissionSlotDep, submission: SubmissionDep, _parsing: ParsingSlotDep, runtime: RuntimeDep,
                 session: SessionDep, response: Response) -> dict[str, Any]:
    """Create a batch: OpenAI's `{"input_file_id", "endpoint", "completion_window", "metadata"}` (a file uploaded
    to /v1/files; the model is the lines' `body.model` or the model it is an alias of, else the first of
    SWARMBATCH_API_MODELS), a JSONL upload (multipart `file` + `model`), or inline requests (JSON `model` +
    `requests`); returns the batch object, `validating`, at once.

    Only what is cheap and certain is checked here (the file is the key's, the endpoint, window, metadata, quota,
    and a model the request names); a worker checks the lines next (jobs.ingest): `request_counts` and `errors`
    grow as it goes, and a file that fails as a whole (every line bad, too many lines, a model not served) ends
    `failed` with `errors` saying why, as with OpenAI.

    With an `Idempotency-Key` header, a repeat of the same batch returns the first job (with the response header
    `Idempotent-Replayed: true`); the same key with another batch is a 409.
    """
    # the key, then one of its submission slots, come first among the parameters: an anonymous caller is refused,
    # and a key over its bound gets its 429, before the body is read; the server's slot is taken once it is in
    output_expires_after_s = asked_seconds(submission.output_expires_after, "output_expires_after")
    model, filename = None, submission.filename
    if submission.input_file_id is not None:
        filename = _input_file(session, key, submission.input_file_id).filename
    else:
        assert submission.model is not None  # read_submission sets it for the forms that carry the file
        model = runtime.settings.resolve_model(submission.model)  # an alias names its served model
        require_served_model(runtime.settings, model)  # before any lookup of the model on this server
    session.close()  # the submission writes in sessions of its own
    submitted = submit_unchecked(runtime, model=model, pieces=submission.pieces,
                                 input_file_id=submission.input_file_id, filename=filename, api_key_id=key.id,
                                 completion_window=submission.completion_window, metadata=submission.metadata,
                                 idempotency_key=scoped_key, endpoint=submission.endpoint,
                                 output_expires_after_s=output_expires_after_s)
    if submitted.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return outputs.job_public(session=session, job=store.get_job(session=session, job_id=submitted.job.id))


def _input_file(session: Session, key: ApiKey, file_id: str) -> StoredFile:
    """The caller's uploaded batch file (FileNotFound for none of theirs; InvalidJob for a job's output file)."""
    row = files.get_file(session=session, file_id=file_id, api_key_id=key.id)
    if row.purpose != FilePurpose.batch or row.job_id is not None:
        raise InvalidJob(f"file {row.id} has purpose {row.purpose}; a batch's input is a file uploaded with "
                         f"purpose 'batch'", param="input_file_id")
    return row


@router.get("")
def list_batches(session: SessionDep, key: ApiKeyDep, limit: int = Query(default=20, ge=1, le=100),
                 after: str | None = Query(default=None, description="A batch id: the page starts after it.")
                 ) -> dict[str, Any]:
    """The key's jobs, newest first, a page at a time (`after` the last id of the previous page)."""
    jobs, has_more = store.page_jobs(session=session, api_key_id=key.id, limit=limit, after=after)
    return page([outputs.job_public(session=session, job=job) for job in jobs], has_more)


def page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


@router.get("/{job_id}", responses=NOT_FOUND)
def get_batch(job_id: str, session: SessionDep, key: ApiKeyDep) -> dict[str, Any]:
    """One job: status, request counts, line errors, timestamps, its files."""
    return outputs.job_public(session=session, job=store.get_job(session=session, job_id=job_id, api_key_id=key.id))


@router.get("/{job_id}/results", response_class=StreamingResponse, responses={**STREAMED, **NOT_FOUND})
def get_results(job_id: str, session: SessionDep, key: ApiKeyDep, slot: DownloadSlotDep,
                runtime: RuntimeDep) -> StreamingResponse:
    """Output lines of the finished requests, in input order (partial while the job runs)."""
    job = _unexpired(store.get_job(session=session, job_id=job_id, api_key_id=key.id))
    return slot.stream(outputs.iter_results(sessions=runtime.session, job=job), media_type=JSONL)


@router.get("/{job_id}/errors", response_class=StreamingResponse, responses={**STREAMED, **NOT_FOUND})
def get_errors(job_id: str, session: SessionDep, key: ApiKeyDep, slot: DownloadSlotDep,
               runtime: RuntimeDep) -> StreamingResponse:
    """Input line errors, then failed requests, as JSON lines."""
    job = _unexpired(store.get_job(session=session, job_id=job_id, api_key_id=key.id))
    return slot.stream(outputs.iter_errors(sessions=runtime.session, job=job), media_type=JSONL)


def _unexpired(job: Job) -> Job:
    """The job, unless its outputs were deleted: their retention passed, or their file was deleted (OutputsExpired,
    a 410)."""
    if job.outputs_expired_at is not None:
        raise OutputsExpired(f"the outputs of batch {job.id} were deleted at {job.outputs_expired_at:%Y-%m-%d %H:%M:%S}"
                             " UTC: their output or error file was deleted, or passed its retention "
                             "(output_expires_after, SWARMBATCH_OUTPUT_RETENTION_SECONDS); download outputs before")
    return job


@router.post("/{job_id}/cancel", responses=NOT_FOUND)
def cancel_batch(job_id: str, session: SessionDep, key: ApiKeyDep, runtime: RuntimeDep) -> dict[str, Any]:
    """Cancel: pending requests stop now, running ones at their next checkpoint; finished outputs are kept."""
    job = runtime.lifecycle.cancel(session, job_id, api_key_id=key.id)
    session.commit()
    return outputs.job_public(session=session, job=job)
