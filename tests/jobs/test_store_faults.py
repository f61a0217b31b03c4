"""Store and disk faults (issue 14 item 8): a database blip costs no attempt, a failing output folder undoes nothing.

A blip is injected by wrapping the engine's real `do_execute`: statements matching a pattern raise the DBAPI's own
OperationalError, then the real call runs again. Generation runs in this process (JobWorker) on a real swarm.
"""
from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from jobs_support import job_status, requests_of
from ports import free_port
from sqlalchemy import select, update
from tiers import process_fixture

from jobs import store
from jobs.db import retry_store
from jobs.models import RequestStatus, SummaryRun, utcnow
from jobs.outputs import job_public
from jobs.progress import describe_job
from jobs.runtime import Runtime
from jobs.submission import submit_batch
from jobs.summaries.firing import fire_now
from jobs.summaries.schedule_file import load_schedules
from jobs.worker.job_worker import JobWorker, Outcome
from jobs.worker.sweep import sweep_store
from launch.local_swarm import LocalSwarm

K = 4
CHECKPOINT = r"^UPDATE requests SET generated_ids="  # store.checkpoint's statement (finish_request sets status first)


@process_fixture(scope="module")
def swarm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tiny_model, [(0, 6)], log_dir=tmp_path_factory.mktemp("faults-swarm")) as swarm:
        yield swarm


@pytest.fixture(params=["sqlite", "postgres"])
def runtime(request: pytest.FixtureRequest, make_runtime: Callable[..., Runtime], swarm: LocalSwarm) -> Runtime:
    """A worker's runtime in this process: the embedded SQLite store or a fresh PostgreSQL database."""
    url = request.getfixturevalue("postgres_url") if request.param == "postgres" else None
    return make_runtime(database_url=url, broker_url="memory://", checkpoint_every=K, worker_batch_size=4,
                        initial_peers=swarm.initial_peers)


class Blip:
    """Statements matching `pattern` raise the DBAPI's OperationalError while the blip is armed; others run."""

    def __init__(self, runtime: Runtime, monkeypatch: pytest.MonkeyPatch, pattern: str, message: str) -> None:
        dialect = runtime.engine.dialect
        real = dialect.do_execute
        self.raised, self.remaining, self.until, self.outage_seconds = 0, 0, 0.0, 0.0

        def do_execute(cursor: Any, statement: str, parameters: Any, context: Any = None) -> None:
            if re.search(pattern, statement) and self._failing():
                self.raised += 1
                raise dialect.loaded_dbapi.OperationalError(message)
            real(cursor, statement, parameters, context)

        monkeypatch.setattr(dialect, "do_execute", do_execute)

    def once(self) -> None:
        """The next matching statement fails, then all run."""
        self.remaining = 1

    def outage(self, seconds: float) -> None:
        """Every matching statement fails for `seconds`, counted from the first one."""
        self.outage_seconds = seconds

    def _failing(self) -> bool:
        now = time.monotonic()
        if self.outage_seconds:
            self.until, self.outage_seconds = now + self.outage_seconds, 0.0
        if self.remaining:
            self.remaining -= 1
            return True
        return now < self.until


def disconnect(runtime: Runtime) -> str:
    """What the database's client library says when the server goes away."""
    return ("server closed the connection unexpectedly" if runtime.engine.dialect.name == "postgresql"
            else "database is locked")


def batch(count: int, max_tokens: int = 16) -> bytes:
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"Fault number {i} happened when", "max_tokens": max_tokens,
                       **({"temperature": 0.9, "seed": 7 + i} if i % 2 else {"temperature": 0})}}
             for i in range(count)]
    return ("\n".join(json.dumps(line) for line in lines) + "\n").encode()


def outputs(runtime: Runtime, job_id: str) -> dict[str, str | None]:
    return {r.custom_id: r.output_text for r in requests_of(runtime, job_id)}


def run_to_the_end(runtime: Runtime, job_id: str) -> list[Outcome]:
    outcomes = [JobWorker(runtime).process(job_id)]
    while outcomes[-1].more:
        outcomes.append(JobWorker(runtime).process(job_id))
    return outcomes


