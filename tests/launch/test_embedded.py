"""The embedded stack's bookkeeping when it stops: which lease owners it gives back."""
from __future__ import annotations

import os
from collections.abc import Callable

import psutil
from factories import new_job

from jobs import store
from jobs.runtime import Runtime, local_pid_of, worker_name_of
from launch.embedded import dead_local_owners


def a_dead_pid() -> int:
    """A process id no process has now."""
    pid = 4_194_304 + 17  # above Linux's largest pid_max
    assert not psutil.pid_exists(pid)
    return pid


def test_only_stopped_processes_of_this_machine_are_dead_owners(make_runtime: Callable[..., Runtime]) -> None:
    # Given requests leased by a live process here, a stopped one here, and a process of another machine
    runtime = make_runtime()
    job_id = new_job(runtime, count=3)
    alive, dead, elsewhere = worker_name_of(os.getpid()), worker_name_of(a_dead_pid()), "another-host:1"
    with runtime.session() as session:
        for owner in (alive, dead, elsewhere):
            store.claim_requests(session=session, job_id=job_id, worker=owner, limit=1, lease_seconds=60,
                                 max_attempts=5)
        session.commit()
        # Then only the stopped process of this machine is a dead owner, the one the stack gives back
        assert sorted(store.lease_owners(session=session)) == sorted([alive, dead, elsewhere])
        assert dead_local_owners(session) == [dead]


def test_a_lease_owner_name_gives_back_its_pid_only_on_this_machine() -> None:
    assert local_pid_of(worker_name_of(1234)) == 1234
    assert local_pid_of("another-host:1234") is None and local_pid_of("garbage") is None
