"""The jobs store: keyword-only functions over a SQLAlchemy session. SQL holds the truth; these are its verbs.

Job status moves only through jobs.lifecycle (settle, cancel, expire), which calls the request-level verbs here.

Transactions: no function here commits or rolls back. Writers change the session's transaction (flushing
where they need ids); the caller, the unit of work (an API route, one step of a worker, a CLI command, each in
its own `runtime.session()`), commits, and nothing is visible to other sessions or durable before it does.
Writes to leased rows (claims, checkpoints, renewals, releases) hold row locks until that commit, so their
callers commit at once: other workers never wait on a running batch, and a lease is durable before the
generation it guards starts.

Claims use leases: a worker owns a request while `lease_token` is its token and `lease_expires_at` is in the
future; every write by a worker is fenced by that token, so a worker whose lease was taken over writes
nothing. On PostgreSQL claims lock rows with FOR UPDATE SKIP LOCKED; on SQLite the single writer lock and the
status re-check in the UPDATE give the same guarantee.
"""
from __future__ import annotations

import hashlib
import logging
import secrets
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, case, delete, func, insert, or_, select, update
from sqlalchemy.orm import Session

from jobs.batch_input import ParsedBatch, ParsedRequest
from jobs.errors import ApiKeyNotFound, JobNotFound
from jobs.models import ApiKey, Job, JobKind, JobStatus, Request, RequestStatus, utcnow

logger = logging.getLogger(__name__)


# ---- jobs ---------------------------------------------------------------------------------------------------
def create_job(*, session: Session, parsed: ParsedBatch | None, model: str, api_key_id: int | None = None,
               completion_window_s: int = 24 * 3600, checkpoint_every: int = 8, input_filename: str | None = None,
               idempotency_key: str | None = None, metadata: dict[str, Any] | None = None,
               annotations: Mapping[str, dict[str, Any]] | None = None, kind: JobKind = JobKind.batch,
               input_file_id: str | None = None, endpoint: str = "") -> Job:
    """Insert a validating job and one pending request per good line of `parsed`.

    Without `parsed`, the job's lines are still to be checked (jobs.ingest, from its input file): it has no request
    yet, and `model` and `endpoint` may be "" until the check reads them from the lines.
    `metadata` is the user's (validated by the caller); `kind` picks the job's lifecycle hooks; `annotations`
    sets extra Request columns (document, stage, final) by custom_id.
    """
    now = utcnow()
    job = Job(id=f"batch_{uuid.uuid4().hex[:24]}", api_key_id=api_key_id, model=model,
              endpoint=parsed.endpoint if parsed is not None else endpoint, status=JobStatus.validating, kind=kind,
              input_filename=input_filename, input_file_id=input_file_id,
              line_errors=[e.to_dict() for e in parsed.errors] if parsed is not None else [],
              checkpoint_every=checkpoint_every, completion_window_s=completion_window_s,
              idempotency_key=idempotency_key, metadata_json=metadata or {}, created_at=now,
              expires_at=now + timedelta(seconds=completion_window_s), ingest_offset=None if parsed else 0)
    job.requests = request_rows(parsed, annotations=annotations) if parsed is not None else []
    session.add(job)
    session.flush()
    if parsed is None:
        logger.info("Job %s stored (validating): its lines are checked off the request", job.id)
    else:
        logger.info("Job %s stored (validating): %d requests, %d bad lines", job.id, len(job.requests),
                    len(parsed.errors))
    return job


def request_rows(parsed: ParsedBatch, *, first_index: int = 0,
                 annotations: Mapping[str, dict[str, Any]] | None = None) -> list[Request]:
    """Pending Request rows for parsed lines, numbered from `first_index`: one per choice of each line (its `n`), or
    per input of an embeddings line (`choice` is the input's index, `prompt_ids` its tokens)."""
    annotations = annotations or {}
    return [Request(**values, **annotations.get(values["custom_id"], {}))
            for values in request_values(parsed.requests, first_index=first_index)]