def test_a_database_blip_during_a_checkpoint_is_retried_and_costs_no_attempt(
        runtime: Runtime, monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> None:
    reference = submit_batch(runtime, batch(4), model=str(tiny_model))
    run_to_the_end(runtime, reference.id)
    # Given a job, and a database whose connection breaks once, at a checkpoint
    job = submit_batch(runtime, batch(4), model=str(tiny_model))
    blip = Blip(runtime, monkeypatch, CHECKPOINT, disconnect(runtime))
    blip.once()
    # When a worker generates it, then the task ends normally: nothing to retry, nothing left
    assert run_to_the_end(runtime, job.id)[-1] == Outcome()
    assert blip.raised == 1
    # and every request completed on its first attempt, with the text of an uninterrupted run
    assert job_status(runtime, job.id) == "completed"
    assert [(r.status, r.attempts) for r in requests_of(runtime, job.id)] == [(RequestStatus.completed, 1)] * 4
    assert outputs(runtime, job.id) == outputs(runtime, reference.id)


def test_a_blip_right_after_a_claim_committed_claims_nothing_twice(
        runtime: Runtime, monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> None:
    # Given a job whose claim commits, and whose next statement in the same step (validating -> in_progress) fails once
    job = submit_batch(runtime, batch(4, max_tokens=8), model=str(tiny_model))
    blip = Blip(runtime, monkeypatch, r"^UPDATE jobs SET status=", disconnect(runtime))
    blip.once()
    # When a worker processes it, then its retried step finds the rows it had leased, and generates them at once
    assert JobWorker(runtime).process(job.id) == Outcome()
    assert blip.raised == 1
    assert job_status(runtime, job.id) == "completed"
    assert [(r.status, r.attempts) for r in requests_of(runtime, job.id)] == [(RequestStatus.completed, 1)] * 4


def test_an_outage_longer_than_the_bound_stops_the_batch_and_its_retry_gives_it_back_uncounted(
        runtime: Runtime, monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> None:
    runtime.settings.store_retry_seconds = 1.0
    reference = submit_batch(runtime, batch(4, max_tokens=24), model=str(tiny_model))
    run_to_the_end(runtime, reference.id)
    job = submit_batch(runtime, batch(4, max_tokens=24), model=str(tiny_model))
    # Given checkpoints that fail for 3 s, three times the bound
    blip = Blip(runtime, monkeypatch, CHECKPOINT, disconnect(runtime))
    blip.outage(3.0)
    # When a worker generates the job, then it stops the batch and asks for a retry that gives its claim back
    stopped = JobWorker(runtime).process(job.id)
    assert stopped.retry and stopped.give_back is not None and blip.raised >= 2
    assert {r.attempts for r in requests_of(runtime, job.id)} == {1}
    # And when the store is back and the task is retried, the job completes with no attempt counted for the outage
    time.sleep(max(0.0, blip.until - time.monotonic()))
    outcomes = [JobWorker(runtime).process(job.id, give_back=stopped.give_back)]
    while outcomes[-1].more:
        outcomes.append(JobWorker(runtime).process(job.id))
    assert job_status(runtime, job.id) == "completed"
    assert [(r.status, r.attempts) for r in requests_of(runtime, job.id)] == [(RequestStatus.completed, 1)] * 4
    assert outputs(runtime, job.id) == outputs(runtime, reference.id)


def test_a_schema_error_is_not_retried(make_runtime: Callable[..., Runtime]) -> None:
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    runtime = make_runtime(broker_url="memory://")
    began = time.monotonic()

    def unit() -> None:
        with runtime.session() as session:
            session.execute(text("SELECT * FROM no_such_table"))
    with pytest.raises(OperationalError, match="no such table"):
        retry_store(unit, what="a typo", within=30)
    assert time.monotonic() - began < 1


# ---- a failing output folder ----------------------------------------------------------------------------------------
def schedules_file(tmp_path: Path, model: Path, outputs: dict[str, Path]) -> Path:
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "docs" / "a.txt").write_text("The harbour reopened after the storm; ferries run again.")
    path = tmp_path / "schedules.toml"
    path.write_text("".join(f'''
[[schedule]]
name = "{name}"
cron = "30 2 * * *"
source = "docs/*.txt"
prompt = "Summarize this document in one sentence.\\n\\n{{document}}"
model = "{model}"
output = "{output}"
max_tokens = 8
''' for name, output in outputs.items()))
    return path


def broken_folder(path: Path) -> Path:
    """An output 'folder' that cannot be written: a file sits at its path (works as root too, unlike chmod)."""
    path.write_text("not a folder")
    return path


def finish_all(runtime: Runtime, job_id: str) -> None:
    """What a worker commits for each request: its completion."""
    with runtime.session() as session:
        token, claimed = store.claim_requests(session=session, job_id=job_id, worker="w", limit=100,
                                              lease_seconds=60, max_attempts=3)
        for request in claimed:
            store.finish_request(session=session, request_id=request.id, token=token, status=RequestStatus.completed,
                                 generated=[5, 6], finish_reason="stop", output_text=f"summary of {request.document}")
        session.commit()


def test_a_failing_output_folder_stops_neither_the_sweep_nor_another_job_and_undoes_no_completion(
        make_runtime: Callable[..., Runtime], tiny_model: Path, tmp_path: Path) -> None:
    # Given two nights whose requests are all completed, the first with an output folder that cannot be written
    broken, good = broken_folder(tmp_path / "broken"), tmp_path / "good"
    path = schedules_file(tmp_path, tiny_model, {"first": broken, "second": good})
    runtime = make_runtime(broker_url="memory://")
    firings = [fire_now(runtime, schedule) for schedule in load_schedules(path)]
    for firing in firings:
        assert firing.job_id is not None
        finish_all(runtime, firing.job_id)
    first, second = (str(f.job_id) for f in firings)
    # When the sweep settles them, then it returns normally, and the second night's pages are written
    assert sweep_store(runtime) == []
    assert (good / "index.md").exists() and (good / "a.txt.md").exists()
    # and the first night is completed, its requests stay completed, and the folder's error is recorded on the job
    for job_id in (first, second):
        assert job_status(runtime, job_id) == "completed"
        assert {r.status for r in requests_of(runtime, job_id)} == {RequestStatus.completed}
    with runtime.session() as session:
        errors = dict(session.execute(select(SummaryRun.job_id, SummaryRun.pages_error)).tuples().all())
    assert errors[second] is None and str(broken) in (errors[first] or "")
    with runtime.session() as session:
        shown = describe_job(job_public(session=session, job=store.get_job(session=session, job_id=first)))
    assert f"pages not written: FileExistsError: [Errno 17] File exists: '{broken}'" in shown
    # And once the folder is fixed, the sweep after the retry is due writes the first night's pages and clears the error
    broken.unlink()
    with runtime.session() as session:
        session.execute(update(SummaryRun).where(SummaryRun.job_id == first).values(pages_retry_at=utcnow()))
        session.commit()
    sweep_store(runtime)
    assert "summary of a.txt" in (broken / "a.txt.md").read_text() and (broken / "index.md").exists()
    with runtime.session() as session:
        assert session.scalar(select(SummaryRun.pages_error).where(SummaryRun.job_id == first)) is None


def test_a_worker_whose_output_folder_fails_still_commits_its_completions(
        runtime: Runtime, tiny_model: Path, tmp_path: Path) -> None:
    # Given a night whose output folder cannot be written
    (schedule,) = load_schedules(schedules_file(tmp_path, tiny_model, {"night": broken_folder(tmp_path / "out")}))
    firing = fire_now(runtime, schedule)
    assert firing.job_id is not None
    # When a worker generates it, then the task ends normally
    assert run_to_the_end(runtime, firing.job_id)[-1] == Outcome()
    # and the job and its requests are completed on their first attempt, the folder's error recorded
    assert job_status(runtime, firing.job_id) == "completed"
    assert [(r.status, r.attempts) for r in requests_of(runtime, firing.job_id)] == [(RequestStatus.completed, 1)]
    with runtime.session() as session:
        error = session.scalar(select(SummaryRun.pages_error).where(SummaryRun.job_id == firing.job_id))
    assert str(tmp_path / "out") in (error or "")


def test_overlapping_sweeps_retry_a_failed_page_write_once_per_backoff(
        make_runtime: Callable[..., Runtime], tiny_model: Path, tmp_path: Path) -> None:
    # Given a finished night whose folder failed once, and whose retry is due now
    (schedule,) = load_schedules(schedules_file(tmp_path, tiny_model, {"night": broken_folder(tmp_path / "out")}))
    runtime = make_runtime(broker_url="memory://")
    firing = fire_now(runtime, schedule)
    assert firing.job_id is not None
    finish_all(runtime, firing.job_id)
    sweep_store(runtime)
    with runtime.session() as session:
        session.execute(update(SummaryRun).values(pages_retry_at=utcnow()))
        session.commit()
    # When two sweeps reach it back to back (the second after the first recorded its failed retry)
    for _ in range(2):
        with runtime.session() as session:
            runtime.lifecycle.retry_ended(session, firing.job_id)
            session.commit()
    # Then only the first tried again: the second found the next try not yet due
    with runtime.session() as session:
        assert session.scalar(select(SummaryRun.pages_attempts)) == 2


def test_a_night_whose_enqueue_fails_is_stored_and_dispatched_by_the_next_sweep(
        make_runtime: Callable[..., Runtime], tiny_model: Path, tmp_path: Path) -> None:
    # Given a broker that does not answer
    (schedule,) = load_schedules(schedules_file(tmp_path, tiny_model, {"night": tmp_path / "out"}))
    runtime = make_runtime(broker_url=f"redis://127.0.0.1:{free_port()}/0")
    # When the night fires, then it returns its job (no error), and the workers' next sweep dispatches it
    firing = fire_now(runtime, schedule)
    assert firing.job_id is not None and job_status(runtime, firing.job_id) == "validating"
    assert sweep_store(runtime) == [firing.job_id]
