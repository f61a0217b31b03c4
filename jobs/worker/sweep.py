"""The sweep: lost leases back to pending, overdue jobs expired, finished ones settled, failed end hooks retried,
work re-enqueued."""
from __future__ import annotations

from datetime import timedelta

from sqlalchemy import text

from jobs import store
from jobs.models import Job, JobStatus, utcnow
from jobs.runtime import Runtime


def sweep_store(runtime: Runtime) -> list[str]:
    """Expire lost leases and overdue jobs, settle the others, retry failed end hooks; returns the jobs to dispatch.

    The end hooks retried are those that failed where the job ended (a summary job's page write, bounded).

    Safe when many workers sweep at once: every step is a conditional update, and a job is returned only by the
    sweep that wins its dispatch hold (store.hold_dispatch).
    """
    now = utcnow()
    needing: list[str] = []
    lifecycle = runtime.lifecycle
    with runtime.session() as session:
        store.expire_leases(session=session, now=now)
        session.commit()  # lost work is claimable again even if a later step fails
        for job_id in store.active_job_ids(session=session):
            job = session.get(Job, job_id)
            assert job is not None
            if now > job.expires_at:
                lifecycle.expire(session, job, now=now)
                continue
            lifecycle.settle(session, job, now=now)
            counts = store.job_counts(session=session, job_id=job_id)
            waiting = job.status in (JobStatus.queued, JobStatus.in_progress) and counts.pending and \
                not counts.in_progress
            # the hold covers the time the task takes to claim; a lost message is sent again after it
            if waiting and store.hold_dispatch(session=session, job=job, seconds=runtime.settings.lease_seconds,
                                               now=now):
                needing.append(job_id)
        # whoever ended a job ran its end hooks then; only those that failed (a page write) come back here
        lifecycle.retry_ended(session, now=now)
        session.commit()
    purge_consumed_messages(runtime)
    return needing


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