def request_values(requests: list[ParsedRequest], *, first_index: int = 0) -> list[dict[str, Any]]:
    """The column values of the pending requests of parsed lines, numbered from `first_index`: a line's `n` choices
    one after the other, or the inputs of an embeddings line (`choice` is the input's index, `prompt_ids` its
    tokens)."""
    choices = [(r, choice, r.inputs[choice] if r.inputs is not None else r.prompt_ids)
               for r in requests for choice in range(r.n)]
    return [dict(index=i, line_number=r.line_number, custom_id=r.custom_id, choice=choice,
                 body={"url": r.url, **r.body}, prompt_ids=list(prompt), prompt_count=len(prompt),
                 max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
                 seed=choice_seed(r.seed, choice), stop=list(r.stop), top_logprobs=r.top_logprobs,
                 generated_logprobs=None if r.top_logprobs is None else [])
            for i, (r, choice, prompt) in enumerate(choices, first_index)]


def insert_requests(*, session: Session, job_id: str, requests: list[ParsedRequest], first_index: int) -> int:
    """Insert the pending requests of checked lines into a job, in one statement (no ORM objects: a validation
    inserts thousands at a time); returns how many rows (choices) were inserted."""
    rows = request_values(requests, first_index=first_index)
    if rows:
        now = utcnow()
        session.execute(insert(Request), [{**row, "job_id": job_id, "status": RequestStatus.pending,
                                           "generated_ids": [], "created_at": now} for row in rows])
    return len(rows)


def request_lines_of(*, session: Session, job_id: str) -> tuple[dict[str, int], int]:
    """A job's custom_ids with the line each came from, and the index its next request takes (a validation resumed
    part-way goes on from these)."""
    rows = session.execute(select(Request.custom_id, Request.line_number).where(Request.job_id == job_id,
                                                                                 Request.choice == 0)).all()
    next_index = session.scalar(select(func.coalesce(func.max(Request.index) + 1, 0)).where(Request.job_id == job_id))
    return {custom_id: line for custom_id, line in rows}, int(next_index or 0)


def main_endpoint(*, session: Session, job_id: str) -> str | None:
    """The url most of a job's lines use (on a tie, the first line's); None for a job without requests."""
    url = Request.body["url"].as_string()
    return session.scalar(select(url).where(Request.job_id == job_id, Request.choice == 0).group_by(url)
                          .order_by(func.count().desc(), func.min(Request.index)).limit(1))


def delete_requests(*, session: Session, job_id: str) -> None:
    """Delete a job's requests (a batch whose file fails as a whole keeps none of its lines)."""
    session.execute(delete(Request).where(Request.job_id == job_id))


SEED_MASK = 2**63 - 1
CHOICE_SEED_STEP = 0x9E3779B97F4A7C15  # the golden-ratio increment (splitmix64): choices' seeds far apart


def choice_seed(seed: int, choice: int) -> int:
    """The seed of a line's choice: the line's own for choice 0 (so n = 1 changes nothing), a fixed function of
    (seed, choice) for the others, so every choice samples differently and resumes exactly."""
    return (seed + choice * CHOICE_SEED_STEP) & SEED_MASK


def add_requests(*, session: Session, job: Job, parsed: ParsedBatch,
                 annotations: Mapping[str, dict[str, Any]] | None = None) -> list[Request]:
    """Append pending requests to a live job (later map-reduce stages)."""
    first = session.scalar(select(func.coalesce(func.max(Request.index) + 1, 0)).where(Request.job_id == job.id))
    rows = request_rows(parsed, first_index=int(first or 0), annotations=annotations)
    for row in rows:
        row.job_id = job.id
    session.add_all(rows)
    session.flush()
    logger.info("Job %s: added %d requests (%s)", job.id, len(rows), ", ".join(repr(r.custom_id) for r in rows))
    return rows


def get_job(*, session: Session, job_id: str, api_key_id: int | None = None) -> Job:
    """A job, if it exists and (when a key is given) belongs to that key; raises JobNotFound."""
    job = session.get(Job, job_id)
    if job is None or (api_key_id is not None and job.api_key_id != api_key_id):
        raise JobNotFound(job_id)
    return job


