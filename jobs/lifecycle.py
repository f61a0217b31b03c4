"""Job transitions, owned here: every caller moves a job through `Lifecycle`, and its kind's hooks run on every path.

                 start                    settle: every request terminal
  validating ─────────────▶ in_progress ─────────────────────────────▶ finalizing ──▶ completed | failed
       │                        │
       └────────cancel──────────┴──────▶ cancelling ──settle: nothing runs──▶ cancelled
  validating | in_progress | cancelling ────expire: the deadline passed────▶ expired

OpenAI's statuses: a job is `validating` from its submission until a worker claims its first requests. Its lines
are checked either before it is stored (the CLI, the demo, a schedule's firing) or after, off the request, by a
worker (the REST API: jobs.ingest), which adds the requests and line errors as it goes: then `validated` marks the
end of the check, and no worker claims a request of the job before it (so a file that fails as a whole runs no
line, as with OpenAI), nor is the job settled: a job still being checked is not finished for lack of requests.
`fail_validation` ends a job whose file fails as a whole (too many lines, not UTF-8, a model not served) with the
reason as its error, and no request. A job that ends gets its output and error files (jobs.files) in the same
transaction, partial ones for a cancelled or expired job, as OpenAI does.

The callers: the API's cancel route and the CLI's StoreBackend (cancel), the batch worker (start, settle, and
expire when it finds a job overdue), the sweep (settle, expire, and the retries below), and a schedule's firing
(settle, for a night with nothing to summarize). None of them changes a job's status any other way, so none can
skip a hook (as rq's on_success/on_failure/on_stopped callbacks and dramatiq's middleware run whoever ends a job).

Hooks, by job kind (`JobHooks`; `Runtime.lifecycle` registers one per JobKind):
    on_settling   before a live job is settled (a summary job adds its next map-reduce stage)
    on_ended      once the job is terminal, on the very path that ended it (a summary job writes its pages)
    due_retries   ended jobs whose on_ended failed and is due again (the sweep runs them; the hook bounds them)

Like the store, nothing here commits: the caller's unit of work does, so a transition and its hook's writes are
committed together (a hook that can fail records its failure instead of raising; see jobs.summaries.pages).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from jobs import files, store
from jobs.models import Job, JobKind, JobStatus, utcnow

logger = logging.getLogger(__name__)

LIVE = (JobStatus.validating, JobStatus.in_progress)  # statuses in which a job still takes work


class JobHooks:
    """What a job kind adds to the lifecycle; this base adds nothing (a user's batch)."""

    def on_settling(self, session: Session, job: Job) -> None:
        """Called before a live (validating or in_progress) job is settled."""

    def on_ended(self, session: Session, job: Job, now: datetime) -> None:
        """Called once the job reached a terminal status, in the transaction that moved it there."""

    def due_retries(self, session: Session, now: datetime) -> list[str]:
        """Ended jobs whose on_ended must run again now (an earlier run recorded a failure)."""
        return []


class Lifecycle:
    """The one way a job changes status; runs the hooks of the job's kind."""

    def __init__(self, hooks: Mapping[JobKind, JobHooks]) -> None:
        missing = sorted(set(JobKind) - set(hooks))
        if missing:  # a kind without hooks would be a path that skips them
            raise ValueError(f"no lifecycle hooks for job kinds {', '.join(missing)}")
        self.hooks = dict(hooks)

    def validated(self, session: Session, job: Job, *, now: datetime | None = None) -> None:
        """The check of a job's lines (jobs.ingest) is done: workers may take its requests; a job without any (every
        line bad, or none) fails, its line errors saying why."""
        job.ingest_offset = None
        if job.status == JobStatus.validating and not store.job_counts(session=session, job_id=job.id).total:
            self._end(session, job, JobStatus.failed, now or utcnow())

    def fail_validation(self, session: Session, job: Job, error: dict[str, Any], *,
                        now: datetime | None = None) -> None:
        """The job's file fails as a whole (`error`: OpenAI's batch error, `line` None when no line is at fault): its
        requests are dropped and the job fails with that error."""
        job.ingest_offset = None
        if job.status.terminal:
            return
        store.delete_requests(session=session, job_id=job.id)
        job.line_errors = [error]
        self._end(session, job, JobStatus.failed, now or utcnow())

    def start(self, session: Session, job: Job, *, now: datetime | None = None) -> None:
        """A worker claimed the job's first requests: validating -> in_progress."""
        if job.status == JobStatus.validating:
            move(job, JobStatus.in_progress, now=now)

    def settle(self, session: Session, job: Job, *, now: datetime | None = None) -> None:
        """Move a job on once its requests allow it: finalize when all are terminal, cancel when none runs."""
        now = now or utcnow()
        if job.status in LIVE:
            self.hooks[job.kind].on_settling(session, job)
        counts = store.job_counts(session=session, job_id=job.id)
        if job.status == JobStatus.cancelling and counts.in_progress == 0:
            # requests whose worker died after the cancel came back to pending through the sweep: cancel them too
            store.cancel_pending_requests(session=session, job_id=job.id, now=now)
            self._end(session, job, JobStatus.cancelled, now)
        elif job.status in LIVE and not checking_lines(job) and counts.pending + counts.in_progress == 0:
            self._finalize(session, job, failed_all=counts.completed == 0 and counts.failed > 0, now=now)

    def cancel(self, session: Session, job_id: str, *, api_key_id: int | None = None,
               now: datetime | None = None) -> Job:
        """Start cancelling a job (only the key's, when a key is given); raises JobNotFound.

        Pending requests stop now, running ones at their next checkpoint; a job with nothing running ends at once.
        """
        job = store.get_job(session=session, job_id=job_id, api_key_id=api_key_id)
        if job.status.terminal or job.status == JobStatus.cancelling:
            return job
        now = now or utcnow()
        move(job, JobStatus.cancelling, now=now)
        store.cancel_pending_requests(session=session, job_id=job.id, now=now)
        self.settle(session, job, now=now)
        return job

    def expire(self, session: Session, job: Job, *, now: datetime | None = None) -> None:
        """The deadline passed: unfinished requests expire (keeping partial output), finished results stay."""
        if job.status.terminal:
            return
        now = now or utcnow()
        store.expire_open_requests(session=session, job_id=job.id, now=now)
        self._end(session, job, JobStatus.expired, now)

    def ended_due(self, session: Session, now: datetime) -> list[str]:
        """Ended jobs whose on_ended hook failed before and is due again (the sweep retries each: retry_ended)."""
        return [job_id for hooks in self.hooks.values() for job_id in hooks.due_retries(session, now)]

    def retry_ended(self, session: Session, job_id: str, *, now: datetime | None = None) -> bool:
        """Run a failed on_ended hook of an ended job again; returns whether it ran."""
        job = session.get(Job, job_id)
        if job is None or not job.status.terminal:
            return False
        self.hooks[job.kind].on_ended(session, job, now or utcnow())
        return True

    def _finalize(self, session: Session, job: Job, *, failed_all: bool, now: datetime) -> None:
        move(job, JobStatus.finalizing, now=now)
        job.blocked_reason = None
        self._end(session, job, JobStatus.failed if failed_all else JobStatus.completed, now)

    def _end(self, session: Session, job: Job, status: JobStatus, now: datetime) -> None:
        move(job, status, now=now)
        job.ingest_offset = None  # an ended job has no lines left to check (a check under way stops at its next commit)
        files.attach_job_files(session=session, job=job, now=now)
        self.hooks[job.kind].on_ended(session, job, now)


def checking_lines(job: Job) -> bool:
    """Whether the job's lines are still being checked (jobs.ingest): then no worker may claim its requests yet."""
    return job.ingest_offset is not None


def move(job: Job, status: JobStatus, *, now: datetime | None = None) -> None:
    """Set a job's status and stamp `<status>_at` (one log line per transition); only Lifecycle calls it."""
    if job.status == status:
        return
    logger.info("Job %s: %s -> %s", job.id, job.status, status)
    job.status = status
    stamp = f"{status}_at"
    if hasattr(job, stamp):
        setattr(job, stamp, now or utcnow())
