"""The worker's Celery app: the jobs core's app (jobs.queue) with the tasks and the maintenance step, bound to the
process's Runtime, which the tasks and the step read from it (`runtime_of`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from celery import Celery

from jobs.queue import make_celery
from jobs.worker.maintenance import maintenance_step

if TYPE_CHECKING:
    from jobs.runtime import Runtime


class WorkerCelery(Celery):  # type: ignore[misc]  # Celery is untyped
    """A Celery app that carries the Runtime of its process."""

    runtime: Runtime


def make_worker_celery(runtime: Runtime) -> Celery:
    """The app a worker runs (and that beat, the API and the CLI send with): tasks included, maintenance added."""
    app = cast(WorkerCelery, make_celery(runtime.settings, app_class=WorkerCelery, include=("jobs.worker.tasks",)))
    app.runtime = runtime
    app.steps["worker"].add(maintenance_step(runtime))
    return app


def runtime_of(app: Any) -> Runtime:
    """The Runtime a task's (or a signal's) app carries; a clear error for an app not made by make_worker_celery."""
    runtime = getattr(app, "runtime", None)
    if runtime is None:
        raise RuntimeError("this Celery app carries no swarmbatch Runtime: start workers with 'swarmbatch worker' "
                           "(or an app from jobs.assembly.build_runtime(...).celery)")
    return cast("Runtime", runtime)