def latest_job_keyed(*, session: Session, key_prefix: str) -> Job | None:
    """The newest job whose idempotency key starts with `key_prefix` (`swarmbatch run` keys a file's jobs so)."""
    return session.scalars(select(Job).where(Job.idempotency_key.startswith(key_prefix, autoescape=True))
                           .order_by(Job.created_at.desc(), Job.id.desc()).limit(1)).first()


def list_jobs(*, session: Session, api_key_id: int | None = None, limit: int = 100) -> list[Job]:
    """Newest first; only the key's jobs when a key is given."""
    return page_jobs(session=session, api_key_id=api_key_id, limit=limit)[0]


def page_jobs(*, session: Session, api_key_id: int | None = None, limit: int = 100,
              after: str | None = None) -> tuple[list[Job], bool]:
    """Newest first, after the job `after` (a cursor: JobNotFound if it is not the key's); returns (page, has_more)."""
    query = select(Job)
    if api_key_id is not None:
        query = query.where(Job.api_key_id == api_key_id)
    if after is not None:
        cursor = get_job(session=session, job_id=after, api_key_id=api_key_id)
        query = query.where((Job.created_at < cursor.created_at) |
                            ((Job.created_at == cursor.created_at) & (Job.id < cursor.id)))
    rows = list(session.scalars(query.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


@dataclass(frozen=True)
class JobCounts:
    """Request counts of one job."""

    total: int
    completed: int
    failed: int
    pending: int
    in_progress: int
    tokens: int

    def waiting_for_a_worker(self, job: Job) -> bool:
        """Whether the live job has pending work that no worker holds, or lines still to check (jobs.ingest: a
        worker checks them, and its chain's dispatch hold says it is on it)."""
        live = job.status in (JobStatus.validating, JobStatus.in_progress)
        return live and (bool(self.pending) and not self.in_progress or job.ingest_offset is not None)


def job_counts(*, session: Session, job_id: str) -> JobCounts:
    """Counts of a job's lines (total, completed, failed: what OpenAI's request_counts count), of its requests
    (pending, in_progress: what workers still have to do), and generated tokens so far.

    A line of n choices is n requests: it is completed once all are, failed (or expired) once one is.
    """
    rows = session.execute(select(Request.status, Request.choice == 0, func.count()).where(Request.job_id == job_id)
                           .group_by(Request.status, Request.choice == 0)).all()
    by_status: dict[RequestStatus, int] = {}
    for status, _, count in rows:
        by_status[status] = by_status.get(status, 0) + count
    tokens = generated_tokens(session=session, job_id=job_id)
    pending, in_progress = by_status.get(RequestStatus.pending, 0), by_status.get(RequestStatus.in_progress, 0)
    if all(first for _, first, _ in rows):  # one choice per line: requests are lines
        return JobCounts(total=sum(by_status.values()), completed=by_status.get(RequestStatus.completed, 0),
                         failed=by_status.get(RequestStatus.failed, 0) + by_status.get(RequestStatus.expired, 0),
                         pending=pending, in_progress=in_progress, tokens=tokens)
    total = sum(count for _, first, count in rows if first)
    return JobCounts(total=total, completed=total - _lines_where(session, job_id, Request.status != RequestStatus.completed),
                     failed=_lines_where(session, job_id, Request.status.in_([RequestStatus.failed,
                                                                              RequestStatus.expired])),
                     pending=pending, in_progress=in_progress, tokens=tokens)


def _lines_where(session: Session, job_id: str, condition: Any) -> int:
    """How many of the job's lines have a request (a choice) matching `condition`."""
    return int(session.scalar(select(func.count(func.distinct(Request.custom_id)))
                              .where(Request.job_id == job_id, condition)) or 0)


def job_usage(*, session: Session, job_id: str) -> dict[str, Any]:
    """OpenAI's batch `usage`: the prompt tokens of every line that has output (counted once per line, as its
    response's usage counts them: its first choice's; every embedded input's), the tokens generated, their total; no
    JSON parsed."""
    started = ((Request.choice == 0) & (Request.generated_count > 0)) | Request.embedding.is_not(None)
    prompt, output = session.execute(
        select(func.coalesce(func.sum(case((started, Request.prompt_count), else_=0)), 0),
               func.coalesce(func.sum(Request.generated_count), 0)).where(Request.job_id == job_id)).one()
    return {"input_tokens": int(prompt), "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": int(output), "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": int(prompt) + int(output)}


def generated_tokens(*, session: Session, job_id: str | None = None) -> int:
    """Generated tokens of one job (or of all jobs): a sum of `generated_count`, no JSON parsed."""
    query = select(func.coalesce(func.sum(Request.generated_count), 0))
    if job_id is not None:
        query = query.where(Request.job_id == job_id)
    return int(session.scalar(query) or 0)


def cancel_pending_requests(*, session: Session, job_id: str, now: datetime | None = None) -> None:
    """Cancel a job's pending requests (its running ones stop at their next checkpoint); jobs.lifecycle calls it."""
    session.execute(update(Request).where(Request.job_id == job_id, Request.status == RequestStatus.pending)
                    .values(status=RequestStatus.cancelled, completed_at=now or utcnow()))


def expire_open_requests(*, session: Session, job_id: str, now: datetime | None = None) -> None:
    """Expire a job's unfinished requests, keeping partial output and fencing out their workers; jobs.lifecycle calls it."""
    session.execute(update(Request).where(Request.job_id == job_id, Request.status.in_(
        [RequestStatus.pending, RequestStatus.in_progress]))
        .values(status=RequestStatus.expired, lease_token=None, lease_owner=None, completed_at=now or utcnow(),
                last_error="the job's completion window ended"))


def hold_dispatch(*, session: Session, job: Job, seconds: float, now: datetime | None = None) -> bool:
    """Whether the caller may dispatch a process_job chain for `job` now; if so, no one else may for `seconds`.

    A conditional UPDATE, so of many sweeps running at once exactly one wins; a job thus has one pending chain
    from sweeps, not one more per sweep. (A sweep step retried after a commit whose answer was lost finds the job
    held and leaves it: it is dispatched a hold period later, at the cost of time, never of a second chain.)
    """
    now = now or utcnow()
    held = session.execute(update(Job).where(Job.id == job.id, or_(Job.dispatch_after.is_(None),
                                                                   Job.dispatch_after <= now))
                           .values(dispatch_after=now + timedelta(seconds=seconds)))
    if held.rowcount:  # type: ignore[attr-defined]
        session.refresh(job, ["dispatch_after"])
    return bool(held.rowcount)  # type: ignore[attr-defined]


def refresh_dispatch_hold(*, session: Session, job: Job, seconds: float) -> None:
    """A chain of the job is alive (enqueued, claiming, or blocked and retrying): no sweep sends another for `seconds`."""
    job.dispatch_after = utcnow() + timedelta(seconds=seconds)


def release_dispatch_hold(*, session: Session, job_id: str) -> None:
    """No chain of the job is alive (its enqueue failed): the next sweep dispatches it at once."""
    session.execute(update(Job).where(Job.id == job_id).values(dispatch_after=None))


# ---- claims and checkpoints ----------------------------------------------------------------------------------
def claimable_requests(now: datetime, token: str | None = None) -> ColumnElement[bool]:
    """Requests a claim may take: pending, or in progress under a lease that expired. A row leased under `token` is
    already ours (a refill must not claim it again, even if it expired)."""
    expired = (Request.status == RequestStatus.in_progress) & (Request.lease_expires_at < now)
    if token is not None:
        expired = expired & (Request.lease_token != token)
    return (Request.status == RequestStatus.pending) | expired


def claim_requests(*, session: Session, job_id: str, worker: str, limit: int, lease_seconds: float,
                   max_attempts: int, now: datetime | None = None, token: str | None = None
                   ) -> tuple[str, list[Request]]:
    """Lease up to `limit` pending requests (or ones whose lease expired) to `worker`; returns (token, rows).

    Pass the `token` of an earlier claim to add the rows to it (continuous batching refills a running batch).
    """
    now = now or utcnow()
    token = token or secrets.token_hex(8)
    claimable = claimable_requests(now, token)
    ids = list(session.scalars(select(Request.id).where(Request.job_id == job_id, claimable)
                               .order_by(Request.index).limit(limit).with_for_update(skip_locked=True)))
    if not ids:
        return token, []
    session.execute(update(Request).where(Request.id.in_(ids), claimable).values(
        status=RequestStatus.in_progress, lease_owner=worker, lease_token=token,
        lease_expires_at=now + timedelta(seconds=lease_seconds), attempts=Request.attempts + 1,
        started_at=func.coalesce(Request.started_at, now)))
    rows = list(session.scalars(select(Request).where(Request.lease_token == token, Request.id.in_(ids))
                                .order_by(Request.index)))
    fail_exhausted(session=session, rows=rows, token=token, max_attempts=max_attempts)
    return token, [r for r in rows if r.status == RequestStatus.in_progress]


def next_request_sizes(*, session: Session, job_id: str, limit: int, now: datetime | None = None) -> list[int]:
    """Prompt + max_tokens (what a session reserves per row) of the requests a claim would take next, in its order."""
    claimable = claimable_requests(now or utcnow())
    rows = session.execute(select(Request.prompt_ids, Request.max_tokens).where(Request.job_id == job_id, claimable)
                           .order_by(Request.index).limit(limit))
    return [len(prompt) + max_tokens for prompt, max_tokens in rows]


def fail_exhausted(*, session: Session, rows: list[Request], token: str, max_attempts: int) -> None:
    """Requests claimed more than `max_attempts` times fail: a poison request cannot loop forever."""
    for row in rows:
        if row.attempts > max_attempts:
            finish_request(session=session, request_id=row.id, token=token, status=RequestStatus.failed,
                           error=row.last_error or f"gave up after {max_attempts} attempts")
            row.status = RequestStatus.failed


def checkpoint(*, session: Session, token: str, progress: dict[int, list[int]], lease_seconds: float,
               texts: dict[int, str] | None = None, logprobs: dict[int, list[Any]] | None = None) -> set[int]:
    """Write each owned request's generated ids (and text so far, and logprobs where asked) and renew its lease,
    in one transaction.

    Returns the ids still owned. The text keeps partial outputs readable if the job is cancelled or expires.
    """
    now = utcnow()
    owned: set[int] = set()
    for request_id, generated in progress.items():
        values: dict[str, Any] = dict(generated_ids=list(generated), generated_count=len(generated),
                                      lease_expires_at=now + timedelta(seconds=lease_seconds))
        if texts is not None and request_id in texts:
            values["output_text"] = texts[request_id]
        if logprobs is not None and request_id in logprobs:
            values["generated_logprobs"] = list(logprobs[request_id])
        result = session.execute(update(Request).where(
            Request.id == request_id, Request.lease_token == token, Request.status == RequestStatus.in_progress)
            .values(**values))
        if result.rowcount:  # type: ignore[attr-defined]
            owned.add(request_id)
    return owned


def add_verification(*, session: Session, job_id: str, verified: int, mismatches: int, unverified: int) -> None:
    """Add a batch's checked outputs to its job's counts (an atomic increment: workers of one job add at once)."""
    if verified or mismatches or unverified:
        session.execute(update(Job).where(Job.id == job_id).values(
            steps_verified=Job.steps_verified + verified,
            verification_mismatches=Job.verification_mismatches + mismatches,
            steps_unverified=Job.steps_unverified + unverified))


def renew_leases(*, session: Session, token: str, lease_seconds: float) -> int:
    """Extend every live lease of a claim (a worker that just joined the swarm); returns the rows still ours."""
    result = session.execute(update(Request).where(Request.lease_token == token,
                                                   Request.status == RequestStatus.in_progress)
                             .values(lease_expires_at=utcnow() + timedelta(seconds=lease_seconds)))
    return int(result.rowcount)  # type: ignore[attr-defined]


def finish_request(*, session: Session, request_id: int, token: str, status: RequestStatus,
                   generated: list[int] | None = None, finish_reason: str | None = None,
                   output_text: str | None = None, error: str | None = None, embedding: bytes | None = None) -> bool:
    """Record a request's end (with its embedding's bytes, for an embeddings request), if the lease is still ours;
    returns whether it was written."""
    values: dict[str, Any] = dict(status=status, finish_reason=finish_reason, output_text=output_text,
                                  completed_at=utcnow(), lease_token=None, lease_owner=None, lease_expires_at=None)
    if embedding is not None:
        values["embedding"] = embedding
    if generated is not None:
        values.update(generated_ids=list(generated), generated_count=len(generated))
    if error is not None:
        values["last_error"] = error
    written = session.execute(update(Request).where(Request.id == request_id, Request.lease_token == token)
                              .values(**values).returning(Request.job_id, Request.custom_id)).first()
    if written is not None:
        logger.info("Job %s request %s (%r): in_progress -> %s%s", written.job_id, request_id, written.custom_id,
                    status, f" ({finish_reason}, {len(generated)} tokens)" if generated is not None else
                    f": {error}" if error else "")
    return written is not None


def release_requests(*, session: Session, token: str, error: str, count_attempt: bool = True) -> None:
    """Give claimed requests back, keeping their committed tokens.

    `count_attempt=False` (missing blocks: nothing was tried) gives the claim's attempt back, so a job waiting
    for servers is bounded by its deadline, not by max_attempts.
    """
    released = session.execute(update(Request).where(Request.lease_token == token,
                                                     Request.status == RequestStatus.in_progress)
                               .values(status=RequestStatus.pending, lease_token=None, lease_owner=None,
                                       lease_expires_at=None, last_error=error,
                                       attempts=Request.attempts - (0 if count_attempt else 1))
                               .returning(Request.job_id, Request.id)).all()
    for row in released:
        logger.info("Job %s request %s: in_progress -> pending (%s)", row.job_id, row.id, error)


def lease_owners(*, session: Session) -> list[str]:
    """The workers holding requests in progress now (their lease owner names)."""
    return [owner for owner in session.scalars(select(Request.lease_owner).where(
        Request.status == RequestStatus.in_progress, Request.lease_owner.is_not(None)).distinct()) if owner]


def release_owned(*, session: Session, owners: Collection[str], error: str) -> list[str]:
    """Give back the requests leased by `owners` (worker names of processes known to be stopped), keeping their
    committed tokens and uncounting the claim, and lift their jobs' dispatch holds: the next sweep sends a worker at
    once, not a lease later. Returns the ids of the jobs affected."""
    released = session.execute(update(Request).where(Request.lease_owner.in_(list(owners)),
                                                     Request.status == RequestStatus.in_progress)
                               .values(status=RequestStatus.pending, lease_token=None, lease_owner=None,
                                       lease_expires_at=None, last_error=error, attempts=Request.attempts - 1)
                               .returning(Request.job_id)).all()
    job_ids = sorted({row.job_id for row in released})
    for job_id in job_ids:
        release_dispatch_hold(session=session, job_id=job_id)
    return job_ids


def leased_requests(*, session: Session, job_id: str, token: str) -> list[Request]:
    """The job's requests in progress under the lease `token` (a retried claim finds what it already took)."""
    return list(session.scalars(select(Request).where(Request.job_id == job_id, Request.status == RequestStatus.in_progress,
                                                      Request.lease_token == token).order_by(Request.index)))


def give_back_uncounted(*, session: Session, token: str, attempts: Mapping[int, int], error: str) -> None:
    """After a store outage stopped a batch: its requests go back to pending, and the claim is not counted.

    `attempts` is each request's attempt count as claimed. Those still leased under `token` are released;
    those whose lease lapsed during the outage, that the sweep returned and nobody claimed since (attempts
    unchanged), get the attempt back as well.
    """
    release_requests(session=session, token=token, error=error, count_attempt=False)
    for request_id, claimed in attempts.items():
        session.execute(update(Request).where(Request.id == request_id, Request.status == RequestStatus.pending,
                                              Request.lease_token.is_(None), Request.attempts == claimed)
                        .values(attempts=claimed - 1, last_error=error))


def expire_leases(*, session: Session, now: datetime | None = None) -> list[str]:
    """Return requests whose lease expired to pending; returns the ids of the jobs affected."""
    now = now or utcnow()
    stale = select(Request.id, Request.job_id).where(Request.status == RequestStatus.in_progress,
                                                     Request.lease_expires_at < now)
    rows = session.execute(stale).all()
    if rows:
        session.execute(update(Request).where(Request.id.in_([r.id for r in rows]),
                                              Request.status == RequestStatus.in_progress,
                                              Request.lease_expires_at < now)
                        .values(status=RequestStatus.pending, lease_token=None, lease_owner=None,
                                lease_expires_at=None))
        for row in rows:
            logger.info("Job %s request %s: in_progress -> pending (its lease expired: the worker died or stalled)",
                        row.job_id, row.id)
    return sorted({r.job_id for r in rows})


def active_job_ids(*, session: Session, api_key_id: int | None = None) -> list[str]:
    """Jobs that are not terminal (only the key's, when a key is given)."""
    live = [JobStatus.validating, JobStatus.in_progress, JobStatus.cancelling]
    query = select(Job.id).where(Job.status.in_(live))
    if api_key_id is not None:
        query = query.where(Job.api_key_id == api_key_id)
    return list(session.scalars(query.order_by(Job.created_at)))


# ---- API keys ---------------------------------------------------------------------------------------------------
def hash_key(key: str) -> str:
    """sha256 hex of an API key."""
    return hashlib.sha256(key.encode()).hexdigest()


def create_api_key(*, session: Session, name: str) -> tuple[ApiKey, str]:
    """A new key: returns the row and the plain key (shown once; only its hash is stored)."""
    plain = f"sb-{secrets.token_urlsafe(32)}"
    row = ApiKey(name=name, key_hash=hash_key(plain))
    session.add(row)
    session.flush()
    return row, plain


def find_api_key(*, session: Session, key: str) -> ApiKey | None:
    """The key's row, if the key is valid (known and not revoked)."""
    return session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None)))


