"""`/v1/batches`: submit, list, inspect, read results and errors of, and cancel the caller's jobs."""
from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Response
from fastapi.responses import StreamingResponse

from jobs import outputs, store
from jobs.api.batch_request import REQUEST_BODY, SubmissionDep
from jobs.api.deps import ApiKeyDep, RuntimeDep, SessionDep, require_served_model
from jobs.api.limits import SubmissionSlotDep
from jobs.errors import InvalidJob
from jobs.submission import submit

router = APIRouter(prefix="/v1/batches", tags=["batches"])

JSONL = "application/jsonl"
Responses = dict[int | str, dict[str, Any]]
ERRORS: Responses = {400: {"description": "InvalidJob: the batch is refused whole (a bad body, a model the operator "
                                          "does not serve, no good line); nothing was created."},
          401: {"description": "No API key, or an unknown one."}}
SUBMIT_ERRORS: Responses = {
    **ERRORS,
    409: {"description": "IdempotencyConflict: the Idempotency-Key was first used with another batch."},
    413: {"description": "RequestTooLarge: the body is over SWARMBATCH_MAX_FILE_BYTES (+64 KiB for the form); "
                         "refused before it is read, or as soon as a streamed body passes the limit."},
    429: {"description": "TooManySubmissions: SWARMBATCH_MAX_CONCURRENT_SUBMISSIONS are in progress; "
                         "retry after Retry-After seconds."}}
MAX_IDEMPOTENCY_KEY_CHARS = 255  # stored as api:<key id>:<key> in jobs.idempotency_key, a String(300)
NOT_FOUND: Responses = {404: {"description": "JobNotFound: no such job for this API key."}}
STREAMED: Responses = {200: {"content": {JSONL: {}}, "description": "One JSON line per request, in input order."}}


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
                 _slot: SubmissionSlotDep, submission: SubmissionDep, runtime: RuntimeDep, session: SessionDep,
                 response: Response) -> dict[str, Any]:
    """Submit a JSONL batch (multipart `file` + `model`) or inline requests (JSON); returns the queued job.

    With an `Idempotency-Key` header, a repeat of the same batch returns the first job (with the response header
    `Idempotent-Replayed: true`); the same key with another batch is a 409.
    """
    # the key, then a submission slot, come first among the parameters: an anonymous caller is refused, and a
    # caller over the concurrency bound gets its 429, before the body is read
    require_served_model(runtime.settings, submission.model)  # before any lookup of the model on this server
    submitted = submit(runtime, submission.data, model=submission.model, filename=submission.filename,
                       api_key_id=key.id, completion_window=submission.completion_window,
                       metadata=submission.metadata, idempotency_key=scoped_key)
    if submitted.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return outputs.job_public(session=session, job=store.get_job(session=session, job_id=submitted.job.id))


@router.get("")
def list_batches(session: SessionDep, key: ApiKeyDep, limit: int = Query(default=20, ge=1, le=100)
                 ) -> dict[str, Any]:
    """The key's jobs, newest first."""
    jobs = store.list_jobs(session=session, api_key_id=key.id, limit=limit)
    return {"object": "list", "data": [outputs.job_public(session=session, job=job) for job in jobs]}


@router.get("/{job_id}", responses=NOT_FOUND)
def get_batch(job_id: str, session: SessionDep, key: ApiKeyDep) -> dict[str, Any]:
    """One job: status, request counts, line errors, timestamps."""
    return outputs.job_public(session=session, job=store.get_job(session=session, job_id=job_id, api_key_id=key.id))


@router.get("/{job_id}/results", response_class=StreamingResponse, responses={**STREAMED, **NOT_FOUND})
def get_results(job_id: str, session: SessionDep, key: ApiKeyDep) -> StreamingResponse:
    """Output lines of the finished requests, in input order (partial while the job runs)."""
    job = store.get_job(session=session, job_id=job_id, api_key_id=key.id)
    return StreamingResponse(outputs.iter_results(session=session, job=job), media_type=JSONL)


@router.get("/{job_id}/errors", response_class=StreamingResponse, responses={**STREAMED, **NOT_FOUND})
def get_errors(job_id: str, session: SessionDep, key: ApiKeyDep) -> StreamingResponse:
    """Input line errors, then failed requests, as JSON lines."""
    job = store.get_job(session=session, job_id=job_id, api_key_id=key.id)
    return StreamingResponse(outputs.iter_errors(session=session, job=job), media_type=JSONL)


@router.post("/{job_id}/cancel", responses=NOT_FOUND)
def cancel_batch(job_id: str, session: SessionDep, key: ApiKeyDep, runtime: RuntimeDep) -> dict[str, Any]:
    """Cancel: pending requests stop now, running ones at their next checkpoint; finished outputs are kept."""
    job = runtime.lifecycle.cancel(session, job_id, api_key_id=key.id)
    session.commit()
    return outputs.job_public(session=session, job=job)
