"""An ended summary job's pages: one Markdown file per document, an index, and the skip state.

Files are written to a temporary name and renamed into place, so a crash never leaves half a file. The job's
summary run records `pages_written_at` in the same transaction as the summaries (and as the transition that
ended the job), under the run's row lock, so the pages are written once; a crash before the commit only means
the (identical) files are written again. A write that fails (disk full, no permission, a file where the folder
should be) is recorded on the run (`pages_error`) and retried by later sweeps with backoff, at most
MAX_PAGE_ATTEMPTS times in all; it never fails the transition that ended the job.
"""
from __future__ import annotations

import logging
import os
import tempfile
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from jobs.models import DocumentSummary, Job, JobStatus, Request, RequestStatus, SummaryRun

logger = logging.getLogger(__name__)

MAX_PAGE_ATTEMPTS = 5
FIRST_RETRY_DELAY = timedelta(minutes=1)  # doubled after each failure: 1, 2, 4, 8 min


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` via a temporary file in the same folder and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def summary_filename(key: str) -> str:
    """A flat, safe Markdown file name for a document key ('notes/a.md' -> 'notes__a.md.md')."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in key.replace("/", "__"))
    return f"{safe}.md"


def write_pages_once(*, session: Session, job: Job, now: datetime) -> bool:
    """Write an ended summary job's pages unless written or given up; returns whether they were written.

    A failure is recorded on the run and scheduled for a retry (jobs.lifecycle.retry_ended); the caller commits.
    """
    run = _locked_run(session, job)
    if run is None or run.pages_written_at is not None or run.pages_attempts >= MAX_PAGE_ATTEMPTS:
        return False
    if run.pages_retry_at is not None and run.pages_retry_at > now:  # an overlapping sweep just tried: not due
        return False
    run.pages_attempts += 1
    session.flush()  # the attempt counts whatever happens; and on SQLite the savepoint below is then not outermost
    try:
        with session.begin_nested():  # a failed write keeps none of its summaries
            write_pages(session=session, job=job, run=run, now=now)
    except OSError as error:
        _record_failure(run, error, now)
        return False
    run.pages_written_at, run.pages_error, run.pages_retry_at = now, None, None
    return True


def due_retries(*, session: Session, now: datetime) -> list[str]:
    """Jobs whose page write failed and whose next try is due."""
    return list(session.scalars(select(SummaryRun.job_id).where(
        SummaryRun.pages_written_at.is_(None), SummaryRun.pages_retry_at <= now).order_by(SummaryRun.pages_retry_at)))


def write_pages(*, session: Session, job: Job, run: SummaryRun, now: datetime) -> None:
    """Write the pages and index of `run` to its output folder and record the summaries; raises OSError."""
    output = Path(run.output_dir)
    finals = {r.document: r for r in session.scalars(select(Request).where(
        Request.job_id == job.id, Request.final.is_(True), Request.document.is_not(None)))}
    previous = {s.document: s for s in session.scalars(
        select(DocumentSummary).where(DocumentSummary.schedule == run.schedule))}
    lines = [_document_output(session, job, run, entry, finals.get(entry["key"]), previous.get(entry["key"]), now)
             for entry in run.documents]
    write_atomically(output / "index.md", _index(run, job, lines))
    logger.info("Job %s: wrote %d summaries and index.md to %s", job.id,
                sum(1 for line in lines if line[1] == "summarized"), output)


def _locked_run(session: Session, job: Job) -> SummaryRun | None:
    """The job's summary run, read afresh under its row lock: one writer of the pages per job."""
    return session.scalar(select(SummaryRun).where(SummaryRun.job_id == job.id).with_for_update()
                          .execution_options(populate_existing=True))


def _record_failure(run: SummaryRun, error: OSError, now: datetime) -> None:
    run.pages_error = f"{type(error).__name__}: {error}"
    retry = run.pages_attempts < MAX_PAGE_ATTEMPTS
    run.pages_retry_at = now + FIRST_RETRY_DELAY * 2 ** (run.pages_attempts - 1) if retry else None
    logger.warning("Job %s: pages not written to %s (attempt %d of %d): %s%s", run.job_id, run.output_dir,
                   run.pages_attempts, MAX_PAGE_ATTEMPTS, run.pages_error,
                   f"; retrying after {run.pages_retry_at:%H:%M:%S} UTC" if retry else "; giving up")


def _document_output(session: Session, job: Job, run: SummaryRun, entry: dict[str, str], final: Request | None,
                     previous: DocumentSummary | None, now: datetime) -> tuple[str, str, str]:
    """(key, state, file) for the index, writing the document's Markdown when it was summarized now."""
    key = entry["key"]
    if entry["action"] == "skip":
        return key, "unchanged (skipped)", previous.output_path if previous else ""
    if final is None or final.status != RequestStatus.completed:
        ended = job.status in (JobStatus.cancelled, JobStatus.expired)
        return key, job.status if ended else "failed", ""
    path = Path(run.output_dir) / summary_filename(key)
    write_atomically(path, _markdown(key, entry["source"], run.model_id, run.period, job.id, now,
                                     final.output_text or ""))
    _record(session, run, entry, final.output_text or "", str(path), job.id, previous, now)
    return key, "summarized", str(path)


def _record(session: Session, run: SummaryRun, entry: dict[str, str], summary: str, path: str, job_id: str,
            previous: DocumentSummary | None, now: datetime) -> None:
    row = previous or DocumentSummary(schedule=run.schedule, document=entry["key"])
    row.content_sha, row.model_id, row.template_sha = entry["sha"], run.model_id, run.template_sha
    row.summary, row.output_path, row.job_id, row.summarized_at = summary, path, job_id, now
    session.add(row)


def _markdown(key: str, source: str, model_id: str, period: str, job_id: str, when: datetime, summary: str) -> str:
    return (f"# Summary of {key}\n\n"
            f"- Source: `{source}`\n- Model: `{model_id}`\n- Date: {when:%Y-%m-%d %H:%M} UTC (run {period})\n"
            f"- Job: `{job_id}`\n\n{summary.strip()}\n")


def _index(run: SummaryRun, job: Job, lines: list[tuple[str, str, str]]) -> str:
    rows = "\n".join(f"| {key} | {state} | {Path(path).name if path else ''} |" for key, state, path in lines)
    return (f"# {run.schedule}: summaries\n\nRun {run.period}, job `{job.id}` ({job.status}), "
            f"model `{run.model_id}`; {run.skipped} unchanged documents skipped.\n\n"
            f"| document | state | summary |\n| --- | --- | --- |\n{rows}\n")