def list_api_keys(*, session: Session) -> list[ApiKey]:
    """Every key, revoked ones included, oldest first."""
    return list(session.scalars(select(ApiKey).order_by(ApiKey.id)))


def revoke_api_key(*, session: Session, name_or_id: str, now: datetime | None = None) -> ApiKey:
    """Revoke a key named by its id or name (from its next request on, it gets 401); idempotent.

    A number is an id first. A name stands for its live key; raises ApiKeyNotFound when it names none
    (unless all its keys are revoked already: the latest is returned) or several.
    """
    key = _named_key(session, name_or_id)
    if key.revoked_at is None:
        key.revoked_at = now or utcnow()
        session.flush()
        logger.info("API key %d (%r) revoked", key.id, key.name)
    return key


def _named_key(session: Session, name_or_id: str) -> ApiKey:
    if name_or_id.isdigit() and (by_id := session.get(ApiKey, int(name_or_id))) is not None:
        return by_id
    named = list(session.scalars(select(ApiKey).where(ApiKey.name == name_or_id).order_by(ApiKey.id)))
    live = [key for key in named if key.revoked_at is None]
    if len(live) > 1:
        raise ApiKeyNotFound(f"{len(live)} live API keys are named {name_or_id!r} (ids "
                             f"{', '.join(str(key.id) for key in live)}); revoke one by its id")
    if live or named:
        return (live or named)[-1]
    raise ApiKeyNotFound(f"no API key {name_or_id!r}; list them with 'swarmbatch keys list'")
