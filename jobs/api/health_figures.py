"""What keeps work from moving, read from the store for GET /metrics (jobs.api.metrics) and its alert rules
(deploy/prometheus/alerts.yml): live workers (jobs.liveness), jobs a worker marked blocked, input lines refused at
validation, and each served model's coverage as a worker last saw it (jobs.snapshots).

The API never joins the swarm: coverage is as fresh as the model's snapshot, which workers publish while they run
jobs of it (`age_seconds` says how old it is; a model no worker has looked at has no figures).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from jobs import liveness, snapshots
from jobs.models import Job, JobStatus
from swarmnet.data_structures import ServerState

OPEN_STATUSES = [status for status in JobStatus if not status.terminal]


@dataclass(frozen=True)
class Coverage:
    """One model's swarm as its last snapshot saw it."""

    model: str
    blocks: int
    without_server: int  # blocks no ONLINE member server of our protocol holds
    servers_online: int
    age_seconds: float


@dataclass(frozen=True)
class HealthFigures:
    """One read of the store's health figures."""

    workers_alive: int = 0
    jobs_blocked: int = 0
    input_line_errors: int = 0
    coverage: tuple[Coverage, ...] = ()


def read_health(session: Session, models: Iterable[str]) -> HealthFigures:
    """Live workers, blocked open jobs, refused input lines (all jobs) and the coverage of `models`."""
    return HealthFigures(workers_alive=liveness.live_workers(session=session),
                         jobs_blocked=blocked_jobs(session), input_line_errors=input_line_errors(session),
                         coverage=tuple(map(coverage_of, snapshots.read_snapshots(session=session,
                                                                                  models=list(models)))))


def blocked_jobs(session: Session) -> int:
    """Open jobs whose worker recorded why the swarm cannot serve them now (missing blocks, busy servers...)."""
    return int(session.scalar(select(func.count()).where(Job.status.in_(OPEN_STATUSES),
                                                         Job.blocked_reason.is_not(None))) or 0)


def input_line_errors(session: Session) -> int:
    """Input lines refused at validation, summed over every job (a scan of the jobs table: one row per batch)."""
    return int(session.scalar(select(func.coalesce(func.sum(func.json_array_length(Job.line_errors)), 0))) or 0)


def coverage_of(snapshot: Mapping[str, Any]) -> Coverage:
    """A snapshot (jobs.snapshots.read_snapshots) as figures: its missing ranges counted in blocks."""
    return Coverage(model=snapshot["model"], blocks=int(snapshot["num_blocks"]),
                    without_server=sum(end - start for start, end in snapshot["missing"]),
                    servers_online=len(online_servers(snapshot)), age_seconds=float(snapshot["age_seconds"]))


def online_servers(snapshot: Mapping[str, Any]) -> set[str]:
    """The peer ids that cover blocks: ONLINE, of our protocol version and members of the swarm."""
    return {server["peer_id"] for block in snapshot["blocks"] for server in block["servers"]
            if server["state"] == ServerState.ONLINE.value and server["compatible"] and server.get("member", True)}
