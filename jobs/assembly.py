"""The process's Runtime, assembled: the jobs core wired with every job kind's hooks and the worker's Celery app.

This module sits above the core, `worker/`, `summaries/` and `api/` (nothing in `jobs` imports it but
`jobs.celery`, the app of `celery -A jobs`): entry points (`commands/`, `launch/`), benchmarks and tests build their
runtime here.
"""
from __future__ import annotations

from collections.abc import Mapping

from jobs.lifecycle import JobHooks
from jobs.models import JobKind
from jobs.runtime import Runtime
from jobs.settings import Settings, get_settings
from jobs.summaries.hooks import SummaryHooks
from jobs.worker.celery_app import make_worker_celery


def job_kind_hooks(runtime: Runtime) -> Mapping[JobKind, JobHooks]:
    """Each job kind's hooks: a user's batch adds none; a summary job runs its map-reduce and writes its pages."""
    return {JobKind.batch: JobHooks(), JobKind.summary: SummaryHooks(runtime)}


def build_runtime(settings: Settings) -> Runtime:
    """A runtime with every job kind's hooks and the worker's Celery app."""
    return Runtime(settings, make_hooks=job_kind_hooks, make_celery=make_worker_celery)


_runtime: Runtime | None = None


def get_runtime() -> Runtime:
    """This process's runtime (built on first use, from get_settings())."""
    global _runtime
    if _runtime is None:
        _runtime = build_runtime(get_settings())
    return _runtime


def set_runtime(runtime: Runtime | None) -> None:
    """Replace this process's runtime (entry points and tests)."""
    global _runtime
    _runtime = runtime
