"""`make_celery(settings)`: the Celery app, on Redis in production or an embedded SQLite broker by default.

Messages carry job ids only. Tasks are acked late and rejected when their worker dies, but no broker here
redelivers reliably after a whole worker dies, so durability comes from SQL: leases plus the `sweep` task, which
re-enqueues work whose lease expired and which every worker sends on its own timer (jobs.worker.maintenance).
"""
from __future__ import annotations

from celery import Celery

from jobs.settings import Settings

# Task names are wire names: messages already queued carry them, so they keep their first module path.
PROCESS_JOB, SWEEP, FIRE_SCHEDULES = "jobs.tasks.process_job", "jobs.tasks.sweep", "jobs.tasks.fire_schedules"
SQLA_POLLING_INTERVAL = 0.1  # seconds; kombu's default (1 s) makes the embedded broker sluggish


def make_celery(settings: Settings) -> Celery:
    """The app, configured for long, idempotent, short-slice tasks."""
    broker = settings.resolved_broker_url
    if broker.startswith("sqla+"):
        settings.home.mkdir(parents=True, exist_ok=True)
        _speed_up_sqla_transport()
    app = Celery("swarmbatch", broker=broker, include=["jobs.worker.tasks"])
    app.conf.update(
        task_serializer="json", accept_content=["json"], task_ignore_result=True,
        task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
        # a task runs one batch (well under an hour); the sweep, not redelivery, recovers lost work
        broker_transport_options={"visibility_timeout": 3600} if broker.startswith("redis") else {},
        # beat is for schedules only, and only a metronome: which period is due, and whether it fired, is decided
        # in SQL. Lost work needs no beat: every worker ticks the sweep itself (jobs.worker.maintenance)
        beat_schedule={"schedules": {"task": FIRE_SCHEDULES, "schedule": settings.schedule_tick}},
    )
    from jobs.worker.maintenance import Maintenance  # it needs this module's task names

    app.steps["worker"].add(Maintenance)
    return app


def _speed_up_sqla_transport() -> None:
    # passing polling_interval as a transport option crashes: the sqla transport forwards every option to
    # create_engine(); the class attribute works
    from kombu.transport import sqlalchemy as sqla_transport

    sqla_transport.Transport.polling_interval = SQLA_POLLING_INTERVAL
