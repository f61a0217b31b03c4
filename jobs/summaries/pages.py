"""A finished summarization job's outputs: one Markdown file per document, an index, and the skip state.

Files are written to a temporary name and renamed into place, so a crash never leaves half a file; the
job's metadata records `outputs_written` in the same transaction that records the summaries, and a crash
between the two only means the (identical) files are written again by the next sweep.

A failing output folder (disk full, permissions) is retried a few times, then recorded on the job
(`outputs_error`) for the sweep to retry (`write_pages`); it never undoes the job's status nor stops the caller.
"""
from __future__ import annotations

import logging
import os
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from jobs.models import DocumentSummary, Job, JobStatus, Request, RequestStatus, utcnow

logger = logging.getLogger(__name__)

PAGE_ATTEMPTS = 3  # a full disk may free up in seconds; a permission error needs the operator (the sweep retries)


def pages_due(job: Job) -> bool:
    """Whether `job` is an ended summary job whose pages are not written yet."""
    meta = job.metadata_json or {}
    return "summarize" in meta and job.status.terminal and not meta.get("outputs_written")


def write_pages(*, session: Session, job: Job) -> bool:
    """Write an ended summary job's pages, if due, in the caller's transaction; returns whether it wrote them.

    Under the job's row lock (one writer of the files and summaries per job), in a savepoint: an OSError of the
    output folder is retried PAGE_ATTEMPTS times, then rolled back to the savepoint and recorded on the job
    (`outputs_error`, which the sweep retries). It never raises OSError: the caller's other changes commit.
    """
    if not pages_due(job):
        job.outputs_error = None  # written meanwhile by someone else
        return False
    session.flush()
    session.refresh(job, with_for_update=True)

    def attempt() -> bool:
        with session.begin_nested():
            return write_outputs(session=session, job=job)

    retrying = Retrying(stop=stop_after_attempt(PAGE_ATTEMPTS), wait=wait_exponential(multiplier=0.2, max=2.0),
                        retry=retry_if_exception_type(OSError), reraise=True)
    try:
        written = retrying(attempt)
    except OSError as error:
        job.outputs_error = f"{type(error).__name__}: {error}"
        logger.error("Job %s: could not write its pages (%s); the sweep tries again", job.id, job.outputs_error)
        return False
    job.outputs_error = None
    return written


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


def write_outputs(*, session: Session, job: Job) -> bool:
    """If `job` is a finished summarization job whose outputs are not written yet, write them; the caller commits.

    Returns whether it wrote them. Call it under the job's row lock (or with SQLite's single writer).
    """
    meta = dict(job.metadata_json or {})
    if "schedule" not in meta or meta.get("outputs_written") or not job.status.terminal:
        return False
    output = Path(meta["output"])
    finals = {r.document: r for r in session.scalars(select(Request).where(
        Request.job_id == job.id, Request.final.is_(True), Request.document.is_not(None)))}
    previous = {s.document: s for s in session.scalars(
        select(DocumentSummary).where(DocumentSummary.schedule == meta["schedule"]))}
    lines = []
    for entry in meta["documents"]:
        lines.append(_document_output(session, job, meta, entry, finals.get(entry["key"]),
                                      previous.get(entry["key"]), output))
    write_atomically(output / "index.md", _index(meta, job, lines))
    meta["outputs_written"] = True
    job.metadata_json = meta
    logger.info("Job %s: wrote %d summaries and index.md to %s", job.id,
                sum(1 for line in lines if line[1] == "summarized"), output)
    return True


def _document_output(session: Session, job: Job, meta: dict[str, Any], entry: dict[str, str],
                     final: Request | None, previous: DocumentSummary | None, output: Path) -> tuple[str, str, str]:
    """(key, state, file) for the index, writing the document's Markdown when it was summarized now."""
    key = entry["key"]
    if entry["action"] == "skip":
        return key, "unchanged (skipped)", previous.output_path if previous else ""
    if final is None or final.status != RequestStatus.completed:
        ended = job.status in (JobStatus.cancelled, JobStatus.expired)
        return key, job.status if ended else "failed", ""
    path = output / summary_filename(key)
    now = utcnow()
    write_atomically(path, _markdown(key, entry["source"], meta["model_id"], meta["period"], job.id, now,
                                     final.output_text or ""))
    _record(session, meta, entry, final.output_text or "", str(path), job.id, previous, now)
    return key, "summarized", str(path)


def _record(session: Session, meta: dict[str, Any], entry: dict[str, str], summary: str, path: str, job_id: str,
            previous: DocumentSummary | None, now: datetime) -> None:
    row = previous or DocumentSummary(schedule=meta["schedule"], document=entry["key"])
    row.content_sha, row.model_id, row.template_sha = entry["sha"], meta["model_id"], meta["template_sha"]
    row.summary, row.output_path, row.job_id, row.summarized_at = summary, path, job_id, now
    session.add(row)


def _markdown(key: str, source: str, model_id: str, period: str, job_id: str, when: datetime, summary: str) -> str:
    return (f"# Summary of {key}\n\n"
            f"- Source: `{source}`\n- Model: `{model_id}`\n- Date: {when:%Y-%m-%d %H:%M} UTC (run {period})\n"
            f"- Job: `{job_id}`\n\n{summary.strip()}\n")


def _index(meta: dict[str, Any], job: Job, lines: list[tuple[str, str, str]]) -> str:
    rows = "\n".join(f"| {key} | {state} | {Path(path).name if path else ''} |" for key, state, path in lines)
    return (f"# {meta['schedule']}: summaries\n\nRun {meta['period']}, job `{job.id}` ({job.status}), "
            f"model `{meta['model_id']}`; {meta['skipped']} unchanged documents skipped.\n\n"
            f"| document | state | summary |\n| --- | --- | --- |\n{rows}\n")
