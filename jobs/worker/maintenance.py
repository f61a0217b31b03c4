"""Every worker keeps the store moving by itself, beat or no beat (as rq's workers maintain their registries).

A worker-level bootstep ticks every `sweep_interval` seconds in the worker's main process: it writes the
worker's heartbeat and, if its tick wins the sweep slot (jobs.liveness.take_slot), sends one `sweep` task. So a
dead worker's leases come back and its jobs resume within a lease period and a tick, with only workers running,
and many workers still sweep about once per interval between them. The tick does SQL and one publish only: the
sweep itself runs in a pool process, where torch and the tokenizers may load.
"""
from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

from jobs import liveness
from jobs.queue import SWEEP
from jobs.runtime import Runtime

logger = logging.getLogger(__name__)

SWEEP_SLOT = "sweep"
TICKS_ALIVE = 3  # a worker counts as alive for this many ticks after its last one


def tick(runtime: Runtime, *, starting: bool = False) -> bool:
    """Write this worker's heartbeat; send the sweep if this tick won its slot. Returns whether it did.

    A starting worker sweeps whatever the slot says: it looks at once for work a dead worker left behind.
    """
    interval = runtime.settings.sweep_interval
    with runtime.session() as session:
        liveness.record_heartbeat(session=session, worker=runtime.worker_name, alive_for=TICKS_ALIVE * interval)
        due = liveness.take_slot(session=session, name=SWEEP_SLOT, interval=interval) or starting
        session.commit()
    if due:
        runtime.celery.send_task(SWEEP)
    return due


def safe_tick(runtime: Runtime, *, starting: bool = False) -> None:
    """A tick that never raises: a database or broker blip is logged and the next tick tries again."""
    try:
        tick(runtime, starting=starting)
    except Exception as error:  # the timer must keep ticking through any outage
        logger.warning("Maintenance tick failed (%s: %s); retrying in %.0f s", type(error).__name__,
                       str(error).splitlines()[0] if str(error) else "", runtime.settings.sweep_interval)


def leave(runtime: Runtime) -> None:
    """A clean stop: this worker no longer counts as alive."""
    try:
        with runtime.session() as session:
            liveness.forget_worker(session=session, worker=runtime.worker_name)
            session.commit()
    except Exception as error:  # stopping must not fail; the heartbeat then just ages out
        logger.warning("Could not remove this worker's heartbeat (%s); it expires by itself", error)


def maintenance_step(runtime: Runtime) -> type[bootsteps.StartStopStep]:
    """The worker bootstep that runs `safe_tick` for `runtime` on the worker's timer from start to stop."""

    class Maintenance(bootsteps.StartStopStep):  # type: ignore[misc]  # celery is untyped
        requires = {"celery.worker.components:Timer"}

        def __init__(self, worker: Any, **kwargs: Any) -> None:
            super().__init__(worker, **kwargs)
            self.timer_entry: Any = None

        def start(self, worker: Any) -> None:
            safe_tick(runtime, starting=True)
            self.timer_entry = worker.timer.call_repeatedly(runtime.settings.sweep_interval, safe_tick, (runtime,),
                                                            priority=10)

        def stop(self, worker: Any) -> None:
            if self.timer_entry is not None:
                self.timer_entry.cancel()
                self.timer_entry = None
                leave(runtime)

    return Maintenance
