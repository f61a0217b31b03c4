"""The sweep: lost leases back to pending, overdue jobs expired, finished ones settled, failed end hooks retried,
work re-enqueued, expired files (and revoked keys' files) deleted."""
from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TypeVar

from sqlalchemy import text

from jobs import retention, store
from jobs.db import retry_store
from jobs.errors import StoreUnavailable
from jobs.models import Job, utcnow
from jobs.runtime import Runtime

logger = logging.getLogger(__name__)
T = TypeVar("T")


def sweep_store(runtime: Runtime) -> list[str]:
    """Expire lost leases and overdue jobs, settle finished ones; returns the job ids to dispatch a worker to.

    The end hooks retried are those that failed where the job ended (a summary job's page write, bounded). Safe
    when many workers sweep at once: every step is a conditional update, and a job is returned only by the sweep
    that wins its dispatch hold (store.hold_dispatch). Each job is its own transaction: a job that fails is
    logged and the others go on. Only an unreachable store stops the sweep.
    """
    now = utcnow()
    active = _store(runtime, "Sweep", lambda: _expire_leases(runtime, now))
    needing: list[str] = []
    try:
        for job_id in active:
            if _each(runtime, job_id, lambda job_id: _sweep_job(runtime, job_id, now)):
                needing.append(job_id)
        # whoever ended a job ran its end hooks then; only those that failed (a page write) come back here
        for job_id in _store(runtime, "Sweep", lambda: _ended_due(runtime, now)):
            _each(runtime, job_id, lambda job_id: _retry_ended(runtime, job_id, now))
        _store(runtime, "Sweep: expired files", lambda: _expire_files(runtime, now))
    except StoreUnavailable as e:  # the jobs whose dispatch this sweep already holds are still sent
        logger.warning("Sweep stopped: %s", e)
        return needing
    try:
        purge_consumed_messages(runtime)
    except Exception as e:  # pruning the embedded broker is housekeeping; the dispatches matter
        logger.warning("Sweep: could not prune the embedded broker (%s); next sweep tries again", e)
    return needing


def _store(runtime: Runtime, what: str, unit: Callable[[], T]) -> T:
    return retry_store(unit, what=what, within=runtime.settings.store_retry_seconds)


def _each(runtime: Runtime, job_id: str, step: Callable[[str], bool]) -> bool:
    """One job's step as its own retried transaction; a failure other than the store's is logged, and is false."""
    try:
        return _store(runtime, f"Sweep: job {job_id}", lambda: step(job_id))
    except StoreUnavailable:
        raise
    except Exception:  # one bad job must not stop the sweep of the others
        logger.exception("Sweep: job %s failed; the other jobs go on", job_id)
        return False


def _expire_leases(runtime: Runtime, now: datetime) -> list[str]:
    """Lost work is claimable again (committed before anything else); returns the active job ids."""
    with runtime.session() as session:
        store.expire_leases(session=session, now=now)
        session.commit()
        return store.active_job_ids(session=session)


def _sweep_job(runtime: Runtime, job_id: str, now: datetime) -> bool:
    """Expire or settle one job; returns whether to dispatch a worker to it."""
    with runtime.session() as session:
        job = session.get(Job, job_id)
        if job is None:
            return False
        if now > job.expires_at:
            runtime.lifecycle.expire(session, job, now=now)
            session.commit()
            return False
        runtime.lifecycle.settle(session, job, now=now)
        counts = store.job_counts(session=session, job_id=job_id)
        # the hold covers the time the task takes to claim; a lost message is sent again after it
        dispatch = counts.waiting_for_a_worker(job) and store.hold_dispatch(session=session, job=job,
                                                         seconds=runtime.settings.lease_seconds, now=now)
        session.commit()
        return dispatch


def _expire_files(runtime: Runtime, now: datetime) -> int:
    """One bounded batch of expired files, deleted in one transaction (retention.FILES_PER_SWEEP at most)."""
    with runtime.session() as session:
        deleted = retention.expire_files(session=session, now=now)
        session.commit()
        return deleted


def _ended_due(runtime: Runtime, now: datetime) -> list[str]:
    with runtime.session() as session:
        return runtime.lifecycle.ended_due(session, now)


def _retry_ended(runtime: Runtime, job_id: str, now: datetime) -> bool:
    with runtime.session() as session:
        ran = runtime.lifecycle.retry_ended(session, job_id, now=now)
        session.commit()
        return ran


def purge_consumed_messages(runtime: Runtime, *, older_than: timedelta = timedelta(hours=1)) -> None:
    """The embedded SQLite broker never deletes consumed messages; drop old ones so it does not grow forever."""
    url = runtime.settings.resolved_broker_url
    if not url.startswith("sqla+"):
        return
    from sqlalchemy import create_engine

    engine = create_engine(url.removeprefix("sqla+"))
    try:
        with engine.begin() as connection:
            tables = connection.execute(text("SELECT name FROM sqlite_master WHERE name='kombu_message'")).all()
            if tables:
                connection.execute(text("DELETE FROM kombu_message WHERE visible = 0 AND timestamp < :cutoff"),
                                   {"cutoff": (utcnow() - older_than).replace(tzinfo=None)})
    finally:
        engine.dispose()
