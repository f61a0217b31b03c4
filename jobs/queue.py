"""The task queue as the jobs core sees it: task names, the Celery app that sends them, and `enqueue_job`.

Messages carry job ids only. Tasks are acked late and rejected when their worker dies, but no broker here
redelivers reliably after a whole worker dies, so durability comes from SQL: leases plus the `sweep` task, which
re-enqueues work whose lease expired and which every worker sends on its own timer (jobs.worker.maintenance).
The worker's own app (jobs.worker.celery_app) is this one plus its tasks and its maintenance step.
"""
from __future__ import annotations

from celery import Celery
from kombu.exceptions import KombuError

from jobs.settings import Settings

# Task names are wire names: messages already queued carry them, so they keep their first module path.
PROCESS_JOB, SWEEP, FIRE_SCHEDULES = "jobs.tasks.process_job", "jobs.tasks.sweep", "jobs.tasks.fire_schedules"
MAX_PARALLEL_TASKS = 8  # tasks in flight per job at submission; each re-enqueues itself while work remains
ENQUEUE_ERRORS = (KombuError, OSError)  # kombu wraps the broker's connection errors in OperationalError
SQLA_POLLING_INTERVAL = 0.1  # seconds; kombu's default (1 s) makes the embedded broker sluggish


def make_celery(settings: Settings, *, app_class: type[Celery] = Celery, include: tuple[str, ...] = ()) -> Celery:
    """The app, configured for long, idempotent, short-slice tasks (on Redis, or the embedded SQLite broker)."""
    broker = settings.resolved_broker_url
    if broker.startswith("sqla+"):
        settings.home.mkdir(parents=True, exist_ok=True)
        _speed_up_sqla_transport()
    app = app_class("swarmbatch", broker=broker, include=list(include))
    app.conf.update(
        task_serializer="json", accept_content=["json"], task_ignore_result=True,
        task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
        # a task runs one batch (well under an hour); the sweep, not redelivery, recovers lost work
        broker_transport_options={"visibility_timeout": 3600} if broker.startswith("redis") else {},
        # beat is for schedules only, and only a metronome: which period is due, and whether it fired, is decided
        # in SQL. Lost work needs no beat: every worker ticks the sweep itself (jobs.worker.maintenance)
        beat_schedule={"schedules": {"task": FIRE_SCHEDULES, "schedule": settings.schedule_tick}},
        # task events for Flower and `celery events` (Celery sends none over the embedded SQL broker)
        worker_send_task_events=True, task_send_sent_event=True,
    )
    return app


def enqueue_job(celery: Celery, job_id: str, *, tasks: int = 1, countdown: float = 0.0) -> None:
    """Send `tasks` process_job messages (ids only) for a job, at most MAX_PARALLEL_TASKS."""
    for _ in range(max(1, min(tasks, MAX_PARALLEL_TASKS))):
        celery.send_task(PROCESS_JOB, args=[job_id], countdown=countdown or None)


def _speed_up_sqla_transport() -> None:
    # passing polling_interval as a transport option crashes: the sqla transport forwards every option to
    # create_engine(); the class attribute works
    from kombu.transport import sqlalchemy as sqla_transport

    sqla_transport.Transport.polling_interval = SQLA_POLLING_INTERVAL
