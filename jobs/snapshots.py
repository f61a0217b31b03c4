"""Swarm snapshots: what the workers last saw of each model's swarm, kept in the store for the API's swarm page.

The API never joins the swarm. A worker, which reads the DHT anyway to route and size its batches, writes the
coverage map it sees (jobs.worker.swarm_view) here at most every `swarm_snapshot_seconds`; the API reads it back.
Like the store's functions, these never commit: the caller does.
"""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from jobs.models import SwarmSnapshot, utcnow


def snapshot_due(*, session: Session, model: str, interval: float, now: datetime | None = None) -> bool:
    """Whether the model's snapshot is older than `interval` seconds (or missing): a worker publishes only then."""
    now = now or utcnow()
    taken_at = session.scalar(select(SwarmSnapshot.taken_at).where(SwarmSnapshot.model == model))
    return taken_at is None or taken_at <= now - timedelta(seconds=interval)


def publish_snapshot(*, session: Session, model: str, worker: str, report: dict[str, Any],
                     now: datetime | None = None) -> None:
    """Store `report` as what `worker` saw of `model`'s swarm now, replacing the previous snapshot."""
    now = now or utcnow()
    values = {"worker": worker, "taken_at": now, "report": report}
    if session.execute(update(SwarmSnapshot).where(SwarmSnapshot.model == model).values(**values)).rowcount:  # type: ignore[attr-defined]
        return
    try:  # the model's first snapshot: two workers may insert it at once; either one's is as good
        with session.begin_nested():
            session.add(SwarmSnapshot(model=model, **values))
    except IntegrityError:
        pass


def read_snapshots(*, session: Session, models: list[str], now: datetime | None = None) -> list[dict[str, Any]]:
    """The snapshots of `models` (in that order; a model no worker has looked at yet is left out), each as
    {"model", "worker", "taken_at" (unix s), "age_seconds", **the coverage report}."""
    now = now or utcnow()
    rows = {row.model: row for row in session.scalars(select(SwarmSnapshot).where(SwarmSnapshot.model.in_(models)))}
    return [{**rows[m].report, "model": m, "worker": rows[m].worker, "taken_at": int(rows[m].taken_at.timestamp()),
             "age_seconds": round((now - rows[m].taken_at).total_seconds(), 1)} for m in models if m in rows]
