"""`/v1/batches`: submit, list, inspect, read results and errors of, and cancel the caller's jobs."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from jobs import outputs, store
from jobs.api.batch_request import REQUEST_BODY, SubmissionDep
from jobs.api.deps import ApiKeyDep, RuntimeDep, SessionDep, require_served_model
from jobs.submission import submit_batch

router = APIRouter(prefix="/v1/batches", tags=["batches"])

JSONL = "application/jsonl"
Responses = dict[int | str, dict[str, Any]]
ERRORS: Responses = {400: {"description": "InvalidJob: the batch is refused whole (a bad body, a model the operator "
                                          "does not serve, no good line); nothing was created."},
          401: {"description": "No API key, or an unknown one."}}
NOT_FOUND: Responses = {404: {"description": "JobNotFound: no such job for this API key."}}
STREAMED: Responses = {200: {"content": {JSONL: {}}, "description": "One JSON line per request, in input order."}}


@router.post("", openapi_extra=REQUEST_BODY, responses=ERRORS)
def create_batch(key: ApiKeyDep, submission: SubmissionDep, runtime: RuntimeDep, session: SessionDep
                 ) -> dict[str, Any]:
    """Submit a JSONL batch (multipart `file` + `model`) or inline requests (JSON); returns the queued job."""
    # the key comes first among the parameters, so an anonymous caller is refused before its body is read
    require_served_model(runtime.settings, submission.model)  # before any lookup of the model on this server
    job = submit_batch(runtime, submission.data, model=submission.model, filename=submission.filename,
                       api_key_id=key.id, completion_window=submission.completion_window,
                       metadata=submission.metadata)
    return outputs.job_public(session=session, job=store.get_job(session=session, job_id=job.id))


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
