"""The summaries feature in the job lifecycle: how a summary job's map-reduce moves on and its pages get written."""
from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from jobs.lifecycle import JobHooks
from jobs.models import Job
from jobs.runtime import Runtime
from jobs.summaries import mapreduce, pages


class SummaryHooks(JobHooks):
    """Hooks of JobKind.summary: the next map-reduce stage before settling; the pages once the job ends."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def on_settling(self, session: Session, job: Job) -> None:
        """Add the next stage of every document whose last stage completed."""
        mapreduce.advance(session=session, job=job, planner=mapreduce.planner_for(self.runtime, job))

    def on_ended(self, session: Session, job: Job, now: datetime) -> None:
        """Write the job's pages, once; a failure is recorded for a later retry."""
        pages.write_pages_once(session=session, job=job, now=now)

    def due_retries(self, session: Session, now: datetime) -> list[str]:
        """Summary jobs whose page write failed and may be tried again now."""
        return pages.due_retries(session=session, now=now)
