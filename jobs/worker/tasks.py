"""Celery tasks: thin wrappers that load rows, call the worker logic, and schedule what comes next."""
from __future__ import annotations

import logging
from typing import Any

from celery import shared_task
from celery.signals import worker_process_init

from jobs.runtime import get_runtime
from jobs.worker.batch_worker import JobWorker, retry_delay
from jobs.worker.celery_app import FIRE_SCHEDULES, PROCESS_JOB, SWEEP
from jobs.worker.sweep import sweep_store

logger = logging.getLogger(__name__)


@worker_process_init.connect
def _init_worker_process(**_: Any) -> None:
    """After the fork: one torch thread per pool process (threads x processes <= cores), fresh DB connections."""
    import torch

    torch.set_num_threads(get_runtime().settings.worker_threads)
    get_runtime().engine.dispose(close=False)


@shared_task(name=PROCESS_JOB, bind=True, max_retries=None)
def process_job(self: Any, job_id: str, give_back: dict[str, Any] | None = None) -> None:
    """Generate one batch of a job's pending requests; re-enqueue while work remains.

    `give_back`: a batch of this task that a store outage stopped, to give back uncounted first.
    """
    runtime = get_runtime()
    outcome = JobWorker(runtime).process(job_id, give_back=give_back)
    if outcome.retry:
        raise self.retry(args=[job_id], kwargs={"give_back": outcome.give_back} if outcome.give_back else {},
                         countdown=retry_delay(self.request.retries))
    if outcome.more:
        runtime.celery.send_task(PROCESS_JOB, args=[job_id])


@shared_task(name=SWEEP)
def sweep() -> None:
    """Re-enqueue work whose lease expired, expire jobs past their deadline, finalize finished jobs."""
    runtime = get_runtime()
    for job_id in sweep_store(runtime):
        runtime.celery.send_task(PROCESS_JOB, args=[job_id])


@shared_task(name=FIRE_SCHEDULES)
def fire_schedules() -> None:
    """Fire each due schedule once per period (SWARMBATCH_SCHEDULES); beat sends this every schedule_tick."""
    from jobs.summaries.firing import fire_due_schedules

    fire_due_schedules(get_runtime())
