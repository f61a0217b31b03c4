"""Workers maintain the store themselves: heartbeats, one sweep per interval however many tick, one chain per job.

On the embedded SQLite database and a real PostgreSQL; times are passed as `now=`, so no clock is mocked.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from factories import new_job
from jobs_support import wait_for
from sqlalchemy import select
from sqlalchemy.orm import Session

from jobs import liveness, store
from jobs.models import Job, RequestStatus, WorkerHeartbeat, utcnow
from jobs.outputs import job_public
from jobs.queue import SWEEP
from jobs.runtime import Runtime
from jobs.submission import submit_batch
from jobs.worker.job_worker import JobWorker
from jobs.worker.maintenance import SWEEP_SLOT, tick
from jobs.worker.sizing import PipelinePlan
from jobs.worker.sweep import sweep_store
from launch.local_worker import start_local_worker


@pytest.fixture(params=["sqlite", "postgres"])
def runtime(request: pytest.FixtureRequest, make_runtime: Callable[..., Runtime]) -> Runtime:
    """A migrated store: the embedded SQLite file, or a fresh PostgreSQL database (memory broker: nothing runs)."""
    if request.param == "sqlite":
        return make_runtime(broker_url="memory://")
    return make_runtime(database_url=request.getfixturevalue("postgres_url"), broker_url="memory://")


def at_once(runtime: Runtime, count: int, step: Callable[[Session], bool]) -> list[bool]:
    """Run `step` in `count` threads, each in its own session, released together at a barrier; commit each."""
    results: list[bool] = []
    barrier = threading.Barrier(count)

    def run() -> None:
        with runtime.session() as session:
            barrier.wait()
            results.append(step(session))
            session.commit()
    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_of_many_workers_ticking_at_once_exactly_one_takes_the_sweep_slot_per_interval(runtime: Runtime) -> None:
    # Given 8 workers whose ticks fall at the same moment, the very first ticks of this store
    now = utcnow()

    def take(session: Session) -> bool:
        return liveness.take_slot(session=session, name=SWEEP_SLOT, interval=10, now=now)
    won = at_once(runtime, 8, take)
    # Then one of them sweeps; within the interval nobody else does, and after it the next tick does
    assert sorted(won) == [False] * 7 + [True]
    with runtime.session() as session:
        assert not liveness.take_slot(session=session, name=SWEEP_SLOT, interval=10, now=now + timedelta(seconds=9))
        assert liveness.take_slot(session=session, name=SWEEP_SLOT, interval=10, now=now + timedelta(seconds=10))
        session.commit()


def test_a_worker_counts_as_alive_until_its_heartbeat_expires_or_it_leaves(runtime: Runtime) -> None:
    now = utcnow()
    with runtime.session() as session:
        assert liveness.live_workers(session=session, now=now) == 0 and liveness.last_heartbeat(session=session) is None
        liveness.record_heartbeat(session=session, worker="host:1", alive_for=30, now=now)
        liveness.record_heartbeat(session=session, worker="host:2", alive_for=30, now=now)
        liveness.record_heartbeat(session=session, worker="host:1", alive_for=30, now=now + timedelta(seconds=20))
        session.commit()
        assert liveness.live_workers(session=session, now=now + timedelta(seconds=29)) == 2
        assert liveness.live_workers(session=session, now=now + timedelta(seconds=31)) == 1
        liveness.forget_worker(session=session, worker="host:1")
        session.commit()
        assert liveness.live_workers(session=session, now=now + timedelta(seconds=21)) == 1
        assert liveness.last_heartbeat(session=session) == now


def test_a_blocked_job_keeps_one_dispatch_however_many_sweeps_run(runtime: Runtime) -> None:
    # Given a job with pending work and nothing running
    job_id = new_job(runtime, 2)
    # When many sweeps run, then one dispatches it and the others do not, until the hold of a lease period ends
    dispatched = [sweep_store(runtime) for _ in range(6)]
    assert dispatched == [[job_id]] + [[]] * 5
    # And when the job is blocked (its task's own retry chain holds it), sweeps leave it to that chain
    with runtime.session() as session:
        job = store.get_job(session=session, job_id=job_id)
        job.dispatch_after = utcnow() + timedelta(seconds=120)
        session.commit()
    assert sweep_store(runtime) == []
    # And once the hold is overdue (the chain was lost with its worker), the next sweep dispatches it once
    with runtime.session() as session:
        store.get_job(session=session, job_id=job_id).dispatch_after = utcnow() - timedelta(seconds=1)
        session.commit()
    assert [sweep_store(runtime) for _ in range(3)] == [[job_id], [], []]


def test_of_concurrent_sweeps_exactly_one_wins_a_jobs_dispatch(runtime: Runtime) -> None:
    job_id = new_job(runtime, 1)
    now = utcnow()

    def hold(session: Session) -> bool:
        job = session.get(Job, job_id)
        assert job is not None
        return store.hold_dispatch(session=session, job=job, seconds=60, now=now)
    won = at_once(runtime, 6, hold)
    assert sorted(won) == [False] * 5 + [True]


def test_status_says_when_waiting_work_has_no_live_worker(runtime: Runtime) -> None:
    job_id = new_job(runtime, 2)
    with runtime.session() as session:
        reason = job_public(session=session, job=store.get_job(session=session, job_id=job_id))["blocked_reason"]
    assert reason == "no worker is running (none has run); start one with 'swarmbatch worker'"
    # a worker that ticks makes the job merely queued again
    assert tick(runtime) is True
    with runtime.session() as session:
        assert job_public(session=session, job=store.get_job(session=session, job_id=job_id))["blocked_reason"] is None


@pytest.mark.swarm
def test_a_real_worker_process_heartbeats_and_sweeps_without_beat_and_leaves_cleanly(
        make_runtime: Callable[..., Runtime], tmp_path: Path) -> None:
    # Given a worker without --beat on the embedded store, ticking every second
    runtime = make_runtime(sweep_interval=1.0)
    worker = start_local_worker(runtime.settings, log_dir=tmp_path, verbose=True)
    try:
        def heartbeats() -> list[WorkerHeartbeat]:
            with runtime.session() as session:
                return list(session.scalars(select(WorkerHeartbeat)))
        # Then it writes its heartbeat, and its ticks send sweeps that its pool runs
        wait_for(lambda: len(heartbeats()) == 1, 60, "the worker's heartbeat")
        first = heartbeats()[0].last_seen
        wait_for(lambda: heartbeats()[0].last_seen > first, 10, "a later tick")
        wait_for(lambda: worker.log_path.read_text().count(SWEEP) >= 3, 30, "sweeps run by the worker")
    finally:
        worker.terminate()
    # And when it stops cleanly, it no longer counts as alive
    assert heartbeats() == []


def test_a_submitted_job_gets_no_second_chain_from_a_sweep_while_its_own_tasks_claim(
        make_runtime: Callable[..., Runtime], tiny_model: Path) -> None:
    # Given a job just submitted: its process_job tasks are enqueued (memory broker; no worker runs)
    runtime = make_runtime(broker_url="memory://")
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 2}}\n'
    job = submit_batch(runtime, line, model=str(tiny_model))
    # Then sweeps leave it to those tasks for a lease period
    assert sweep_store(runtime) == []
    with runtime.session() as session:
        assert store.get_job(session=session, job_id=job.id).dispatch_after is not None


def test_a_chain_that_claims_holds_its_job_so_sweeps_add_none_between_its_batches(runtime: Runtime) -> None:
    # Given a job of two requests, and a chain that claimed one (batch size 1) and finished it
    job_id = new_job(runtime, 2)
    worker = JobWorker(runtime)
    claim = worker._claim(job_id, "token-1", PipelinePlan(claim=1, lanes=1, max_lanes=1))
    assert claim is not None and len(claim.requests) == 1
    with runtime.session() as session:
        store.finish_request(session=session, request_id=claim.requests[0].id, token="token-1",
                             status=RequestStatus.completed, generated=[5], finish_reason="stop", output_text="x")
        session.commit()
    # When a sweep runs before the chain's next task claims the other request, then it sends no second chain
    assert sweep_store(runtime) == []
