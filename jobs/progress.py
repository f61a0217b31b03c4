"""Showing a job to a person: one status line, and a live progress bar while it runs."""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

TERMINAL = {"completed", "failed", "cancelled", "expired"}


def describe_job(job: dict[str, Any]) -> str:
    """One line: id, status, counts, tokens, checked outputs, and what blocks it."""
    counts = job["request_counts"]
    line = (f"{job['id']}  {job['status']:<11} {counts['completed']}/{counts['total']} completed, "
            f"{counts['failed']} failed, {job.get('tokens_generated', 0)} tokens")
    if job.get("errors"):
        line += f", {len(job['errors']['data'])} bad input lines"
    line += verification_note(job.get("verification") or {})
    summary = job.get("summary") or {}
    if summary.get("skipped"):
        line += f", {summary['skipped']} unchanged documents skipped"
    if summary.get("pages_error"):
        line += f"; pages not written: {summary['pages_error']}"
    for worker, plan in sorted((job.get("pipeline") or {}).items()):
        line += f"; {worker}: claim {plan['claim']} in {plan['lanes']} lanes ({plan['bound']})"
    if job.get("blocked_reason") and job["status"] not in TERMINAL:
        line += f"; blocked: {job['blocked_reason']}"
    return line


def verification_note(checks: dict[str, Any]) -> str:
    """', 120 steps verified (1 mismatch: a server computed wrong outputs and was banned)', or '' when none was."""
    verified, mismatches = checks.get("steps_verified", 0), checks.get("mismatches", 0)
    if not verified:
        return ""
    if not mismatches:
        return f", {verified} steps verified"
    return f", {verified} steps verified ({mismatches} mismatch{'es' if mismatches > 1 else ''}: wrong outputs, server banned)"


def follow_job(client: Any, job_id: str, *, interval: float = 1.0,
               check_alive: Callable[[], None] | None = None) -> dict[str, Any]:
    """Poll a job and draw a progress bar of requests and tokens on stderr until it ends; returns the job.

    :param check_alive: called each poll; raises (e.g. WorkerGone) when what runs the job is gone, so a caller that
        started its own worker never waits forever on a dead one
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    began = time.monotonic()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} requests"),
                  TextColumn("{task.fields[tokens]} tokens, {task.fields[rate]:.1f} tok/s"), TimeElapsedColumn(),
                  TextColumn("{task.fields[note]}"), transient=False,
                  console=Console(file=sys.stderr)) as bar:
        task = bar.add_task(job_id, total=None, tokens=0, rate=0.0, note="")
        first_tokens: int | None = None  # a resumed job's earlier tokens do not count in this rate
        while True:
            job = client.get(job_id)
            counts = job["request_counts"]
            tokens = job.get("tokens_generated", 0)
            first_tokens = tokens if first_tokens is None else first_tokens
            bar.update(task, total=counts["total"], completed=counts["completed"] + counts["failed"], tokens=tokens,
                       rate=(tokens - first_tokens) / max(time.monotonic() - began, 1e-6), description=job["status"],
                       note=f"blocked: {job['blocked_reason']}" if job.get("blocked_reason") else "")
            if job["status"] in TERMINAL:
                return job
            if check_alive is not None:
                check_alive()
            time.sleep(interval)
