"""The embedded stack: a DHT node, two block servers splitting one model, and one worker on the SQLite store and
broker under SWARMBATCH_HOME, all on this machine; `swarmbatch demo` and `swarmbatch run` run their jobs on it.

Stopping it stops every process it started, by PID: the worker first, then the swarm. Stopped by an error or
Ctrl-C, the worker is killed at once (its checkpoints are in the store) and the requests it held are given back,
so the next worker resumes them without waiting for their leases to lapse.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
from sqlalchemy.orm import Session

from jobs import store
from jobs.runtime import Runtime, local_pid_of
from jobs.settings import Settings
from launch.local_swarm import LocalSwarm
from launch.local_worker import start_local_worker
from launch.processes import ManagedProcess, interrupts_ignored
from swarmnet.model_spec import ModelSpec

STOPPED = "its worker was stopped before it finished (the embedded stack was interrupted)"


def two_spans(model_dir: Path) -> list[tuple[int, int]]:
    """The model's blocks split between two servers (one server for a one-block model)."""
    blocks = ModelSpec.open(model_dir).num_blocks
    if blocks < 2:
        return [(0, blocks)]
    return [(0, blocks // 2), (blocks // 2, blocks)]


def describe_spans(spans: list[tuple[int, int]]) -> str:
    """'blocks 0:15 and 15:30'."""
    return "blocks " + " and ".join(f"{start}:{end}" for start, end in spans)


@contextmanager
def embedded_stack(runtime: Runtime, model_dir: Path, *, log_dir: Path) -> Iterator[ManagedProcess]:
    """Start the swarm (until every server serves), then the worker; yields the worker; stops them all on exit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    swarm = LocalSwarm(model_dir, two_spans(model_dir), log_dir=log_dir)
    worker: ManagedProcess | None = None
    interrupted = False
    try:
        swarm.start()
        worker = start_local_worker(worker_settings(runtime.settings, swarm), log_dir=log_dir)
        yield worker
    except BaseException:
        interrupted = True
        raise
    finally:
        with interrupts_ignored():  # a second Ctrl-C must not leave a child running
            if worker is not None:
                stop_worker(worker, runtime, at_once=interrupted)
            swarm.stop()


def worker_settings(settings: Settings, swarm: LocalSwarm) -> Settings:
    """The settings of a worker of this swarm."""
    return settings.model_copy(update={"initial_peers": swarm.initial_peers})


def stop_worker(worker: ManagedProcess, runtime: Runtime, *, at_once: bool) -> None:
    """Stop the worker and its pool processes (gracefully, or killed `at_once`), then give back what they held, and
    what any other stopped worker process of this machine still holds (one that died before: its pool processes
    are no longer the worker's children, so only their names in the store say they held leases)."""
    if at_once:
        worker.kill()
    else:
        worker.terminate()
    with runtime.session() as session:
        owners = dead_local_owners(session)
        if owners:
            store.release_owned(session=session, owners=owners, error=STOPPED)
            session.commit()


def dead_local_owners(session: Session) -> list[str]:
    """The lease owners of requests in progress that are processes of this machine no longer running."""
    return [owner for owner in store.lease_owners(session=session)
            if (pid := local_pid_of(owner)) is not None and not psutil.pid_exists(pid)]
