"""Waiting on and reading jobs in tests of real workers."""
from __future__ import annotations

import time
from collections.abc import Callable

from sqlalchemy import select

from jobs.models import Job, Request
from jobs.runtime import Runtime


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def job_status(runtime: Runtime, job_id: str) -> str:
    with runtime.session() as session:
        return str(session.scalar(select(Job.status).where(Job.id == job_id)))


def requests_of(runtime: Runtime, job_id: str) -> list[Request]:
    with runtime.session() as session:
        return list(session.scalars(select(Request).where(Request.job_id == job_id).order_by(Request.index)))
