"""Results and errors as the OpenAI Batch API writes them (one JSON line per request, in input order), and the
batch object. The output and error files of the Files API (jobs.files) are these very lines."""
from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from jobs import liveness
from jobs.batch_input import CHAT_URL, EMBEDDINGS_URL, RESPONSES_URL
from jobs.db import SessionScope
from jobs.errors import OutputsExpired
from jobs.models import Job, JobKind, Request, RequestStatus
from jobs.store import JobCounts, job_counts, job_usage

OUTPUT_STATUSES = (RequestStatus.completed, RequestStatus.cancelled, RequestStatus.expired)
FINISH_REASONS = ("stop", "length")  # OpenAI's; an output cut short by a cancel or the deadline reads "length"
# what an unfinished request without output says in the error file when its job was cancelled or expired
UNFINISHED = {RequestStatus.cancelled: ("batch_cancelled", "the batch was cancelled before this request ran"),
              RequestStatus.expired: ("batch_expired", "the batch's completion window ended before this request ran")}
ROWS_PER_READ = 200  # requests read per page while streaming a file: memory stays this many rows


def response_body(job: Job, line: list[Request]) -> dict[str, Any]:
    """A line's response body: a chat.completion or text_completion object for a line's requests, one choice each
    (partial when cancelled/expired); a list of embeddings, one per input; or a Responses object."""
    first = line[0]
    url = first.body.get("url")
    if url == EMBEDDINGS_URL:
        return embeddings_body(job, line)
    if url == RESPONSES_URL:
        return responses_body(job, first)
    created = int(max((r.completed_at or r.created_at) for r in line).timestamp())
    completion_tokens = sum(len(r.generated_ids) for r in line)
    usage = {"prompt_tokens": len(first.prompt_ids), "completion_tokens": completion_tokens,
             "total_tokens": len(first.prompt_ids) + completion_tokens}
    chat = first.body.get("url") == CHAT_URL
    choices = [_choice(request, chat=chat) for request in line]
    if chat:
        return {"id": f"chatcmpl-{first.id}", "object": "chat.completion", "created": created, "model": job.model,
                "choices": choices, "usage": usage}
    return {"id": f"cmpl-{first.id}", "object": "text_completion", "created": created, "model": job.model,
            "choices": choices, "usage": usage}


def embeddings_body(job: Job, line: list[Request]) -> dict[str, Any]:
    """OpenAI's embeddings list: each input's vector as floats, or as base64 of its float32 little-endian bytes."""
    as_base64 = line[0].body.get("encoding_format") == "base64"
    data = [{"object": "embedding", "index": request.choice,
             "embedding": _vector(request.embedding or b"", as_base64=as_base64)} for request in line]
    tokens = sum(request.prompt_count for request in line)
    return {"object": "list", "data": data, "model": job.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _vector(stored: bytes, *, as_base64: bool) -> list[float] | str:
    if as_base64:
        return base64.b64encode(stored).decode()
    return list(struct.unpack(f"<{len(stored) // 4}f", stored))


# a Responses object's status and incomplete_details, by how its request ended (cut by a cancel: cancelled)
RESPONSE_ENDS: dict[str | None, tuple[str, dict[str, Any] | None]] = {
    "stop": ("completed", None), "length": ("incomplete", {"reason": "max_output_tokens"}),
    "cancelled": ("cancelled", None)}


def responses_body(job: Job, request: Request) -> dict[str, Any]:
    """The Responses API's response object of a /v1/responses line: one assistant message of output_text, its usage,
    and the request's parameters echoed (the line's body, as jobs.line_responses stored it)."""
    body = request.body
    status, incomplete = RESPONSE_ENDS.get(request.finish_reason, ("incomplete", {"reason": None}))
    created = int(request.created_at.timestamp())
    output_tokens = len(request.generated_ids)
    message = {"type": "message", "id": f"msg_{request.id}", "status": "completed" if status == "completed"
               else "incomplete", "role": "assistant",
               "content": [{"type": "output_text", "text": request.output_text or "", "annotations": [],
                            "logprobs": []}]}
    return {"id": f"resp_{request.id}", "object": "response", "created_at": created,
            "completed_at": unix(request.completed_at), "status": status, "error": None,
            "incomplete_details": incomplete, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": job.model, "output": [message],
            "parallel_tool_calls": True, "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "store": False, "temperature": request.temperature, "top_p": request.top_p,
            "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": "none", "tools": [],
            "truncation": "disabled", "user": body.get("user"), "metadata": body.get("metadata") or {},
            "usage": {"input_tokens": request.prompt_count,
                      "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": request.prompt_count + output_tokens}}


def _choice(request: Request, *, chat: bool) -> dict[str, Any]:
    """One choice: its index among the line's n, its text or message, why it ended, and its logprobs (if asked)."""
    finish = request.finish_reason if request.finish_reason in FINISH_REASONS else "length"
    text = request.output_text or ""
    output: dict[str, Any] = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    entries = request.generated_logprobs if request.top_logprobs is not None else None
    logprobs = None if entries is None else chat_logprobs(entries) if chat else completion_logprobs(entries)
    return {"index": request.choice, **output, "finish_reason": finish, "logprobs": logprobs}


def chat_logprobs(entries: list[Any]) -> dict[str, Any]:
    """A chat choice's logprobs, OpenAI's shape, from the stored [text, logprob, [[text, logprob], ...]] entries."""
    def token(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**token(text, logprob), "top_logprobs": [token(t, lp) for t, lp in top]}
                        for text, logprob, top in entries], "refusal": None}


