"""What a worker does with a job id: claim a batch under a lease, generate it, record the outcome.

Every step is idempotent: a redelivered or duplicated task finds the rows already claimed or finished and
does nothing twice. Every step that touches the store is one transaction run through the store's retry
policy (jobs.db.retry_store), so a database blip costs a short wait, not an attempt; an outage longer than
`store_retry_seconds` stops the batch, and its requests are given back uncounted once the store answers.
"""
from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from jobs import ingest, liveness, store
from jobs.db import retry_store
from jobs.errors import JobCancelled, LeaseLost, StoreUnavailable
from jobs.lifecycle import checking_lines
from jobs.line_checks import EMBEDDINGS_URL
from jobs.models import Job, JobStatus, Request, RequestStatus, utcnow
from jobs.runtime import Runtime
from jobs.worker.embedder import EmbeddingRunner, Finish
from jobs.worker.runner import BatchRunner, Checkpoint, Refill, RowResult
from jobs.worker.sizing import MAX_CLAIM, ChainRoom, PipelinePlan, chain_room, plan_pipeline
from jobs.worker.swarm_view import publish_if_due, publish_in_background
from modelprep import ModelPrepError
from swarmclient.errors import InvalidRequest, LieCaught, MissingBlocksError, SwarmBusy
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.verification_policy import VerificationCounts, VerificationTally
from swarmnet.errors import ModelDirError, SwarmError

logger = logging.getLogger(__name__)
T = TypeVar("T")

MIN_RETRY_DELAY, MAX_RETRY_DELAY = 2.0, 60.0
CLAIMED_LOG = "Job %s: claimed %d requests (%s)"
CLAIMED_FOR_FREED_SLOTS_LOG = CLAIMED_LOG + " for freed slots"
PIPELINE_LOG = "Job %s: %s"  # the plan of a batch: "claim 32 in 4 lanes (bound: cache share)"
OUTAGE = "the store was unavailable"


def retry_delay(retries: int) -> float:
    """Seconds before retry number `retries` + 1 of a blocked job: exponential, capped."""
    return min(MAX_RETRY_DELAY, MIN_RETRY_DELAY * 2 ** retries)


@dataclass(frozen=True)
class Outcome:
    """What the task should do next."""

    more: bool = False   # pending work remains: enqueue again now
    chains: int = 0      # the job's lines were just checked (jobs.ingest): send this many chains to generate them
    retry: bool = False  # the swarm or the store is unavailable: retry with backoff
    # a batch stopped by a store outage: {"token": ..., "attempts": [[request id, attempts as claimed], ...]}, for
    # the retry to give its requests back without counting the claim
    give_back: dict[str, Any] | None = None


@dataclass
class CheckedOutputs:
    """A batch's checked-output counts (its sessions add to `tally`) and the part of them already stored."""

    tally: VerificationTally = field(default_factory=VerificationTally)
    stored: VerificationCounts = VerificationCounts()

    def write(self, session: Session, job_id: str) -> VerificationCounts:
        """Add the unstored counts to the job in this transaction; returns what `stored` becomes once it commits."""
        counts = self.tally.snapshot()
        new = counts - self.stored
        store.add_verification(session=session, job_id=job_id, verified=new.verified, mismatches=new.mismatches,
                               unverified=new.unverified)
        return counts


@dataclass(frozen=True)
class Claim:
    """A claimed batch: the job (detached) and its requests, leased under `token`."""

    job: Job
    token: str
    requests: list[Request]


