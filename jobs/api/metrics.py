"""Prometheus metrics read from SQL at scrape time, so every API replica reports the same numbers.

    swarmbatch_jobs{status}               jobs by status (every status, 0 included)
    swarmbatch_requests{status}           requests by status
    swarmbatch_tokens_generated_total     generated tokens of all requests (a gauge: it drops when jobs are deleted)
    swarmbatch_tokens_per_second          generation rate over the scrapes of the last minute (0 on the first)
    swarmbatch_steps_verified_total       hop steps the workers recomputed on a second server (checked outputs)
    swarmbatch_verification_mismatches_total  of those, the ones whose outputs differed: a server was banned
    swarmbatch_steps_unverified_total     sampled hop steps no second server could recompute
    swarmbatch_workers_alive              workers whose heartbeat is recent (jobs.liveness)
    swarmbatch_jobs_blocked               open jobs a worker marked blocked (missing blocks, busy servers...)
    swarmbatch_input_line_errors          input lines refused at validation, over all jobs (a gauge)
    swarmbatch_swarm_blocks{model}        per served model with a swarm snapshot (jobs.api.health_figures):
    swarmbatch_blocks_without_server{model}     its blocks; those no online member server holds;
    swarmbatch_swarm_servers_online{model}      the servers that cover blocks;
    swarmbatch_swarm_snapshot_age_seconds{model}  and how old the worker's snapshot is

A scrape is two GROUP BY queries of a few result rows, answered from indexes (tokens are summed from
`requests.generated_count`, never from the token JSON), and one sum of the jobs' verification counts (a scan of
the jobs table, which holds one row per batch), then the health figures: a count of heartbeats, one of blocked
jobs (status index), a sum of refused lines (a scan of the jobs table) and the served models' snapshot rows. They
walk one entry per job and request, so their numbers are reused for SWARMBATCH_METRICS_CACHE_SECONDS (5 s): a burst
of scrapes, or several Prometheus servers, reach the database once.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from jobs import clock
from jobs.api.health_figures import HealthFigures, read_health
from jobs.models import Job, JobStatus, Request, RequestStatus
from jobs.runtime import Runtime

StatusT = TypeVar("StatusT", bound=StrEnum)


class TokenRate:
    """Tokens per second between the oldest sample of the window and now (totals read at scrape time)."""

    def __init__(self, window_seconds: float = 60.0) -> None:
        self.window = window_seconds
        self.samples: deque[tuple[datetime, int]] = deque()

    def update(self, now: datetime, total: int) -> float:
        """Record the total at `now`; the rate over the window."""
        while self.samples and (now - self.samples[0][0]).total_seconds() > self.window:
            self.samples.popleft()
        self.samples.append((now, total))
        then, before = self.samples[0]
        elapsed = (now - then).total_seconds()
        return max(total - before, 0) / elapsed if elapsed > 0 else 0.0


@dataclass(frozen=True)
class VerificationTotals:
    """The checked outputs of all jobs (gauges, like the tokens: they drop when jobs are deleted)."""

    verified: int = 0
    mismatches: int = 0
    unverified: int = 0


@dataclass(frozen=True)
class StoreCounts:
    """What one read of the store found."""

    at: datetime
    jobs: Mapping[JobStatus, int]
    requests: Mapping[RequestStatus, int]
    tokens: int
    tokens_per_second: float
    checks: VerificationTotals
    health: HealthFigures


def read_counts(session: Session) -> tuple[dict[JobStatus, int], dict[RequestStatus, int], int]:
    """Jobs by status, requests by status and generated tokens: two queries of a few rows each."""
    jobs = dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).tuples().all())
    rows = session.execute(select(Request.status, func.count(), func.coalesce(func.sum(Request.generated_count), 0))
                           .group_by(Request.status)).tuples().all()
    return jobs, {status: count for status, count, _ in rows}, sum(int(tokens) for _, _, tokens in rows)


def read_verification(session: Session) -> VerificationTotals:
    """The checked outputs summed over every job."""
    row = session.execute(select(func.coalesce(func.sum(Job.steps_verified), 0),
                                 func.coalesce(func.sum(Job.verification_mismatches), 0),
                                 func.coalesce(func.sum(Job.steps_unverified), 0))).one()
    return VerificationTotals(int(row[0]), int(row[1]), int(row[2]))


class StoreCollector(Collector):
    """The store's counts, read at most once per `ttl_seconds` however often it is scraped."""

    def __init__(self, runtime: Runtime, *, ttl_seconds: float) -> None:
        self.runtime = runtime
        self.ttl = ttl_seconds
        self.rate = TokenRate()
        self._lock = threading.Lock()  # scrapes run in the server's threads: one reads, the others wait for it
        self._last: StoreCounts | None = None

    def counts(self) -> StoreCounts:
        """The last read if it is younger than the TTL (by the jobs clock), else a new one."""
        with self._lock:
            now = clock.now()
            if self._last is None or not 0 <= (now - self._last.at).total_seconds() < self.ttl:
                self._last = self._read(now)
            return self._last

    def _read(self, now: datetime) -> StoreCounts:
        try:
            with self.runtime.session() as session:
                jobs, requests, tokens = read_counts(session)
                checks = read_verification(session)
                health = read_health(session, self.runtime.settings.api_models)
        except DBAPIError:
            self.runtime.check_store()  # a clean StoreUnavailable (503) when the database is down or not migrated
            raise
        return StoreCounts(now, jobs, requests, tokens, self.rate.update(now, tokens), checks, health)

    def collect(self) -> Iterator[Metric]:
        """The metrics, as of the last read."""
        counts = self.counts()
        yield _by_status("swarmbatch_jobs", "Jobs by status.", counts.jobs, JobStatus)
        yield _by_status("swarmbatch_requests", "Requests by status.", counts.requests, RequestStatus)
        tokens = GaugeMetricFamily("swarmbatch_tokens_generated_total", "Tokens generated by all requests.")
        tokens.add_metric([], counts.tokens)
        yield tokens
        rate = GaugeMetricFamily("swarmbatch_tokens_per_second", "Tokens generated per second, last minute.")
        rate.add_metric([], counts.tokens_per_second)
        yield rate
        for name, documentation, value in (
                ("swarmbatch_steps_verified_total", "Hop steps recomputed on a second server.", counts.checks.verified),
                ("swarmbatch_verification_mismatches_total", "Checked hop steps whose outputs differed (a server was "
                 "banned).", counts.checks.mismatches),
                ("swarmbatch_steps_unverified_total", "Sampled hop steps no second server could recompute.",
                 counts.checks.unverified)):
            family = GaugeMetricFamily(name, documentation)
            family.add_metric([], value)
            yield family
        yield from _health(counts.health)


