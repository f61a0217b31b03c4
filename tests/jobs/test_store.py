"""The jobs store on the embedded SQLite database and on a real PostgreSQL: jobs, leases, checkpoints, API keys.

Claims take `now=`, so lease expiry needs no clock mock; only `sweep_store` reads the clock, and there the
tests replace `jobs.worker.sweep.utcnow`, `jobs.store.utcnow` and `jobs.lifecycle.utcnow` with a fixed time
(clocks are the one thing we mock).
"""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest
from factories import new_job, parsed_batch, parsed_request
from sqlalchemy import select, text, update
from sqlalchemy.exc import StatementError
from sqlalchemy.orm import Session

from jobs import store
from jobs.batch_input import COMPLETIONS_URL, LineError, ParsedBatch
from jobs.errors import ApiKeyNotFound, JobNotFound
from jobs.lifecycle import JobHooks, Lifecycle
from jobs.models import ApiKey, Job, JobKind, JobStatus, Request, RequestStatus, utcnow
from jobs.runtime import Runtime
from jobs.worker.sweep import sweep_store

LEASE = 60.0
MAX_ATTEMPTS = 5


# ---- builders -----------------------------------------------------------------------------------------------------
@pytest.fixture(params=["sqlite", "postgres"])
def runtime(request: pytest.FixtureRequest, make_runtime: Callable[..., Runtime]) -> Runtime:
    """A migrated store: the embedded SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return make_runtime()
    return make_runtime(database_url=request.getfixturevalue("postgres_url"))


def load_job(runtime: Runtime, job_id: str) -> Job:
    """The job as committed, read in a fresh session."""
    with runtime.session() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def load_requests(runtime: Runtime, job_id: str) -> list[Request]:
    """The job's requests as committed, in input order, read in a fresh session."""
    with runtime.session() as session:
        return list(session.scalars(select(Request).where(Request.job_id == job_id).order_by(Request.index)))


def load_request(runtime: Runtime, request_id: int) -> Request:
    """One request as committed."""
    with runtime.session() as session:
        row = session.get(Request, request_id)
        assert row is not None
        return row


def claim(runtime: Runtime, job_id: str, *, worker: str = "worker-a", limit: int = 10, now: datetime | None = None,
          max_attempts: int = MAX_ATTEMPTS) -> tuple[str, list[int]]:
    """Claim and commit as a worker would; returns (token, claimed request ids)."""
    with runtime.session() as session:
        token, rows = store.claim_requests(session=session, job_id=job_id, worker=worker, limit=limit,
                                           lease_seconds=LEASE, max_attempts=max_attempts, now=now)
        session.commit()
        return token, [r.id for r in rows]


def finish(runtime: Runtime, request_id: int, token: str, status: RequestStatus = RequestStatus.completed,
           **kwargs: Any) -> bool:
    """Finish a request under `token` and commit; returns whether it was written."""
    with runtime.session() as session:
        written = store.finish_request(session=session, request_id=request_id, token=token, status=status, **kwargs)
        session.commit()
        return written


def settle(runtime: Runtime, job_id: str, now: datetime | None = None) -> Job:
    """Settle the job through the lifecycle and commit; returns the job."""
    with runtime.session() as session:
        job = store.get_job(session=session, job_id=job_id)
        runtime.lifecycle.settle(session, job, now=now)
        session.commit()
        return job


def save_progress(runtime: Runtime, token: str, progress: dict[int, list[int]]) -> set[int]:
    """A worker's checkpoint, committed; returns the ids it still owns."""
    with runtime.session() as session:
        owned = store.checkpoint(session=session, token=token, progress=progress, lease_seconds=LEASE)
        session.commit()
        return owned


def set_clock(monkeypatch: pytest.MonkeyPatch, now: datetime) -> None:
    """Freeze the clock that sweep_store and the store read."""
    monkeypatch.setattr("jobs.worker.sweep.utcnow", lambda: now)
    monkeypatch.setattr("jobs.store.utcnow", lambda: now)
    monkeypatch.setattr("jobs.lifecycle.utcnow", lambda: now)


# ---- create_job ---------------------------------------------------------------------------------------------------
def test_create_job_stores_one_pending_request_per_good_line_in_input_order(runtime: Runtime) -> None:
    # Given a file whose line 2 was bad and lines 1, 3, 4 good
    error = LineError(line_number=2, custom_id="bad", code="invalid_body", message="body must be an object")
    good = [parsed_request(1, "first"), parsed_request(3, "second", user="u1"), parsed_request(4, "third")]
    # When the job is created
    with runtime.session() as session:
        job = store.create_job(session=session, parsed=ParsedBatch(good, [error], COMPLETIONS_URL), model="tiny",
                               completion_window_s=7200, input_filename="in.jsonl")
        session.commit()
        job_id = job.id
    # Then the job is queued, keeps the line error, and expires one window after its creation
    job = load_job(runtime, job_id)
    assert job.status == JobStatus.validating
    assert job.line_errors == [error.to_dict()]
    assert job.endpoint == COMPLETIONS_URL and job.input_filename == "in.jsonl"
    assert job.expires_at - job.created_at == timedelta(seconds=7200)
    # And each good line became one pending request, in input order, with its parameters
    rows = load_requests(runtime, job_id)
    assert [(r.index, r.line_number, r.custom_id) for r in rows] == [(0, 1, "first"), (1, 3, "second"),
                                                                      (2, 4, "third")]
    assert all(r.status == RequestStatus.pending for r in rows)
    assert all(r.generated_ids == [] and r.attempts == 0 and r.lease_token is None for r in rows)
    assert rows[1].prompt_ids == [1, 103, 7] and rows[1].seed == 3 and rows[1].max_tokens == 16
    assert rows[1].body == {"url": COMPLETIONS_URL, "model": "tiny", "prompt": "prompt of second", "user": "u1"}


