"""What the job benchmarks share: running one job to completion with the worker's own code path, in process."""
from __future__ import annotations

import time

from sqlalchemy import select

from jobs.models import Request
from jobs.runtime import Runtime
from jobs.store import job_counts
from jobs.submission import submit_batch
from jobs.worker import JobWorker


def run_job(runtime: Runtime, model: str, data: bytes) -> tuple[float, int, dict[str, str]]:
    """(seconds, generated tokens, output text by custom_id) of one job, claimed batch after batch, no Celery."""
    job = submit_batch(runtime, data, model=model)
    began = time.perf_counter()
    worker = JobWorker(runtime)
    while worker.process(job.id).more:
        pass
    seconds = time.perf_counter() - began
    with runtime.session() as session:
        counts = job_counts(session=session, job_id=job.id)
        texts = {r.custom_id: r.output_text or ""
                 for r in session.scalars(select(Request).where(Request.job_id == job.id))}
    assert counts.completed == counts.total, counts
    return seconds, counts.tokens, texts