def _health(health: HealthFigures) -> Iterator[Metric]:
    yield GaugeMetricFamily("swarmbatch_workers_alive", "Workers whose heartbeat is recent.",
                            value=health.workers_alive)
    yield GaugeMetricFamily("swarmbatch_jobs_blocked", "Open jobs a worker marked blocked (the swarm cannot serve "
                            "them now).", value=health.jobs_blocked)
    yield GaugeMetricFamily("swarmbatch_input_line_errors", "Input lines refused at validation, over all jobs.",
                            value=health.input_line_errors)
    for name, documentation, field in (
            ("swarmbatch_swarm_blocks", "Blocks of the model.", "blocks"),
            ("swarmbatch_blocks_without_server", "Blocks no online member server holds, as a worker last saw.",
             "without_server"),
            ("swarmbatch_swarm_servers_online", "Online member servers holding blocks, as a worker last saw.",
             "servers_online"),
            ("swarmbatch_swarm_snapshot_age_seconds", "Age of the swarm snapshot these figures come from.",
             "age_seconds")):
        family = GaugeMetricFamily(name, documentation, labels=["model"])
        for coverage in health.coverage:
            family.add_metric([coverage.model], getattr(coverage, field))
        yield family


def _by_status(name: str, documentation: str, counts: Mapping[StatusT, int],
               statuses: type[StatusT]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=["status"])
    for status in statuses:  # the column holds only members: loading another string raises
        family.add_metric([status], counts.get(status, 0))
    return family


def make_registry(runtime: Runtime) -> CollectorRegistry:
    """A registry of its own per app (never the global one), holding the store collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(runtime, ttl_seconds=runtime.settings.metrics_cache_seconds))
    return registry
