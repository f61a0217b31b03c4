"""Celery tasks: thin wrappers that load rows, call the worker logic, and schedule what comes next.

Each task reads the process's Runtime from the app that runs it (jobs.worker.celery_app.runtime_of).
"""
from __future__ import annotations

import logging
from typing import Any

from celery import current_app, shared_task
from celery.signals import worker_process_init

from jobs.queue import FIRE_SCHEDULES, PROCESS_JOB, SWEEP, enqueue_job
from jobs.worker.celery_app import runtime_of
from jobs.worker.job_worker import JobWorker, retry_delay
from jobs.worker.sweep import sweep_store

logger = logging.getLogger(__name__)


@worker_process_init.connect
def _init_worker_process(**_: Any) -> None:
    """After the fork: one torch thread per pool process (threads x processes <= cores), fresh DB connections."""
    import torch

    runtime = runtime_of(current_app)
    torch.set_num_threads(runtime.settings.worker_threads)
    runtime.engine.dispose(close=False)


@shared_task(name=PROCESS_JOB, bind=True, max_retries=None)
def process_job(self: Any, job_id: str, give_back: dict[str, Any] | None = None) -> None:
    """Generate one batch of a job's pending requests; re-enqueue while work remains. A job whose lines are still
    to be checked (a REST submission) has them checked first (jobs.ingest), then as many chains sent as they need.

    `give_back`: a batch of this task that a store outage stopped, to give back uncounted first.
    """
    runtime = runtime_of(self.app)
    outcome = JobWorker(runtime).process(job_id, give_back=give_back)
    if outcome.retry:
        raise self.retry(args=[job_id], kwargs={"give_back": outcome.give_back} if outcome.give_back else {},
                         countdown=retry_delay(self.request.retries))
    if outcome.more or outcome.chains:
        enqueue_job(runtime.celery, job_id, tasks=max(1, outcome.chains))


@shared_task(name=SWEEP, bind=True)
def sweep(self: Any) -> None:
    """Re-enqueue work whose lease expired, expire jobs past their deadline, finalize finished jobs."""
    runtime = runtime_of(self.app)
    for job_id in sweep_store(runtime):
        enqueue_job(runtime.celery, job_id)


@shared_task(name=FIRE_SCHEDULES, bind=True)
def fire_schedules(self: Any) -> None:
    """Fire each due schedule once per period (SWARMBATCH_SCHEDULES); beat sends this every schedule_tick."""
    from jobs.summaries.firing import fire_due_schedules

    fire_due_schedules(runtime_of(self.app))
