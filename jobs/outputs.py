"""Results and errors as the OpenAI Batch API writes them (one JSON line per request, in input order), and the
batch object. The output and error files of the Files API (jobs.files) are these very lines."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from jobs import liveness
from jobs.batch_input import CHAT_URL
from jobs.models import Job, JobKind, Request, RequestStatus
from jobs.store import JobCounts, job_counts

OUTPUT_STATUSES = (RequestStatus.completed, RequestStatus.cancelled, RequestStatus.expired)


def response_body(job: Job, request: Request) -> dict[str, Any]:
    """A chat.completion or text_completion object for a request's output (partial when cancelled/expired)."""
    created = int((request.completed_at or request.created_at).timestamp())
    finish = request.finish_reason or ("cancelled" if request.status == RequestStatus.cancelled else "length")
    text = request.output_text or ""
    usage = {"prompt_tokens": len(request.prompt_ids), "completion_tokens": len(request.generated_ids),
             "total_tokens": len(request.prompt_ids) + len(request.generated_ids)}
    if request.body.get("url") == CHAT_URL:
        return {"id": f"chatcmpl-{request.id}", "object": "chat.completion", "created": created, "model": job.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": finish}], "usage": usage}
    return {"id": f"cmpl-{request.id}", "object": "text_completion", "created": created, "model": job.model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": usage}


def result_line(job: Job, request: Request) -> dict[str, Any]:
    """One output line: {"id", "custom_id", "response": {"status_code", "body"}, "error"}."""
    return {"id": f"batch_req_{request.id}", "custom_id": request.custom_id,
            "response": {"status_code": 200, "request_id": f"req_{request.id}", "body": response_body(job, request)},
            "error": None}


# what an unfinished request without output says in the error file when its job was cancelled or expired
UNFINISHED = {RequestStatus.cancelled: ("batch_cancelled", "the batch was cancelled before this request ran"),
              RequestStatus.expired: ("batch_expired", "the batch's completion window ended before this request ran")}
ROWS_PER_READ = 200  # requests read per round trip while streaming a file: memory stays this many rows


def error_line(job: Job, request: Request) -> dict[str, Any]:
    """One error line for a failed request, or for a cancelled or expired one that produced nothing."""
    code, message = UNFINISHED.get(request.status, ("request_failed", request.last_error or "failed"))
    return {"id": f"batch_req_{request.id}", "custom_id": request.custom_id, "response": None,
            "error": {"code": code, "message": message, "param": None, "line": request.line_number}}


def line_error(error: dict[str, Any]) -> dict[str, Any]:
    """A stored input line error (jobs.batch_input.LineError) as OpenAI's batch error: code, message, param, line."""
    return {"code": error["code"], "message": error["message"], "param": error.get("param"),
            "line": error["line_number"]}


def iter_results(*, session: Session, job: Job) -> Iterator[str]:
    """JSONL of finished outputs in input order (partial outputs of cancelled/expired requests included)."""
    query = select(Request).where(Request.job_id == job.id, Request.status.in_(OUTPUT_STATUSES)).order_by(Request.index)
    for request in session.scalars(query.execution_options(yield_per=ROWS_PER_READ)):
        if _has_output(request):
            yield json.dumps(result_line(job, request)) + "\n"


def iter_errors(*, session: Session, job: Job) -> Iterator[str]:
    """JSONL of input line errors (by line number), then failed requests, and cancelled or expired ones that
    produced nothing, in input order."""
    for error in job.line_errors:
        yield json.dumps({"id": None, "custom_id": error.get("custom_id"), "response": None,
                          "error": line_error(error)}) + "\n"
    query = select(Request).where(Request.job_id == job.id, Request.status.in_(
        [RequestStatus.failed, *UNFINISHED])).order_by(Request.index)
    for request in session.scalars(query.execution_options(yield_per=ROWS_PER_READ)):
        if request.status == RequestStatus.failed or not _has_output(request):
            yield json.dumps(error_line(job, request)) + "\n"


def _has_output(request: Request) -> bool:
    """A completed request, or a cancelled or expired one with partial output (it goes to the output file)."""
    return request.status == RequestStatus.completed or (request.status != RequestStatus.failed and
                                                         bool(request.generated_ids))


def unix(value: Any) -> int | None:
    """A datetime as unix seconds (None stays None)."""
    return int(value.timestamp()) if value is not None else None


def blocked_reason(*, session: Session, job: Job, counts: JobCounts) -> str | None:
    """What keeps the job from moving: no live worker for waiting work, else what the workers recorded."""
    if counts.waiting_for_a_worker(job) and liveness.live_workers(session=session) == 0:
        seen = liveness.last_heartbeat(session=session)
        since = f"the last one was seen {seen:%Y-%m-%d %H:%M:%S} UTC" if seen else "none has run"
        return f"no worker is running ({since}); start one with 'swarmbatch worker'"
    return job.blocked_reason


def summary_public(job: Job) -> dict[str, Any] | None:
    """A summary job's own facts (None for a batch): its schedule and period, documents, and its pages' state."""
    if job.kind != JobKind.summary or job.summary is None:  # a batch never loads the relationship
        return None
    run = job.summary
    return {"schedule": run.schedule, "period": run.period, "output": run.output_dir,
            "documents": len(run.documents), "skipped": run.skipped,
            "pages_written_at": unix(run.pages_written_at), "pages_error": run.pages_error}


def job_public(*, session: Session, job: Job) -> dict[str, Any]:
    """The batch object of the REST API: OpenAI's fields, plus ours (tokens_generated, blocked_reason,
    input_filename, summary, verification: the checked outputs' counts, README "Checked outputs", and pipeline: per
    worker, the batch it sized for itself, README "Throughput")."""
    counts = job_counts(session=session, job_id=job.id)
    window = job.completion_window_s
    return {
        "id": job.id, "object": "batch", "endpoint": job.endpoint, "model": job.model, "status": str(job.status),
        "input_file_id": job.input_file_id, "output_file_id": job.output_file_id,
        "error_file_id": job.error_file_id, "input_filename": job.input_filename,
        "completion_window": f"{window // 3600}h" if window % 3600 == 0 else f"{window}s",
        "request_counts": {"total": counts.total, "completed": counts.completed, "failed": counts.failed},
        "tokens_generated": counts.tokens, "blocked_reason": blocked_reason(session=session, job=job, counts=counts),
        "errors": {"object": "list", "data": [line_error(e) for e in job.line_errors]} if job.line_errors else None,
        "created_at": unix(job.created_at), "in_progress_at": unix(job.in_progress_at),
        "finalizing_at": unix(job.finalizing_at), "completed_at": unix(job.completed_at),
        "failed_at": unix(job.failed_at), "cancelling_at": unix(job.cancelling_at),
        "cancelled_at": unix(job.cancelled_at), "expires_at": unix(job.expires_at), "expired_at": unix(job.expired_at),
        "metadata": job.metadata_json, "summary": summary_public(job),
        "verification": {"steps_verified": job.steps_verified, "mismatches": job.verification_mismatches,
                         "steps_unverified": job.steps_unverified},
        "pipeline": job.pipeline if not job.status.terminal else {},
    }