def completion_logprobs(entries: list[Any]) -> dict[str, Any]:
    """A text completion choice's logprobs, OpenAI's legacy shape (tokens, token_logprobs, top_logprobs, text_offset)."""
    offsets, at = [], 0
    for text, _, _ in entries:
        offsets.append(at)
        at += len(text)
    return {"tokens": [text for text, _, _ in entries], "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": [{t: lp for t, lp in top} for _, _, top in entries], "text_offset": offsets}


def result_line(job: Job, line: list[Request]) -> dict[str, Any]:
    """One output line: {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}."""
    first = line[0]
    return {"id": f"batch_req_{first.id}", "custom_id": first.custom_id,
            "response": {"status_code": 200, "request_id": f"req_{first.id}", "body": response_body(job, line)},
            "error": None}


def error_line(job: Job, line: list[Request]) -> dict[str, Any]:
    """One error line: for a line with a failed request, or cancelled or expired ones that produced nothing."""
    failed = next((r for r in line if r.status == RequestStatus.failed), None)
    first = failed or line[0]
    code, message = UNFINISHED.get(first.status, ("request_failed", first.last_error or "failed"))
    return {"id": f"batch_req_{first.id}", "custom_id": first.custom_id, "response": None,
            "error": {"code": code, "message": message, "param": None, "line": first.line_number}}


def line_error(error: dict[str, Any]) -> dict[str, Any]:
    """A stored input line error (jobs.batch_input.LineError) as OpenAI's batch error: code, message, param, line."""
    return {"code": error["code"], "message": error["message"], "param": error.get("param"),
            "line": error["line_number"]}


def iter_results(*, sessions: SessionScope, job: Job) -> Iterator[str]:
    """JSONL of finished lines in input order (partial outputs of cancelled/expired requests included)."""
    for line in _lines(sessions, job, OUTPUT_STATUSES):
        if _outcome(line) == "output":
            yield json.dumps(result_line(job, line)) + "\n"


def iter_errors(*, sessions: SessionScope, job: Job) -> Iterator[str]:
    """JSONL of input line errors (by line number), then lines with a failed request, or whose cancelled or
    expired requests produced nothing, in input order."""
    for error in job.line_errors:
        yield json.dumps({"id": None, "custom_id": error.get("custom_id"), "response": None,
                          "error": line_error(error)}) + "\n"
    for line in _lines(sessions, job, (RequestStatus.failed, *UNFINISHED)):
        if _outcome(line) == "error":
            yield json.dumps(error_line(job, line)) + "\n"


def _lines(sessions: SessionScope, job: Job, statuses: tuple[RequestStatus, ...]) -> Iterator[list[Request]]:
    """The requests of the job's lines that have one in `statuses`, a line's choices together, in input order.

    Read ROWS_PER_READ at a time, each page after the last index of the one before (keyset) in a session of its
    own from `sessions`: a client that stops reading holds no connection, and memory stays one page. OutputsExpired
    when the outputs are deleted meanwhile (their file deleted, their retention passed): a download ends short
    rather than going on with emptied lines. (The job's mark is read after the page: a deletion that emptied the
    page had committed before that read.)
    """
    wanted = select(Request.custom_id).where(Request.job_id == job.id, Request.status.in_(statuses))
    query = (select(Request).where(Request.job_id == job.id, Request.custom_id.in_(wanted)).order_by(Request.index)
             .limit(ROWS_PER_READ))
    line: list[Request] = []
    after = -1
    while True:
        with sessions() as session:
            page = list(session.scalars(query.where(Request.index > after)))
            if session.scalar(select(Job.outputs_expired_at).where(Job.id == job.id)) is not None:
                raise OutputsExpired(f"the outputs of batch {job.id} were deleted while they were read")
        for request in page:
            if line and request.custom_id != line[0].custom_id:
                yield line
                line = []
            line.append(request)
        if len(page) < ROWS_PER_READ:
            break
        after = page[-1].index
    if line:
        yield line


def _outcome(line: list[Request]) -> str | None:
    """Where a line goes once all its requests are terminal: the output file or the error file (None before)."""
    if not all(r.status.terminal for r in line):
        return None
    if any(r.status == RequestStatus.failed for r in line):
        return "error"
    has_output = all(r.status == RequestStatus.completed for r in line) or any(r.generated_ids for r in line)
    return "output" if has_output else "error"


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
    """The batch object of the REST API: OpenAI's fields (`usage` included), plus ours (tokens_generated, blocked_reason,
    input_filename, summary, verification: the checked outputs' counts, docs/security.md "Checked outputs", and pipeline: per
    worker, the batch it sized for itself, docs/jobs.md "Throughput")."""
    counts = job_counts(session=session, job_id=job.id)
    window = job.completion_window_s
    return {
        # the model (and endpoint) of a batch made from an uploaded file are read from its lines: null until then
        "id": job.id, "object": "batch", "endpoint": job.endpoint, "model": job.model or None, "status": str(job.status),
        "input_file_id": job.input_file_id, "output_file_id": job.output_file_id,
        "error_file_id": job.error_file_id, "input_filename": job.input_filename,
        "completion_window": f"{window // 3600}h" if window % 3600 == 0 else f"{window}s",
        "request_counts": {"total": counts.total, "completed": counts.completed, "failed": counts.failed},
        "usage": job_usage(session=session, job_id=job.id),
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