class JobWorker:
    """Processes one batch of one job."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime, self.settings, self.lifecycle = runtime, runtime.settings, runtime.lifecycle
        self.runner: BatchRunner | EmbeddingRunner | None = None  # the batch being run, once built

    def process(self, job_id: str, *, give_back: dict[str, Any] | None = None) -> Outcome:
        """Claim a batch of the job's requests (sized by `_plan`) and generate them."""
        token = secrets.token_hex(8)  # chosen once: a retried claim must find what a lost commit took under it
        try:
            checked = self._store(f"Job {job_id}: check lines", lambda: ingest.check_lines(self.runtime, job_id))
            if checked.ran:  # lines were checked here: the next slice, or the job's chains, come next
                return Outcome(more=checked.more,
                               chains=self.settings.tasks_for(checked.requests) if checked.requests else 0)
            if give_back:
                self._store(f"Job {job_id}: give back", lambda: self._give_back(give_back))
            plan = self._plan(job_id)
            claim = self._store(f"Job {job_id}: claim", lambda: self._claim(job_id, token, plan))
        except StoreUnavailable as e:
            logger.warning("%s; retrying the task later", e)
            return Outcome(retry=True, give_back=give_back)
        if claim is None:
            return Outcome()
        logger.info(CLAIMED_LOG, job_id, len(claim.requests), ", ".join(str(r.id) for r in claim.requests))
        logger.info(PIPELINE_LOG, job_id, plan.describe())
        try:
            return self._generate(claim, plan)
        except StoreUnavailable as e:
            requests = self.runner.requests if self.runner else claim.requests
            logger.warning("%s; stopping the batch: its requests go back when the store answers", e)
            return Outcome(retry=True, give_back={"token": claim.token,
                                                  "attempts": [[r.id, r.attempts] for r in requests]})

    def _store(self, what: str, unit: Callable[[], T]) -> T:
        return retry_store(unit, what=what, within=self.settings.store_retry_seconds)

    def _plan(self, job_id: str) -> PipelinePlan:
        """The batch to claim now (jobs.worker.sizing): from the job's next requests, this worker's fair share of its
        open requests among the live workers, and what the chain of servers can hold for us."""
        def read() -> tuple[str, list[int], int] | None:
            with self.runtime.session() as session:
                job = session.get(Job, job_id)
                if job is None or job.status.terminal or job.status == JobStatus.cancelling or utcnow() > job.expires_at:
                    return None  # nothing to size: the claim settles, cancels or expires the job
                counts = store.job_counts(session=session, job_id=job_id)
                workers = max(1, liveness.live_workers(session=session))
                sizes = store.next_request_sizes(session=session, job_id=job_id, limit=MAX_CLAIM)
                return job.model, sizes, math.ceil((counts.pending + counts.in_progress) / workers)
        found = self._store(f"Job {job_id}: plan", read)
        model, sizes, share = found if found is not None else (None, [], 1)
        return plan_pipeline(self._room(model) if model else None, sizes, share=share,
                             claim=self.settings.worker_batch_size, lanes=self.settings.pipeline_lanes)

    def _room(self, model: str) -> ChainRoom | None:
        """What the chain can hold for this process now; None when the swarm cannot say (the batch will say why)."""
        try:
            swarm = self.runtime.swarm_model(model).swarm
            room = swarm.loop.run(chain_room(swarm))
            publish_if_due(self.runtime, model)  # the API's swarm page: what this worker sees (never raises)
            return room  # type: ignore[no-any-return]
        except Exception as e:  # sizing must never stop a batch: generating reports the real error
            logger.info("Sizing the batch without the servers' figures: %s", e)
            return None

    def _claim(self, job_id: str, token: str, plan: PipelinePlan) -> Claim | None:
        """One transaction: the job's readiness, then the claim (None when there is nothing to claim)."""
        with self.runtime.session() as session:
            job = session.get(Job, job_id)
            if job is None or not self._ready(session, job):
                session.commit()
                return None
            # a retry after a commit whose answer was lost finds its rows already leased under this token
            claimed = store.leased_requests(session=session, job_id=job_id, token=token)
            if not claimed:
                _, claimed = store.claim_requests(
                    session=session, job_id=job_id, worker=self.runtime.worker_name, token=token,
                    limit=plan.claim, lease_seconds=self.settings.lease_seconds,
                    max_attempts=self.settings.max_attempts)
            if claimed:  # this chain is alive and re-enqueues itself: sweeps send no other for a lease period
                store.refresh_dispatch_hold(session=session, job=job, seconds=self.settings.lease_seconds)
                job.pipeline = {**job.pipeline, self.runtime.worker_name: plan.as_dict()}
            session.commit()  # the leases are durable, and the rows unlocked, before anything slow
            if not claimed:
                self.lifecycle.settle(session, job)
                session.commit()
                return None
            if job.status == JobStatus.validating:
                self.lifecycle.start(session, job)
                session.commit()
            return Claim(job, token, claimed)

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
        return not checking_lines(job)  # another worker checks its lines: it sends the chains once they are

    def _give_back(self, give_back: dict[str, Any]) -> None:
        with self.runtime.session() as session:
            store.give_back_uncounted(session=session, token=give_back["token"], error=OUTAGE,
                                      attempts={int(rid): int(n) for rid, n in give_back["attempts"]})
            session.commit()

    def _generate(self, claim: Claim, plan: PipelinePlan) -> Outcome:
        """Run the batch; then store its checked-output counts since the last checkpoint, whatever stopped it."""
        checks = CheckedOutputs()
        try:
            outcome = self._run_batch(claim, plan, checks)
        except StoreUnavailable:
            raise  # the store is away: those counts are lost (they are counters; the outage is what matters now)
        except Exception as error:  # a fault of ours or of a library: the lines say so, and run out of attempts
            self._store_checks(claim.job.id, checks)
            return self._crashed(claim, error)
        except BaseException:
            self._store_checks(claim.job.id, checks)
            raise
        self._store_checks(claim.job.id, checks)
        return outcome

    def _crashed(self, claim: Claim, error: Exception) -> Outcome:
        """An unexpected error stopped the batch: give its requests back at once with the error, the attempt counted,
        and retry with backoff. A request that keeps failing so fails after max_attempts with that error as its
        reason, instead of waiting out a lease each time with no reason given."""
        logger.exception("Job %s: the batch failed unexpectedly; its requests go back", claim.job.id)
        return self._release(claim.job, claim.token, error, count_attempt=True, blocked=False)

    def _run_batch(self, claim: Claim, plan: PipelinePlan, checks: CheckedOutputs) -> Outcome:
        job, token, claimed = claim.job, claim.token, claim.requests
        runner = None
        try:
            model = self.runtime.swarm_model(job.model)
            # joining the swarm may take a while on a new worker: the lease must not lapse before the first checkpoint
            self._store(f"Job {job.id}: renew leases", lambda: self._renew(token))
            runner = self._runner(model, claim, plan, checks)
            self.runner = runner
            results = runner.run()
        except JobCancelled:
            self._finish_cancelled(job, token, runner)
            return Outcome()
        except LeaseLost as e:
            logger.warning("Job %s: %s; leaving the batch to it", job.id, e)
            return Outcome(more=True)
        except (InvalidRequest, ModelDirError, ModelPrepError) as e:  # retrying cannot help: fail with the reason
            self._fail_all(job, token, runner.requests if runner else claimed, str(e))
            return Outcome(more=True)
        except LieCaught as e:  # the liar is banned in this process: the requests go back to their last checkpoint
            logger.warning("Job %s: %s; its requests resume from their last checkpoint", job.id, e)
            self._release(job, token, e, count_attempt=False, blocked=False)
            return Outcome(more=True)  # at once: the retry routes around the banned server
        except (MissingBlocksError, SwarmError) as e:
            return self._blocked(job, token, e)
        # the completions are committed first, on their own: nothing that follows (the next map-reduce stage,
        # the pages) can undo them
        self._store(f"Job {job.id}: finish", lambda: self._complete(job.id, token, results))
        logger.info("Job %s: finished %d requests", job.id, len(runner.requests))
        return Outcome(more=self._settle(job.id) > 0)

    def _runner(self, model: DistributedModelForCausalLM, claim: Claim, plan: PipelinePlan, checks: CheckedOutputs
                ) -> BatchRunner | EmbeddingRunner:
        """What runs the batch: an EmbeddingRunner for an embeddings job, else a BatchRunner that generates."""
        job, token, claimed = claim.job, claim.token, claim.requests
        if job.endpoint == EMBEDDINGS_URL:
            return EmbeddingRunner(model, claimed, finish=self._embedded(job.id, token),
                                   rows=plan.rows_per_session or plan.claim, verification=checks.tally)
        return BatchRunner(model, self.runtime.tokenizer(job.model), claimed, checkpoint_every=job.checkpoint_every,
                           checkpoint=self._checkpoint(job.id, token, checks), verification=checks.tally,
                           plan=plan, continuous=self.settings.continuous_batching,
                           refill=self._refill(job.id, token, claimed) if self.settings.continuous_batching
                           else None, renew=lambda: self._renew_leases(job, token),
                           renew_every=self.settings.lease_seconds / 3)

    def _renew_leases(self, job: Job, token: str) -> None:
        """A long batch's periodic duty: renew its leases, and publish the swarm snapshot when due."""
        self._store(f"Job {job.id}: renew leases", lambda: self._renew(token))
        publish_in_background(self.runtime, job.model)

    def _renew(self, token: str) -> None:
        with self.runtime.session() as session:
            store.renew_leases(session=session, token=token, lease_seconds=self.settings.lease_seconds)
            session.commit()

    def _complete(self, job_id: str, token: str, results: dict[int, RowResult]) -> None:
        with self.runtime.session() as session:
            for request_id, result in results.items():  # every request of a generation (an embedder stored its own)
                if result.error is not None:
                    store.finish_request(session=session, request_id=request_id, token=token,
                                         status=RequestStatus.failed, error=result.error)
                    continue
                store.finish_request(session=session, request_id=request_id, token=token,
                                     status=RequestStatus.completed, generated=result.generated,
                                     finish_reason=result.finish_reason, output_text=result.text)
            job = session.get(Job, job_id)
            assert job is not None
            job.blocked_reason = None
            job.pipeline = {name: plan for name, plan in job.pipeline.items() if name != self.runtime.worker_name}
            session.commit()

    def _settle(self, job_id: str) -> int:
        """Settle the job (and write its pages if it ended) in its own transaction; returns its pending requests."""
        def unit() -> int:
            with self.runtime.session() as session:
                job = session.get(Job, job_id)
                assert job is not None
                self.lifecycle.settle(session, job)
                session.commit()
                return store.job_counts(session=session, job_id=job_id).pending
        return self._store(f"Job {job_id}: settle", unit)

    def _refill(self, job_id: str, token: str, claimed: list[Request]) -> Refill:
        handed = {request.id for request in claimed}  # every row the runner has, so a retried claim hands none twice

        def claim_more(limit: int) -> list[Request]:
            with self.runtime.session() as session:
                # a retry after a commit whose answer was lost finds those rows leased under our token already
                rows = [r for r in store.leased_requests(session=session, job_id=job_id, token=token)
                        if r.id not in handed]
                if not rows:
                    _, rows = store.claim_requests(
                        session=session, job_id=job_id, worker=self.runtime.worker_name, limit=limit, token=token,
                        lease_seconds=self.settings.lease_seconds, max_attempts=self.settings.max_attempts)
                session.commit()
                for request in rows:
                    session.expunge(request)  # read by the lane after this session closes
            return rows

        def refill(limit: int) -> list[Request]:
            rows = self._store(f"Job {job_id}: refill", lambda: claim_more(limit))
            handed.update(r.id for r in rows)
            if rows:
                logger.info(CLAIMED_FOR_FREED_SLOTS_LOG, job_id, len(rows), ", ".join(str(r.id) for r in rows))
            return rows
        return refill

    def _store_checks(self, job_id: str, checks: CheckedOutputs) -> None:
        """Store the batch's last checked-output counts; a store that stays away loses them (they are counters)."""
        if checks.tally.snapshot() == checks.stored:
            return

        def unit() -> None:
            with self.runtime.session() as session:
                stored = checks.write(session, job_id)
                session.commit()
                checks.stored = stored
        try:
            self._store(f"Job {job_id}: verification counts", unit)
        except StoreUnavailable as e:
            logger.warning("%s; this batch's last verification counts are not stored", e)

    def _checkpoint(self, job_id: str, token: str, checks: CheckedOutputs) -> Checkpoint:
        def commit(progress: dict[int, list[int]], texts: dict[int, str],
                   logprobs: dict[int, list[Any]] | None) -> tuple[set[int], JobStatus | None]:
            # the same ids and texts again after a lost answer: writing them twice is harmless, and fenced by token
            with self.runtime.session() as session:
                owned = store.checkpoint(session=session, token=token, progress=progress, texts=texts,
                                         logprobs=logprobs, lease_seconds=self.settings.lease_seconds)
                stored = checks.write(session, job_id)
                session.commit()
                checks.stored = stored
                return owned, session.scalar(select(Job.status).where(Job.id == job_id))

        def checkpoint(progress: dict[int, list[int]], texts: dict[int, str],
                       logprobs: dict[int, list[Any]] | None = None, /) -> set[int]:
            owned, status = self._store(f"Job {job_id}: checkpoint", lambda: commit(progress, texts, logprobs))
            if status == JobStatus.cancelling:
                raise JobCancelled(job_id)
            return owned
        return checkpoint

    def _embedded(self, job_id: str, token: str) -> Finish:
        """An EmbeddingRunner's store step: its vectors as completed requests, then whether the job is cancelling."""
        def unit(vectors: dict[int, bytes]) -> tuple[set[int], JobStatus | None]:
            with self.runtime.session() as session:
                for request_id, data in vectors.items():
                    store.finish_request(session=session, request_id=request_id, token=token, generated=[],
                                         status=RequestStatus.completed, finish_reason="stop", embedding=data)
                # ours, or stored already (a retry after a commit whose answer was lost finds them so)
                stored = set(session.scalars(select(Request.id).where(
                    Request.id.in_(list(vectors)), Request.status == RequestStatus.completed,
                    Request.embedding.is_not(None))))
                # the inputs still waiting for their micro-batch keep their leases (a batch has no checkpoints)
                store.renew_leases(session=session, token=token, lease_seconds=self.settings.lease_seconds)
                session.commit()
                return stored, session.scalar(select(Job.status).where(Job.id == job_id))

        def finish(vectors: dict[int, bytes]) -> set[int]:
            stored, status = self._store(f"Job {job_id}: embeddings", lambda: unit(vectors))
            if status == JobStatus.cancelling:
                raise JobCancelled(job_id)
            return stored
        return finish

    def _finish_cancelled(self, job: Job, token: str, runner: BatchRunner | EmbeddingRunner | None) -> None:
        """Keep the committed partial output of each claimed request and settle the job to cancelled."""
        tokenizer = self.runtime.tokenizer(job.model)

        def unit() -> None:
            with self.runtime.session() as session:
                for row in runner.rows if runner else []:
                    generated = row.generated[: row.committed]
                    store.finish_request(session=session, request_id=row.request_id, token=token,
                                         status=RequestStatus.cancelled, generated=generated,
                                         finish_reason="cancelled",
                                         output_text=str(tokenizer.decode(generated, skip_special_tokens=True)))
                session.commit()
        self._store(f"Job {job.id}: cancel", unit)
        self._settle(job.id)

    def _fail_all(self, job: Job, token: str, claimed: list[Request], reason: str) -> None:
        def unit() -> None:
            with self.runtime.session() as session:
                for request in claimed:
                    store.finish_request(session=session, request_id=request.id, token=token,
                                         status=RequestStatus.failed, error=reason)
                session.commit()
        self._store(f"Job {job.id}: fail", unit)
        self._settle(job.id)

    def _blocked(self, job: Job, token: str, error: Exception) -> Outcome:
        """The swarm cannot serve now: give the requests back, say why on the job, retry later.

        Missing blocks and busy servers cost no attempt (the job waits for servers until its deadline); others
        count, so a request that keeps failing ends as failed with its reason.
        """
        outcome = self._release(job, token, error, count_attempt=not isinstance(error, MissingBlocksError | SwarmBusy),
                                blocked=True)
        logger.warning("Job %s blocked: %s: %s", job.id, type(error).__name__, error)
        return outcome

    def _release(self, job: Job, token: str, error: Exception, *, count_attempt: bool, blocked: bool) -> Outcome:
        """Give the batch's requests back with the error as their reason (and the job's blocked reason if
        `blocked`), and retry this task later with backoff."""
        reason = f"{type(error).__name__}: {error}"

        def unit() -> None:
            with self.runtime.session() as session:
                store.release_requests(session=session, token=token, error=reason, count_attempt=count_attempt)
                row = session.get(Job, job.id)
                assert row is not None
                if blocked:
                    row.blocked_reason = reason
                # this task's retry chain comes back within MAX_RETRY_DELAY: sweeps add no other chain until then
                store.refresh_dispatch_hold(session=session, job=row,
                                            seconds=MAX_RETRY_DELAY + self.settings.lease_seconds)
                session.commit()
        self._store(f"Job {job.id}: release", unit)
        return Outcome(retry=True)

