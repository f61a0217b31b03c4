"""What a worker does with a job id: claim a batch under a lease, generate it, record the outcome.

Every step is idempotent: a redelivered or duplicated task finds the rows already claimed or finished and
does nothing twice.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from jobs import store
from jobs.errors import JobCancelled, LeaseLost
from jobs.models import Job, JobStatus, Request, RequestStatus, utcnow
from jobs.runtime import Runtime
from jobs.worker.runner import BatchRunner, Checkpoint, Refill
from swarmclient.errors import InvalidRequest, MissingBlocksError, SwarmError

logger = logging.getLogger(__name__)
# log lines that tests read (the request ids a worker claimed): job id, count, ids joined by ", "
CLAIMED_LOG = "Job %s: claimed %d requests (%s)"
CLAIMED_FOR_FREED_SLOTS_LOG = CLAIMED_LOG + " for freed slots"

MIN_RETRY_DELAY, MAX_RETRY_DELAY = 2.0, 60.0


def retry_delay(retries: int) -> float:
    """Seconds before retry number `retries` + 1 of a blocked job: exponential, capped."""
    return min(MAX_RETRY_DELAY, MIN_RETRY_DELAY * 2 ** retries)


@dataclass(frozen=True)
class Outcome:
    """What the task should do next."""

    more: bool = False   # pending work remains: enqueue again now
    retry: bool = False  # the swarm is unavailable: retry with backoff


class JobWorker:
    """Processes one batch of one job."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime, self.settings, self.lifecycle = runtime, runtime.settings, runtime.lifecycle

    def process(self, job_id: str) -> Outcome:
        """Claim up to `worker_batch_size` requests of the job and generate them."""
        with self.runtime.session() as session:
            job = session.get(Job, job_id)
            if job is None or not self._ready(session, job):
                session.commit()
                return Outcome()
            token, claimed = store.claim_requests(
                session=session, job_id=job_id, worker=self.runtime.worker_name, limit=self.settings.worker_batch_size,
                lease_seconds=self.settings.lease_seconds, max_attempts=self.settings.max_attempts)
            session.commit()  # the leases are durable, and the rows unlocked, before anything slow
            if not claimed:
                self.lifecycle.settle(session, job)
                session.commit()
                return Outcome()
            if job.status == JobStatus.queued:
                self.lifecycle.start(session, job)
                session.commit()
            logger.info(CLAIMED_LOG, job_id, len(claimed), ", ".join(str(r.id) for r in claimed))
            return self._generate(session, job, token, claimed)

    def _ready(self, session: Session, job: Job) -> bool:
        """Whether the job can take work now; expires or settles it otherwise."""
        if job.status.terminal:
            return False
        if utcnow() > job.expires_at:
            self.lifecycle.expire(session, job)
            return False
        if job.status == JobStatus.cancelling:
            self.lifecycle.settle(session, job)
            return False
        return True

    def _generate(self, session: Session, job: Job, token: str, claimed: list[Request]) -> Outcome:
        runner = None
        try:
            model = self.runtime.swarm_model(job.model)
            # joining the swarm may take a while on a new worker: the lease must not lapse before the first checkpoint
            store.renew_leases(session=session, token=token, lease_seconds=self.settings.lease_seconds)
            session.commit()
            runner = BatchRunner(model, self.runtime.tokenizer(job.model), claimed,
                                 checkpoint_every=job.checkpoint_every, checkpoint=self._checkpoint(job.id, token),
                                 lanes=self.settings.pipeline_lanes, continuous=self.settings.continuous_batching,
                                 refill=self._refill(job.id, token) if self.settings.continuous_batching else None,
                                 capacity=self.settings.worker_batch_size)
            results = runner.run()
        except JobCancelled:
            self._finish_cancelled(session, job, token, runner)
            return Outcome()
        except LeaseLost as e:
            logger.warning("Job %s: %s; leaving the batch to it", job.id, e)
            return Outcome(more=True)
        except InvalidRequest as e:
            self._fail_all(session, job, token, runner.requests if runner else claimed, str(e))
            return Outcome(more=True)
        except (MissingBlocksError, SwarmError) as e:
            return self._blocked(session, job, token, e)
        for request in runner.requests:
            result = results[request.id]
            store.finish_request(session=session, request_id=request.id, token=token, status=RequestStatus.completed,
                                 generated=result.generated, finish_reason=result.finish_reason,
                                 output_text=result.text)
        job.blocked_reason = None
        self.lifecycle.settle(session, job)
        session.commit()
        logger.info("Job %s: finished %d requests", job.id, len(runner.requests))
        return Outcome(more=store.job_counts(session=session, job_id=job.id).pending > 0)

    def _refill(self, job_id: str, token: str) -> Refill:
        def refill(limit: int) -> list[Request]:
            with self.runtime.session() as session:
                _, claimed = store.claim_requests(
                    session=session, job_id=job_id, worker=self.runtime.worker_name, limit=limit, token=token,
                    lease_seconds=self.settings.lease_seconds, max_attempts=self.settings.max_attempts)
                session.commit()
                for request in claimed:
                    session.expunge(request)  # read by the lane after this session closes
            if claimed:
                logger.info(CLAIMED_FOR_FREED_SLOTS_LOG, job_id, len(claimed), ", ".join(str(r.id) for r in claimed))
            return claimed
        return refill

    def _checkpoint(self, job_id: str, token: str) -> Checkpoint:
        def checkpoint(progress: dict[int, list[int]], texts: dict[int, str]) -> set[int]:
            with self.runtime.session() as session:
                owned = store.checkpoint(session=session, token=token, progress=progress, texts=texts,
                                         lease_seconds=self.settings.lease_seconds)
                session.commit()
                status = session.scalar(select(Job.status).where(Job.id == job_id))
            if status == JobStatus.cancelling:
                raise JobCancelled(job_id)
            return owned
        return checkpoint

    def _finish_cancelled(self, session: Session, job: Job, token: str, runner: BatchRunner | None) -> None:
        """Keep the committed partial output of each claimed request and settle the job to cancelled."""
        tokenizer = self.runtime.tokenizer(job.model)
        for row in runner.rows if runner else []:
            generated = row.generated[: row.committed]
            store.finish_request(session=session, request_id=row.request_id, token=token,
                                 status=RequestStatus.cancelled, generated=generated, finish_reason="cancelled",
                                 output_text=tokenizer.decode(generated, skip_special_tokens=True))
        session.commit()
        session.refresh(job)
        self.lifecycle.settle(session, job)
        session.commit()

    def _fail_all(self, session: Session, job: Job, token: str, claimed: list[Request], reason: str) -> None:
        for request in claimed:
            store.finish_request(session=session, request_id=request.id, token=token, status=RequestStatus.failed,
                                 error=reason)
        self.lifecycle.settle(session, job)
        session.commit()

    def _blocked(self, session: Session, job: Job, token: str, error: Exception) -> Outcome:
        """The swarm cannot serve now: give the requests back, say why on the job, retry later.

        Missing blocks cost no attempt (the job waits for servers until its deadline); other swarm failures
        count, so a request that keeps failing ends as failed with its reason.
        """
        reason = f"{type(error).__name__}: {error}"
        store.release_requests(session=session, token=token, error=reason,
                               count_attempt=not isinstance(error, MissingBlocksError))
        job.blocked_reason = reason
        # this task's retry chain comes back within MAX_RETRY_DELAY: sweeps add no other chain until it is overdue
        job.dispatch_after = utcnow() + timedelta(seconds=MAX_RETRY_DELAY + self.settings.lease_seconds)
        session.commit()
        logger.warning("Job %s blocked: %s", job.id, reason)
        return Outcome(retry=True)

