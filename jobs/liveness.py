"""Who keeps the store moving: worker heartbeats, and the maintenance slot that lets one worker at a time sweep.

Every worker process ticks (jobs.worker.maintenance): it writes its heartbeat, and the one whose tick moves a
slot's `next_at` on sends that duty's task (the sweep). So, however many workers run, the sweep runs about once
per interval, and status views can tell work that waits for a worker from work that waits for the swarm.
Like the store's functions, these never commit: the caller does.
"""
from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from jobs.models import MaintenanceSlot, WorkerHeartbeat, utcnow


def record_heartbeat(*, session: Session, worker: str, alive_for: float, now: datetime | None = None) -> None:
    """This worker is alive now, and counts as alive for `alive_for` seconds unless it ticks again."""
    now = now or utcnow()
    expires_at = now + timedelta(seconds=alive_for)
    seen = session.execute(update(WorkerHeartbeat).where(WorkerHeartbeat.name == worker)
                           .values(last_seen=now, expires_at=expires_at))
    if not seen.rowcount:  # type: ignore[attr-defined]
        session.add(WorkerHeartbeat(name=worker, started_at=now, last_seen=now, expires_at=expires_at))
        session.flush()


def forget_worker(*, session: Session, worker: str) -> None:
    """A worker that stops cleanly is gone at once (a killed one ages out)."""
    session.execute(delete(WorkerHeartbeat).where(WorkerHeartbeat.name == worker))


def live_workers(*, session: Session, now: datetime | None = None) -> int:
    """How many workers ticked recently enough to count as alive."""
    now = now or utcnow()
    return int(session.scalar(select(func.count()).where(WorkerHeartbeat.expires_at > now)) or 0)


def last_heartbeat(*, session: Session) -> datetime | None:
    """The newest heartbeat of any worker, or None if no worker ran since the last one stopped cleanly."""
    return session.scalar(select(func.max(WorkerHeartbeat.last_seen)))


def take_slot(*, session: Session, name: str, interval: float, now: datetime | None = None) -> bool:
    """Whether this caller does the duty `name` now: true for one caller per `interval` seconds.

    A conditional UPDATE moves `next_at` on; only the caller whose UPDATE matched gets true, on every database.
    """
    now = now or utcnow()
    next_at = now + timedelta(seconds=interval)
    moved = session.execute(update(MaintenanceSlot).where(MaintenanceSlot.name == name, MaintenanceSlot.next_at <= now)
                            .values(next_at=next_at))
    if moved.rowcount:  # type: ignore[attr-defined]
        return True
    if session.get(MaintenanceSlot, name) is not None:
        return False
    try:  # the first tick ever: the row does not exist yet; one inserter wins the primary key
        with session.begin_nested():
            session.add(MaintenanceSlot(name=name, next_at=next_at))
        return True
    except IntegrityError:
        return False
