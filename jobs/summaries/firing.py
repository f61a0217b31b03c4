"""Firing schedules: one job per schedule and period, whoever fires it and however often.

Celery beat sends `jobs.tasks.fire_schedules` every `SWARMBATCH_SCHEDULE_TICK` seconds; the task asks each
schedule for its due period (the last cron time, if not older than its grace) and fires it. A firing's job
carries the idempotency key `schedule:<name>:<period>`, unique in SQL: a restarted beat, two beats by
mistake or a manual re-run of the same period find the key taken and create nothing. Beat keeps no state
that matters.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from jobs import clock
from jobs.batch_input import CHAT_URL, COMPLETIONS_URL, ParsedBatch
from jobs.ingest import runtime_context_length
from jobs.models import DocumentSummary, Job, JobKind, SummaryRun
from jobs.queue import ENQUEUE_ERRORS, enqueue_job
from jobs.runtime import Runtime
from jobs.store import create_job
from jobs.summaries.documents import Document, collect_documents
from jobs.summaries.mapreduce import PlannedRequest, Planner, SummaryShape
from jobs.summaries.schedule_file import Schedule, ScheduleError, load_schedules

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Firing:
    """What one firing did: the job it created (None when the period was already fired)."""

    schedule: str
    period: str
    job_id: str | None
    summarize: int = 0
    skipped: int = 0


def idempotency_key(schedule: Schedule, period: str) -> str:
    """The key that makes a period fire once."""
    return f"schedule:{schedule.name}:{period}"


def fire_due_schedules(runtime: Runtime) -> list[Firing]:
    """Fire every schedule whose period is due now (beat's periodic task)."""
    path = runtime.settings.schedules
    if path is None:
        return []
    now = clock.now()
    firings = []
    for schedule in load_schedules(Path(path)):
        period = schedule.due_period(now)
        if period is None:
            continue
        try:
            firings.append(fire(runtime, schedule, period.isoformat()))
        except ScheduleError as e:  # one broken schedule must not stop the others
            logger.error("Schedule %s: %s", schedule.name, e)
    return firings


def fire_now(runtime: Runtime, schedule: Schedule) -> Firing:
    """`swarmbatch schedules run NAME`: a firing outside the cron, keyed by the current minute."""
    return fire(runtime, schedule, "manual-" + clock.now().replace(second=0, microsecond=0).isoformat())


def fire(runtime: Runtime, schedule: Schedule, period: str) -> Firing:
    """Create (once) and enqueue the job of one period: changed and new documents; unchanged ones skipped."""
    key = idempotency_key(schedule, period)
    with runtime.session() as session:
        if session.scalar(select(Job.id).where(Job.idempotency_key == key)):
            return Firing(schedule.name, period, None)
    documents = collect_documents(schedule)
    model_id = _model_id(runtime, schedule.model)
    fresh, skipped = _split_unchanged(runtime, schedule, documents, model_id)
    planner = Planner(SummaryShape.of(schedule), runtime.tokenizer(schedule.model),
                      runtime_context_length(runtime, schedule.model), schedule.model)
    planned = [request for document in fresh for request in planner.document(document.key, document.text)]
    parsed = planner.parse(planned) if planned else ParsedBatch([], [], CHAT_URL if schedule.chat else COMPLETIONS_URL)
    run = SummaryRun(schedule=schedule.name, period=period, model_id=model_id, output_dir=str(schedule.output_dir),
                     template_sha=schedule.template_sha, shape=SummaryShape.of(schedule).to_dict(),
                     documents=[_document_entry(d, "summarize") for d in fresh] +
                               [_document_entry(d, "skip") for d in skipped],
                     skipped=len(skipped))
    job_id = _create(runtime, schedule, key, parsed, planned, run)
    if job_id is None:
        return Firing(schedule.name, period, None)
    logger.info("Schedule %s fired for %s: job %s, %d documents to summarize, %d unchanged skipped",
                schedule.name, period, job_id, len(fresh), len(skipped))
    if planned:
        try:
            enqueue_job(runtime.celery, job_id, tasks=runtime.settings.tasks_for(len(planned)))
        except ENQUEUE_ERRORS as e:  # the job is stored, with no dispatch hold: the workers' next sweep sends it
            logger.warning("Schedule %s: job %s is stored but its work could not be enqueued (%s); the workers' next "
                           "sweep dispatches it", schedule.name, job_id, " ".join(str(e).split()) or type(e).__name__)
    return Firing(schedule.name, period, job_id, len(fresh), len(skipped))


def _create(runtime: Runtime, schedule: Schedule, key: str, parsed: ParsedBatch, planned: list[PlannedRequest],
            run: SummaryRun) -> str | None:
    """Insert the job and its summary run under its idempotency key; None when another firing inserted it first."""
    with runtime.session() as session:
        try:
            job = create_job(session=session, parsed=parsed, model=schedule.model, idempotency_key=key,
                             checkpoint_every=runtime.settings.checkpoint_every, kind=JobKind.summary,
                             input_filename=f"schedule:{schedule.name}",
                             annotations={p.line["custom_id"]: p.annotation for p in planned})
            job.summary = run
            if not planned:  # nothing changed: the night's job completes at once, and writes its index
                runtime.lifecycle.settle(session, job)
            session.commit()
            return job.id
        except IntegrityError:
            session.rollback()
            logger.info("Schedule %s: %s was already fired by another beat", schedule.name, key)
            return None


def _split_unchanged(runtime: Runtime, schedule: Schedule, documents: list[Document], model_id: str
                     ) -> tuple[list[Document], list[Document]]:
    """(documents to summarize, documents unchanged since their last successful summary)."""
    with runtime.session() as session:
        previous = {s.document: s for s in session.scalars(
            select(DocumentSummary).where(DocumentSummary.schedule == schedule.name))}
    fresh: list[Document] = []
    skipped: list[Document] = []
    for document in documents:
        last = previous.get(document.key)
        unchanged = last is not None and (last.content_sha, last.model_id, last.template_sha) == (
            document.content_sha, model_id, schedule.template_sha)
        (skipped if unchanged else fresh).append(document)
    return fresh, skipped


def _document_entry(document: Document, action: str) -> dict[str, str]:
    return {"key": document.key, "source": document.source, "sha": document.content_sha, "action": action}


def _model_id(runtime: Runtime, model: str) -> str:
    """The model's id including its weights revision: a new revision re-summarizes every document."""
    from swarmnet.model_spec import ModelSpec

    return ModelSpec.open(runtime.model_dir(model)).model_id


def next_runs(schedules: list[Schedule], now: datetime | None = None) -> dict[str, datetime]:
    """Each schedule's next run."""
    now = now or clock.now()
    return {s.name: s.next_run(now) for s in schedules}