def test_create_job_sets_the_expiry_from_the_default_24_hour_window(runtime: Runtime) -> None:
    job = load_job(runtime, new_job(runtime))

    assert job.expires_at - job.created_at == timedelta(hours=24)
    assert job.expires_at.utcoffset() == timedelta(0)


# ---- claims -------------------------------------------------------------------------------------------------------
def test_two_concurrent_claimers_never_get_the_same_request(runtime: Runtime) -> None:
    # Given a job of 20 requests and two workers, each with its own session, started together
    job_id = new_job(runtime, 20)
    start = threading.Barrier(2)
    claimed: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def work(worker: str) -> None:
        got: list[int] = []
        try:
            with runtime.session() as session:
                session.connection()  # connect before the start, so both begin claiming at once
                start.wait(timeout=30)
                while True:
                    _, rows = store.claim_requests(session=session, job_id=job_id, worker=worker, limit=3,
                                                   lease_seconds=600, max_attempts=MAX_ATTEMPTS)
                    got += [r.id for r in rows]
                    if not rows and not store.job_counts(session=session, job_id=job_id).pending:
                        break
                    session.commit()  # end the read so the next claim sees the other worker's commits
        except BaseException as e:  # reported by the main thread
            errors.append(e)
        claimed[worker] = got

    # When both claim in a loop, three at a time, until nothing is left
    threads = [threading.Thread(target=work, args=(name,)) for name in ("worker-a", "worker-b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    # Then together they claimed all 20 requests, and no request twice
    a, b = claimed["worker-a"], claimed["worker-b"]
    all_ids = {r.id for r in load_requests(runtime, job_id)}
    assert len(a) + len(b) == 20
    assert set(a) | set(b) == all_ids
    assert not set(a) & set(b)
    # And the store agrees: each request was claimed exactly once, by the worker that got it
    rows = {r.id: r for r in load_requests(runtime, job_id)}
    assert all(r.attempts == 1 and r.status == RequestStatus.in_progress for r in rows.values())
    assert {rows[i].lease_owner for i in a} <= {"worker-a"} and {rows[i].lease_owner for i in b} <= {"worker-b"}


def test_claims_take_pending_requests_in_input_order_up_to_the_limit(runtime: Runtime) -> None:
    job_id = new_job(runtime, 5)
    ids = [r.id for r in load_requests(runtime, job_id)]

    _, first = claim(runtime, job_id, limit=2)
    _, second = claim(runtime, job_id, limit=2)

    assert first == ids[:2] and second == ids[2:4]


def test_a_claimed_request_is_not_claimable_again_until_its_lease_expires(runtime: Runtime) -> None:
    # Given worker A holds the only request under a 60 s lease
    job_id = new_job(runtime, 1)
    t0 = utcnow()
    token_a, (request_id,) = claim(runtime, job_id, worker="worker-a", now=t0)
    # When worker B tries while the lease holds
    _, during = claim(runtime, job_id, worker="worker-b", now=t0 + timedelta(seconds=LEASE - 1))
    # Then B gets nothing
    assert during == []
    # When B tries after the lease expired
    token_b, after = claim(runtime, job_id, worker="worker-b", now=t0 + timedelta(seconds=LEASE + 1))
    # Then B owns it under a new token and a new lease, and the attempt is counted
    assert after == [request_id]
    row = load_request(runtime, request_id)
    assert token_b != token_a
    assert (row.lease_owner, row.lease_token, row.attempts) == ("worker-b", token_b, 2)
    assert row.lease_expires_at == t0 + timedelta(seconds=2 * LEASE + 1)
    assert row.started_at == t0  # the first claim's start is kept


def test_a_claim_of_a_job_with_nothing_pending_returns_no_requests(runtime: Runtime) -> None:
    job_id = new_job(runtime, 2)
    claim(runtime, job_id)

    token, rows = claim(runtime, job_id, worker="worker-b")

    assert rows == [] and token


# ---- checkpoints and fencing -------------------------------------------------------------------------------------
def test_checkpoint_writes_generated_ids_and_renews_the_lease_of_its_owner(runtime: Runtime) -> None:
    job_id = new_job(runtime, 2)
    t0 = utcnow() - timedelta(seconds=30)
    token, ids = claim(runtime, job_id, now=t0)

    owned = save_progress(runtime, token, {ids[0]: [5, 6], ids[1]: [7]})

    assert owned == set(ids)
    rows = load_requests(runtime, job_id)
    assert [r.generated_ids for r in rows] == [[5, 6], [7]]
    assert all(r.lease_expires_at is not None and r.lease_expires_at > t0 + timedelta(seconds=LEASE) for r in rows)


@pytest.mark.parametrize("written", ["\x00", "a\x00b\x00", "\ue000", "\ue000\ue002", "\ue000\x00\ue001", "plain"])
def test_any_text_a_model_writes_is_checkpointed_and_finished_exactly(runtime: Runtime, written: str) -> None:
    # PostgreSQL's text refuses NUL: the store escapes it, and its escape character, and reads both back exactly
    job_id = new_job(runtime, count=2)
    token, (first, second) = claim(runtime, job_id)
    with runtime.session() as session:
        store.checkpoint(session=session, token=token, progress={first: [1]}, lease_seconds=LEASE,
                         texts={first: written})
        session.commit()
    assert load_request(runtime, first).output_text == written
    assert finish(runtime, second, token, output_text=written + written, error=written)
    assert (load_request(runtime, second).output_text, load_request(runtime, second).last_error) == (written * 2,
                                                                                                     written)


def test_the_generated_count_follows_the_token_ids_through_checkpoints_and_finish(runtime: Runtime) -> None:
    # metrics and job counts sum generated_count, never the JSON: every writer of the ids must keep it equal
    job_id = new_job(runtime, 3)
    token, ids = claim(runtime, job_id)

    save_progress(runtime, token, {ids[0]: [5, 6], ids[1]: [7]})
    save_progress(runtime, token, {ids[0]: [5, 6, 8, 9]})
    finish(runtime, ids[1], token, generated=[7, 1, 2])

    rows = load_requests(runtime, job_id)
    assert [(len(r.generated_ids), r.generated_count) for r in rows] == [(4, 4), (3, 3), (0, 0)]
    with runtime.session() as session:
        assert store.job_counts(session=session, job_id=job_id).tokens == 7
        assert store.generated_tokens(session=session) == 7


def test_checkpoint_after_the_lease_was_taken_over_writes_nothing(runtime: Runtime) -> None:
    # Given worker A stalled past its lease and worker B took the request over and checkpointed
    job_id = new_job(runtime, 1)
    t0 = utcnow()
    token_a, (request_id,) = claim(runtime, job_id, worker="worker-a", now=t0)
    token_b, _ = claim(runtime, job_id, worker="worker-b", now=t0 + timedelta(seconds=LEASE + 1))
    assert save_progress(runtime, token_b, {request_id: [9]}) == {request_id}
    # When A wakes up and checkpoints with its old token
    owned = save_progress(runtime, token_a, {request_id: [1, 2, 3]})
    # Then it owns nothing and B's progress and lease are untouched
    assert owned == set()
    row = load_request(runtime, request_id)
    assert row.generated_ids == [9]
    assert (row.lease_token, row.lease_owner) == (token_b, "worker-b")


def test_finish_request_with_a_stale_token_returns_false_and_changes_nothing(runtime: Runtime) -> None:
    # Given worker B took over worker A's request
    job_id = new_job(runtime, 1)
    t0 = utcnow()
    token_a, (request_id,) = claim(runtime, job_id, worker="worker-a", now=t0)
    token_b, _ = claim(runtime, job_id, worker="worker-b", now=t0 + timedelta(seconds=LEASE + 1))
    before = load_request(runtime, request_id)
    # When A tries to finish it
    written = finish(runtime, request_id, token_a, generated=[1, 2], finish_reason="stop", output_text="stale")
    # Then nothing was written
    assert written is False
    after = load_request(runtime, request_id)
    assert (after.status, after.generated_ids, after.output_text, after.lease_token, after.completed_at) == \
        (before.status, before.generated_ids, before.output_text, token_b, None)
    # And B, the owner, can finish it
    assert finish(runtime, request_id, token_b, generated=[4], finish_reason="length", output_text="ok") is True
    done = load_request(runtime, request_id)
    assert (done.status, done.generated_ids, done.output_text, done.lease_token) == ("completed", [4], "ok", None)


# ---- release, exhaustion -----------------------------------------------------------------------------------------
def test_release_requests_returns_claimed_requests_to_pending_keeping_generated_ids(runtime: Runtime) -> None:
    # Given two claims; the first has committed tokens
    job_id = new_job(runtime, 2)
    token, (first,) = claim(runtime, job_id, limit=1)
    other_token, (second,) = claim(runtime, job_id, worker="worker-b", limit=1)
    save_progress(runtime, token, {first: [11, 12, 13]})
    # When the first claim is released because the swarm is unavailable
    with runtime.session() as session:
        store.release_requests(session=session, token=token, error="MissingBlocksError: no server holds 3-4")
        session.commit()
    # Then its request is pending again with its tokens and the reason, and the other claim is untouched
    row = load_request(runtime, first)
    assert (row.status, row.generated_ids, row.lease_token, row.lease_owner, row.lease_expires_at) == \
        ("pending", [11, 12, 13], None, None, None)
    assert row.last_error == "MissingBlocksError: no server holds 3-4"
    assert load_request(runtime, second).lease_token == other_token
    # And the next claim resumes from the committed tokens
    _, again = claim(runtime, job_id, worker="worker-c")
    assert again == [first]
    assert load_request(runtime, first).generated_ids == [11, 12, 13]


def test_release_without_counting_the_attempt_gives_the_claims_attempt_back(runtime: Runtime) -> None:
    # Given a job whose claims keep being released because blocks are missing (nothing was tried)
    job_id = new_job(runtime, 1)
    for _ in range(3):
        token, got = claim(runtime, job_id, max_attempts=1)
        assert len(got) == 1
        with runtime.session() as session:
            store.release_requests(session=session, token=token, error="MissingBlocksError: 3-4",
                                   count_attempt=False)
            session.commit()
    # Then the request never used up its attempts and is still pending
    (row,) = load_requests(runtime, job_id)
    assert (row.status, row.attempts) == ("pending", 0)


def test_release_counts_the_attempt_by_default(runtime: Runtime) -> None:
    job_id = new_job(runtime, 1)
    token, _ = claim(runtime, job_id)

    with runtime.session() as session:
        store.release_requests(session=session, token=token, error="PeerFailed: reset")
        session.commit()

    assert load_requests(runtime, job_id)[0].attempts == 1


def test_release_owned_gives_back_at_once_what_stopped_workers_held_and_lifts_the_dispatch_hold(
        runtime: Runtime) -> None:
    # Given a job whose requests two workers hold, one of them (a) stopped, with tokens committed and a dispatch hold
    job_id = new_job(runtime, 3)
    token, (first, second) = claim(runtime, job_id, worker="host:1", limit=2)
    other_token, (third,) = claim(runtime, job_id, worker="host:2", limit=1)
    save_progress(runtime, token, {first: [11, 12]})
    with runtime.session() as session:
        store.refresh_dispatch_hold(session=session, job=store.get_job(session=session, job_id=job_id), seconds=LEASE)
        session.commit()
    # When what the stopped worker's processes held is given back (their leases have not lapsed)
    with runtime.session() as session:
        released = store.release_owned(session=session, owners=["host:1", "host:9"], error="stopped")
        session.commit()
    # Then its requests are pending with their tokens and their claim uncounted, the job may be dispatched at once,
    # and the other worker's claim is untouched
    assert released == [job_id]
    rows = {row.id: row for row in load_requests(runtime, job_id)}
    assert [(rows[i].status, rows[i].generated_ids, rows[i].attempts, rows[i].lease_owner, rows[i].last_error)
            for i in (first, second)] == [("pending", [11, 12], 0, None, "stopped"), ("pending", [], 0, None, "stopped")]
    assert (rows[third].status, rows[third].lease_token) == ("in_progress", other_token)
    assert load_job(runtime, job_id).dispatch_after is None


def test_latest_job_keyed_finds_the_newest_job_under_a_key_prefix(runtime: Runtime) -> None:
    older = new_job(runtime, 1, idempotency_key="run:abc:1")
    newer = new_job(runtime, 1, idempotency_key="run:abc:2")
    new_job(runtime, 1, idempotency_key="run:abd:3")
    with runtime.session() as session:
        found = store.latest_job_keyed(session=session, key_prefix="run:abc:")
        assert found is not None and found.id == newer != older
        assert store.latest_job_keyed(session=session, key_prefix="run:zzz:") is None


def test_a_request_claimed_more_than_max_attempts_times_fails_with_a_reason(runtime: Runtime) -> None:
    # Given a poison request whose workers keep dying (their leases expire), with max_attempts 2
    job_id = new_job(runtime, 1)
    t0 = utcnow()
    for attempt in range(2):
        _, got = claim(runtime, job_id, now=t0 + attempt * timedelta(seconds=LEASE + 1), max_attempts=2)
        assert len(got) == 1
    # When it is claimed a third time
    _, third = claim(runtime, job_id, now=t0 + 2 * timedelta(seconds=LEASE + 1), max_attempts=2)
    # Then no worker gets it: it failed, with a reason, and holds no lease
    assert third == []
    (row,) = load_requests(runtime, job_id)
    assert row.status == RequestStatus.failed
    assert row.last_error == "gave up after 2 attempts"
    assert row.lease_token is None and row.completed_at is not None
    # And it cannot loop: later claims never return it
    _, later = claim(runtime, job_id, now=t0 + timedelta(days=1), max_attempts=2)
    assert later == []
    assert load_request(runtime, row.id).attempts == 3


def test_an_exhausted_request_fails_with_its_last_error(runtime: Runtime) -> None:
    # Given a request released once because the swarm failed on it
    job_id = new_job(runtime, 1)
    token, _ = claim(runtime, job_id, max_attempts=1)
    with runtime.session() as session:
        store.release_requests(session=session, token=token, error="PeerFailed: peer 12D3 reset")
        session.commit()
    # When it is claimed past max_attempts
    _, got = claim(runtime, job_id, max_attempts=1)
    # Then it fails with the swarm's reason
    assert got == []
    (row,) = load_requests(runtime, job_id)
    assert (row.status, row.last_error) == ("failed", "PeerFailed: peer 12D3 reset")


# ---- cancel -------------------------------------------------------------------------------------------------------
def test_cancel_job_cancels_pending_requests_at_once(runtime: Runtime) -> None:
    job_id = new_job(runtime, 3)

    with runtime.session() as session:
        job = runtime.lifecycle.cancel(session, job_id)
        session.commit()

    job = load_job(runtime, job_id)
    assert job.status == JobStatus.cancelled
    assert job.cancelling_at is not None and job.cancelled_at is not None
    assert {r.status for r in load_requests(runtime, job_id)} == {RequestStatus.cancelled}
    assert claim(runtime, job_id)[1] == []


def test_cancel_job_waits_for_the_request_in_progress_and_keeps_finished_results(runtime: Runtime) -> None:
    # Given a job of 4: one request finished, one in progress, two pending
    job_id = new_job(runtime, 4)
    token, (done, running) = claim(runtime, job_id, limit=2)
    assert finish(runtime, done, token, generated=[3, 4], finish_reason="stop", output_text="finished")
    # When the job is cancelled
    with runtime.session() as session:
        runtime.lifecycle.cancel(session, job_id)
        session.commit()
    # Then pending requests are cancelled now, but the job stays cancelling while a request runs
    rows = load_requests(runtime, job_id)
    assert [r.status for r in rows] == ["completed", "in_progress", "cancelled", "cancelled"]
    assert load_job(runtime, job_id).status == JobStatus.cancelling
    assert settle(runtime, job_id).status == JobStatus.cancelling
    # When the running request finishes (at its checkpoint) and the job is settled
    assert finish(runtime, running, token, status=RequestStatus.cancelled, generated=[8], finish_reason="cancelled")
    job = settle(runtime, job_id)
    # Then the job is cancelled, and finished results remain
    assert job.status == JobStatus.cancelled and job.cancelled_at is not None
    rows = load_requests(runtime, job_id)
    assert (rows[0].status, rows[0].generated_ids, rows[0].output_text) == ("completed", [3, 4], "finished")
    assert (rows[1].status, rows[1].generated_ids) == ("cancelled", [8])


def test_a_cancelled_job_whose_worker_died_leaves_no_request_pending(
        runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a job being cancelled while its only request runs with committed tokens
    job_id = new_job(runtime, 1)
    token, (request_id,) = claim(runtime, job_id)
    save_progress(runtime, token, {request_id: [1, 2]})
    with runtime.session() as session:
        runtime.lifecycle.cancel(session, job_id)
        session.commit()
    # When its worker dies and the sweep runs after the lease expired
    lease_end = load_request(runtime, request_id).lease_expires_at
    assert lease_end is not None
    set_clock(monkeypatch, lease_end + timedelta(seconds=1))
    needing = sweep_store(runtime)
    # Then the job is cancelled and so is its request, with its partial tokens: none is left pending in a
    # terminal job (where no worker would ever take it, and results would leave it out)
    assert needing == []
    assert load_job(runtime, job_id).status == JobStatus.cancelled
    row = load_request(runtime, request_id)
    assert (row.status, row.generated_ids) == (RequestStatus.cancelled, [1, 2])


def test_cancel_job_of_a_finished_job_changes_nothing(runtime: Runtime) -> None:
    job_id = new_job(runtime, 1)
    token, (request_id,) = claim(runtime, job_id)
    finish(runtime, request_id, token, generated=[1], output_text="x")
    settle(runtime, job_id)

    with runtime.session() as session:
        runtime.lifecycle.cancel(session, job_id)
        session.commit()

    job = load_job(runtime, job_id)
    assert job.status == JobStatus.completed and job.cancelling_at is None


# ---- settle -------------------------------------------------------------------------------------------------------
def test_settle_job_completes_a_job_whose_requests_all_completed(runtime: Runtime) -> None:
    # Given every request completed and the job marked blocked earlier
    job_id = new_job(runtime, 2)
    token, ids = claim(runtime, job_id)
    for request_id in ids:
        finish(runtime, request_id, token, generated=[1], finish_reason="stop", output_text="x")
    with runtime.session() as session:
        store.get_job(session=session, job_id=job_id).blocked_reason = "MissingBlocksError: earlier"
        session.commit()
    # When it is settled
    now = utcnow()
    settle(runtime, job_id, now=now)
    # Then it went through finalizing to completed, both stamped, and is no longer blocked
    job = load_job(runtime, job_id)
    assert job.status == JobStatus.completed
    assert job.finalizing_at == now and job.completed_at == now
    assert job.failed_at is None and job.blocked_reason is None


def test_settle_job_fails_a_job_whose_requests_all_failed(runtime: Runtime) -> None:
    job_id = new_job(runtime, 2)
    token, ids = claim(runtime, job_id)
    for request_id in ids:
        finish(runtime, request_id, token, status=RequestStatus.failed, error="InvalidRequest: too long")

    now = utcnow()
    settle(runtime, job_id, now=now)

    job = load_job(runtime, job_id)
    assert job.status == JobStatus.failed
    assert job.finalizing_at == now and job.failed_at == now and job.completed_at is None


def test_settle_job_completes_a_job_with_some_failed_requests(runtime: Runtime) -> None:
    job_id = new_job(runtime, 2)
    token, (ok, bad) = claim(runtime, job_id)
    finish(runtime, ok, token, generated=[1], output_text="x")
    finish(runtime, bad, token, status=RequestStatus.failed, error="boom")

    assert settle(runtime, job_id).status == JobStatus.completed


def test_settle_job_leaves_a_job_with_unfinished_requests_alone(runtime: Runtime) -> None:
    job_id = new_job(runtime, 2)
    token, (first, _) = claim(runtime, job_id)
    finish(runtime, first, token, generated=[1], output_text="x")

    job = settle(runtime, job_id)

    assert job.status == JobStatus.validating and job.finalizing_at is None


def test_a_lifecycle_without_hooks_for_every_job_kind_is_refused() -> None:
    # a kind without hooks would be a path on which its hooks never run
    with pytest.raises(ValueError, match="no lifecycle hooks for job kinds summary"):
        Lifecycle({JobKind.batch: JobHooks()})


# ---- expiry and lost leases --------------------------------------------------------------------------------------
def test_sweep_past_the_deadline_expires_the_job_and_keeps_finished_output(
        runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a one-hour job: one request completed, one in progress with committed tokens, one pending
    job_id = new_job(runtime, 3, completion_window_s=3600)
    token, (done, running) = claim(runtime, job_id, limit=2)
    finish(runtime, done, token, generated=[1, 2], finish_reason="stop", output_text="kept")
    save_progress(runtime, token, {running: [5, 6]})
    # When the sweep runs after the deadline
    deadline = load_job(runtime, job_id).expires_at
    later = deadline + timedelta(seconds=1)
    set_clock(monkeypatch, later)
    needing = sweep_store(runtime)
    # Then the job expired and asks for no worker
    assert job_id not in needing
    job = load_job(runtime, job_id)
    assert job.status == JobStatus.expired and job.expired_at == later
    # And unfinished requests expired (keeping partial tokens); the completed one keeps its output
    rows = load_requests(runtime, job_id)
    assert [r.status for r in rows] == ["completed", "expired", "expired"]
    assert (rows[0].generated_ids, rows[0].output_text) == ([1, 2], "kept")
    assert rows[1].generated_ids == [5, 6]
    assert all(r.last_error and r.lease_token is None for r in rows[1:])
    # And the worker that held the running request can write nothing more
    assert save_progress(runtime, token, {running: [5, 6, 7]}) == set()
    assert finish(runtime, running, token, generated=[5, 6, 7], output_text="late") is False
    assert load_request(runtime, running).status == RequestStatus.expired


def test_expire_job_fences_out_the_worker_that_holds_a_live_lease(runtime: Runtime) -> None:
    # Given a worker in the middle of a request whose lease still holds
    job_id = new_job(runtime, 1)
    token, (request_id,) = claim(runtime, job_id)
    save_progress(runtime, token, {request_id: [3]})
    # When the job expires (a worker found it past its deadline)
    with runtime.session() as session:
        runtime.lifecycle.expire(session, store.get_job(session=session, job_id=job_id))
        session.commit()
    # Then the request expired with its partial tokens, and the worker can neither checkpoint nor finish it
    assert save_progress(runtime, token, {request_id: [3, 4]}) == set()
    assert finish(runtime, request_id, token, generated=[3, 4], output_text="late") is False
    row = load_request(runtime, request_id)
    assert (row.status, row.generated_ids, row.lease_token) == ("expired", [3], None)
    assert load_job(runtime, job_id).status == JobStatus.expired


def test_sweep_before_the_deadline_does_not_expire_the_job(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = new_job(runtime, 1, completion_window_s=3600)
    set_clock(monkeypatch, load_job(runtime, job_id).expires_at - timedelta(seconds=1))

    assert sweep_store(runtime) == [job_id]

    assert load_job(runtime, job_id).status == JobStatus.validating
    assert load_requests(runtime, job_id)[0].status == RequestStatus.pending


def test_expire_leases_returns_stale_in_progress_requests_to_pending(runtime: Runtime) -> None:
    # Given a request claimed at t0 and its worker gone
    job_id = new_job(runtime, 2)
    t0 = utcnow()
    token, (stale, other) = claim(runtime, job_id, now=t0)
    save_progress(runtime, token, {stale: [4, 2]})  # renews its lease to a few ms past t0 + LEASE
    with runtime.session() as session:
        # When leases are checked while they hold, nothing changes
        assert store.expire_leases(session=session, now=t0 + timedelta(seconds=LEASE - 1)) == []
        assert {r.status for r in load_requests(runtime, job_id)} == {RequestStatus.in_progress}
        # When they are checked after they expired
        affected = store.expire_leases(session=session, now=t0 + timedelta(seconds=LEASE + 10))
        session.commit()
    # Then the job is reported and its requests are pending again, with their tokens kept
    assert affected == [job_id]
    rows = {r.id: r for r in load_requests(runtime, job_id)}
    assert all(r.status == "pending" and r.lease_token is None and r.lease_expires_at is None for r in rows.values())
    assert rows[stale].generated_ids == [4, 2] and rows[other].generated_ids == []


def test_sweep_returns_a_job_whose_leases_expired_as_needing_work(
        runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a job whose only request was claimed by a worker that died
    job_id = new_job(runtime, 1)
    _, (request_id,) = claim(runtime, job_id)
    lease_end = load_request(runtime, request_id).lease_expires_at
    assert lease_end is not None
    # When the sweep runs while the lease holds, the job needs no new worker
    set_clock(monkeypatch, lease_end - timedelta(seconds=1))
    assert sweep_store(runtime) == []
    # When the sweep runs after the lease expired
    set_clock(monkeypatch, lease_end + timedelta(seconds=1))
    needing = sweep_store(runtime)
    # Then the request is pending again and the job is returned as needing a worker
    assert needing == [job_id]
    assert load_request(runtime, request_id).status == RequestStatus.pending


# ---- the transaction contract ------------------------------------------------------------------------------------
def snapshot(runtime: Runtime, job_id: str) -> tuple[object, ...]:
    """What other sessions see of a job and its requests."""
    job = load_job(runtime, job_id)
    return job.status, [(r.status, r.generated_ids, r.lease_token, r.lease_expires_at, r.attempts, r.last_error)
                        for r in load_requests(runtime, job_id)]


# each writer gets (session, job id, token of a committed claim, the request claimed under it)
WRITERS: dict[str, Callable[[Runtime, Session, str, str, int], object]] = {
    "cancel": lambda runtime, session, job_id, token, request_id: runtime.lifecycle.cancel(session, job_id),
    "expire": lambda runtime, session, job_id, token, request_id: runtime.lifecycle.expire(
        session, store.get_job(session=session, job_id=job_id)),
    "claim_requests": lambda runtime, session, job_id, token, request_id: store.claim_requests(
        session=session, job_id=job_id, worker="worker-b", limit=10, lease_seconds=LEASE, max_attempts=MAX_ATTEMPTS),
    "checkpoint": lambda runtime, session, job_id, token, request_id: store.checkpoint(
        session=session, token=token, progress={request_id: [1, 2]}, lease_seconds=LEASE),
    "renew_leases": lambda runtime, session, job_id, token, request_id: store.renew_leases(
        session=session, token=token, lease_seconds=2 * LEASE),
    "finish_request": lambda runtime, session, job_id, token, request_id: store.finish_request(
        session=session, request_id=request_id, token=token, status=RequestStatus.completed, generated=[1]),
    "release_requests": lambda runtime, session, job_id, token, request_id: store.release_requests(
        session=session, token=token, error="PeerFailed: reset"),
    "release_owned": lambda runtime, session, job_id, token, request_id: store.release_owned(
        session=session, owners=["worker-a"], error="stopped"),
    "expire_leases": lambda runtime, session, job_id, token, request_id: store.expire_leases(
        session=session, now=utcnow() + timedelta(seconds=2 * LEASE)),
}


@pytest.mark.parametrize("writer", WRITERS)
def test_a_store_write_takes_effect_only_when_the_caller_commits(runtime: Runtime, writer: str) -> None:
    # Given a job of two requests, one of them claimed (and committed) under a lease
    job_id = new_job(runtime, 2)
    token, (request_id,) = claim(runtime, job_id, limit=1)
    before = snapshot(runtime, job_id)
    write = WRITERS[writer]
    # When a caller writes through the store and ends without committing
    with runtime.session() as session:
        write(runtime, session, job_id, token, request_id)
        # Then other sessions never see the write, neither meanwhile nor afterwards
        assert snapshot(runtime, job_id) == before
    assert snapshot(runtime, job_id) == before
    # When a caller writes and commits, the write is there for every session
    with runtime.session() as session:
        write(runtime, session, job_id, token, request_id)
        assert snapshot(runtime, job_id) == before
        session.commit()
    assert snapshot(runtime, job_id) != before


def test_create_job_flushes_ids_but_the_job_exists_for_others_only_after_the_commit(runtime: Runtime) -> None:
    with runtime.session() as session:
        job = store.create_job(session=session, parsed=parsed_batch(2), model="tiny")
        # the ids are known before the commit (flushed), yet no other session finds the job
        assert job.id and all(r.id is not None for r in job.requests)
        with runtime.session() as other, pytest.raises(JobNotFound):
            store.get_job(session=other, job_id=job.id)
        session.commit()

    assert load_job(runtime, job.id).status == JobStatus.validating


# ---- status columns -----------------------------------------------------------------------------------------------
def test_status_columns_load_as_their_enums_and_store_the_plain_values(runtime: Runtime) -> None:
    # Given a validating job whose request is claimed
    job_id = new_job(runtime, 1)
    _, (request_id,) = claim(runtime, job_id)
    # Then the ORM hands back enum members
    assert type(load_job(runtime, job_id).status) is JobStatus
    assert type(load_request(runtime, request_id).status) is RequestStatus
    with runtime.session() as session:
        assert type(session.scalar(select(Job.status).where(Job.id == job_id))) is JobStatus
        # And the database holds the values themselves, as the plain string columns did
        raw = session.execute(text("SELECT jobs.status, requests.status FROM jobs JOIN requests ON "
                                   "requests.job_id = jobs.id WHERE jobs.id = :id"), {"id": job_id}).one()
    assert tuple(raw) == ("validating", "in_progress")


def test_a_status_that_is_no_member_is_refused(runtime: Runtime) -> None:
    job_id = new_job(runtime, 1)

    with runtime.session() as session, pytest.raises(StatementError, match="queud"):
        session.execute(update(Job).where(Job.id == job_id).values(status="queud"))


# ---- API keys -----------------------------------------------------------------------------------------------------
def test_create_api_key_returns_the_plain_key_once_and_stores_only_its_sha256(runtime: Runtime) -> None:
    with runtime.session() as session:
        row, plain = store.create_api_key(session=session, name="ci")
        session.commit()
        key_id = row.id

    with runtime.session() as session:
        stored = session.get(ApiKey, key_id)
        assert stored is not None
        assert stored.key_hash == hashlib.sha256(plain.encode()).hexdigest()
        assert plain not in (stored.name, stored.key_hash)
    assert len(plain) > 32


def test_find_api_key_finds_a_key_by_its_plain_value_and_not_by_its_hash(runtime: Runtime) -> None:
    with runtime.session() as session:
        row, plain = store.create_api_key(session=session, name="ci")
        store.create_api_key(session=session, name="other")
        session.commit()

    with runtime.session() as session:
        found = store.find_api_key(session=session, key=plain)
        assert found is not None and found.id == row.id
        assert store.find_api_key(session=session, key=row.key_hash) is None
        assert store.find_api_key(session=session, key=plain + "x") is None


def test_a_revoked_key_is_found_no_more_and_revoking_it_again_keeps_its_first_revocation(runtime: Runtime) -> None:
    with runtime.session() as session:
        row, plain = store.create_api_key(session=session, name="ci")
        session.commit()
    with runtime.session() as session:
        first = store.revoke_api_key(session=session, name_or_id=str(row.id)).revoked_at
        session.commit()
    with runtime.session() as session:
        again = store.revoke_api_key(session=session, name_or_id="ci").revoked_at
        session.commit()
        assert store.find_api_key(session=session, key=plain) is None
    assert first is not None and again == first
    with runtime.session() as session:
        assert [(k.name, k.revoked_at) for k in store.list_api_keys(session=session)] == [("ci", first)]


def test_a_name_revokes_its_one_live_key_and_an_unknown_or_ambiguous_one_revokes_nothing(runtime: Runtime) -> None:
    # Given alice's old key (revoked), her live one, and two live keys named "ci"
    with runtime.session() as session:
        old, _ = store.create_api_key(session=session, name="alice")
        live, live_plain = store.create_api_key(session=session, name="alice")
        store.create_api_key(session=session, name="ci")
        store.create_api_key(session=session, name="ci")
        session.commit()
        store.revoke_api_key(session=session, name_or_id=str(old.id))
        session.commit()
    with runtime.session() as session:
        # When "alice" is revoked, Then her live key is
        assert store.revoke_api_key(session=session, name_or_id="alice").id == live.id
        session.commit()
        assert store.find_api_key(session=session, key=live_plain) is None
        # and a name of nobody, or of two live keys, raises without revoking anything
        with pytest.raises(ApiKeyNotFound, match="no API key 'bob'; list them with 'swarmbatch keys list'"):
            store.revoke_api_key(session=session, name_or_id="bob")
        with pytest.raises(ApiKeyNotFound, match="2 live API keys are named 'ci'"):
            store.revoke_api_key(session=session, name_or_id="ci")
        assert [k.revoked_at is None for k in store.list_api_keys(session=session)] == [False, False, True, True]


def test_a_job_of_another_key_is_not_found(runtime: Runtime) -> None:
    # Given a job submitted with key A
    with runtime.session() as session:
        owner, _ = store.create_api_key(session=session, name="a")
        stranger, _ = store.create_api_key(session=session, name="b")
        session.commit()
    job_id = new_job(runtime, 1, api_key_id=owner.id)
    with runtime.session() as session:
        # Then key A sees it and key B does not, neither to read, list nor cancel
        assert store.get_job(session=session, job_id=job_id, api_key_id=owner.id).id == job_id
        with pytest.raises(JobNotFound):
            store.get_job(session=session, job_id=job_id, api_key_id=stranger.id)
        with pytest.raises(JobNotFound):
            runtime.lifecycle.cancel(session, job_id, api_key_id=stranger.id)
        assert [j.id for j in store.list_jobs(session=session, api_key_id=owner.id)] == [job_id]
        assert store.list_jobs(session=session, api_key_id=stranger.id) == []
        session.commit()
    assert load_job(runtime, job_id).status == JobStatus.validating


def test_get_job_of_an_unknown_id_raises_job_not_found(runtime: Runtime) -> None:
    with runtime.session() as session, pytest.raises(JobNotFound):
        store.get_job(session=session, job_id="batch_missing")


# ---- n: a line of n choices is n requests ------------------------------------------------------------------------------
def test_a_line_of_n_choices_becomes_n_consecutive_requests_with_seeds_of_their_own(runtime: Runtime) -> None:
    # Given a batch whose middle line asks for 3 choices
    parsed = ParsedBatch([parsed_request(1, "a"), replace(parsed_request(2, "b"), n=3), parsed_request(3, "c")], [],
                         COMPLETIONS_URL)
    with runtime.session() as session:
        job_id = store.create_job(session=session, parsed=parsed, model="tiny").id
        session.commit()
    # Then it is three requests, in input order, choice 0 with the line's seed and the others with derived ones
    rows = load_requests(runtime, job_id)
    assert [(r.index, r.custom_id, r.choice) for r in rows] == [(0, "a", 0), (1, "b", 0), (2, "b", 1), (3, "b", 2),
                                                                (4, "c", 0)]
    seeds = [r.seed for r in rows if r.custom_id == "b"]
    assert seeds == [2, store.choice_seed(2, 1), store.choice_seed(2, 2)] and len(set(seeds)) == 3
    assert all(0 <= seed < 2**63 for seed in seeds)
    # and the job counts lines, not requests
    with runtime.session() as session:
        counts = store.job_counts(session=session, job_id=job_id)
    assert (counts.total, counts.completed, counts.failed, counts.pending) == (3, 0, 0, 5)


def test_a_line_of_n_choices_is_completed_once_all_are_and_failed_once_one_is(runtime: Runtime) -> None:
    parsed = ParsedBatch([replace(parsed_request(1, "a"), n=2), replace(parsed_request(2, "b"), n=2)], [],
                         COMPLETIONS_URL)
    with runtime.session() as session:
        job_id = store.create_job(session=session, parsed=parsed, model="tiny").id
        token, rows = store.claim_requests(session=session, job_id=job_id, worker="w", limit=4, lease_seconds=LEASE,
                                           max_attempts=MAX_ATTEMPTS)
        # When a's two choices and b's first complete, and b's second fails
        for row, status in zip(rows, [RequestStatus.completed] * 3 + [RequestStatus.failed], strict=True):
            store.finish_request(session=session, request_id=row.id, token=token, status=status, generated=[5])
        session.commit()
        counts = store.job_counts(session=session, job_id=job_id)
    # Then a is one completed line and b one failed line
    assert (counts.total, counts.completed, counts.failed, counts.pending, counts.in_progress) == (2, 1, 1, 0, 0)


def test_text_beyond_ascii_is_stored_in_a_sql_ascii_postgres_database(empty_postgres_url: str) -> None:
    # Given a PostgreSQL database created with SQL_ASCII (what initdb under the C locale makes), migrated to head
    from sqlalchemy import create_engine
    from sqlalchemy import text as sql

    from jobs.db import make_engine
    from jobs.migrate import upgrade
    from jobs.settings import Settings

    admin = create_engine(empty_postgres_url.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT")
    name = empty_postgres_url.rsplit("/", 1)[1] + "_ascii"
    with admin.connect() as connection:
        connection.execute(sql(f'CREATE DATABASE "{name}" ENCODING \'SQL_ASCII\' LC_COLLATE \'C\' LC_CTYPE \'C\' '
                               "TEMPLATE template0"))
    url = empty_postgres_url.rsplit("/", 1)[0] + f"/{name}"
    try:
        upgrade(url)
        # When the store's engine writes and reads back a text with an en dash and other non-ASCII characters
        engine = make_engine(Settings(database_url=url))
        try:
            with engine.begin() as connection:
                connection.execute(sql("CREATE TABLE probe (value text)"))
                connection.execute(sql("INSERT INTO probe VALUES (:value)"), {"value": "a – b, café, 東京"})
                stored = connection.execute(sql("SELECT value FROM probe")).scalar_one()
        finally:
            engine.dispose()
        # Then it comes back as written (the driver sends UTF-8 whatever the database's encoding)
        assert stored == "a – b, café, 東京"
    finally:
        with admin.connect() as connection:
            connection.execute(sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
