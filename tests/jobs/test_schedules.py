"""Nightly schedules: once per period whatever beat does, incremental nights, and map-reduce of long documents.

The clock (jobs.clock.now) is the one thing mocked; jobs run on real workers, a real swarm and real stores.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from jobs_support import claims, job_status, requests_of, wait_for
from sqlalchemy import select
from tiers import process_fixture

from jobs import clock, store
from jobs.backends import StoreBackend
from jobs.models import DocumentSummary, Job, RequestStatus, SummaryRun, utcnow
from jobs.progress import describe_job
from jobs.queue import FIRE_SCHEDULES
from jobs.runtime import Runtime
from jobs.summaries.firing import fire_due_schedules, fire_now
from jobs.summaries.pages import MAX_PAGE_ATTEMPTS
from jobs.summaries.schedule_file import ScheduleError, load_schedules
from jobs.worker.job_worker import JobWorker
from jobs.worker.sweep import sweep_store
from launch.local_swarm import LocalSwarm
from launch.local_worker import settings_env, start_local_worker
from launch.processes import ManagedProcess, cli_command
from modelprep import write_tiny_model

K = 4
NIGHT_1 = datetime(2026, 12, 3, 1, 30, 20, tzinfo=UTC)  # 02:30:20 in Berlin (UTC+1 in December)

DOCUMENTS = {
    "a.txt": "The council voted to expand the bike lanes by twelve miles over two years.",
    "notes/b.md": "# Solar\nThe price of solar panels fell again; engineers build larger batteries.",
    "notes/c.txt": "A team of volunteers opened a library in an old train station.",
}


def write_schedules(path: Path, model: Path, *, cron: str = "30 2 * * *", max_tokens: int = 12,
                    source: str = "docs/**/*", extra: str = "") -> Path:
    path.write_text(f'''
[[schedule]]
name = "nightly"
cron = "{cron}"
timezone = "Europe/Berlin"
source = "{source}"
prompt = "Summarize this document in one sentence.\\n\\n{{document}}"
model = "{model}"
output = "summaries"
max_tokens = {max_tokens}
{extra}
''')
    return path


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    for name, text in DOCUMENTS.items():
        (tmp_path / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "docs" / name).write_text(text)
    return tmp_path / "docs"


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> list[datetime]:
    """jobs.clock.now returns now[0]; tests move it."""
    now = [NIGHT_1]
    monkeypatch.setattr(clock, "now", lambda: now[0])
    return now


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest) -> str | None:
    """The embedded SQLite store (None), or a fresh PostgreSQL database."""
    return None if request.param == "sqlite" else str(request.getfixturevalue("postgres_url"))


def jobs_of(runtime: Runtime) -> list[Job]:
    with runtime.session() as session:
        return list(session.scalars(select(Job).order_by(Job.created_at)))


def periods_of(runtime: Runtime) -> list[str]:
    """The period of each summary job, oldest job first."""
    with runtime.session() as session:
        return list(session.scalars(select(SummaryRun.period).join(Job).order_by(Job.created_at)))


# ---- the schedules file ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, message", [
    ("cron", '"61 2 * * *"', "five-field cron"),
    ("timezone", '"Mars/Olympus"', "unknown timezone"),
    ("prompt", '"Summarize"', "must contain {document}"),
    ("misfire_grace", '"soon"', "not a duration"),
])
def test_a_bad_schedule_is_refused_with_one_line_naming_it(tmp_path: Path, field: str, value: str, message: str
                                                           ) -> None:
    good = {"name": '"n"', "cron": '"0 2 * * *"', "timezone": '"UTC"', "source": '"d/*.txt"',
            "prompt": '"S: {document}"', "model": '"smollm2"', "output": '"out"', "misfire_grace": '"1h"'}
    good[field] = value
    path = tmp_path / "s.toml"
    path.write_text("[[schedule]]\n" + "".join(f"{k} = {v}\n" for k, v in good.items()))
    with pytest.raises(ScheduleError, match=message) as error:
        load_schedules(path)
    assert "\n" not in str(error.value) and "schedule n" in str(error.value)


def test_the_due_period_follows_the_schedules_timezone_and_grace(tmp_path: Path, tiny_model: Path) -> None:
    (schedule,) = load_schedules(write_schedules(tmp_path / "s.toml", tiny_model))
    assert schedule.due_period(NIGHT_1) == datetime(2026, 12, 3, 2, 30, tzinfo=schedule.zone)
    assert schedule.due_period(NIGHT_1 + timedelta(minutes=59)) is not None
    assert schedule.due_period(NIGHT_1 + timedelta(hours=2)) is None  # past the 1 h grace: wait for the next night
    assert schedule.next_run(NIGHT_1) == datetime(2026, 12, 4, 2, 30, tzinfo=schedule.zone)


# ---- once per period ------------------------------------------------------------------------------------------------
def test_a_night_fires_once_with_two_beats_and_across_a_beat_restart(
        make_runtime: Callable[..., Runtime], postgres_url: str, redis_url: str, tiny_model: Path, docs: Path,
        tmp_path: Path, fake_clock: list[datetime]) -> None:
    schedules = write_schedules(tmp_path / "schedules.toml", tiny_model)
    beats = [make_runtime(database_url=postgres_url, broker_url=redis_url, schedules=schedules) for _ in range(2)]
    # two beats tick at the same moment
    barrier = threading.Barrier(2)
    fired: list[Any] = []

    def tick(runtime: Runtime) -> None:
        barrier.wait()
        fired.extend(fire_due_schedules(runtime))
    threads = [threading.Thread(target=tick, args=(runtime,)) for runtime in beats]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(f.job_id is not None for f in fired) == [False, True]
    # a restarted beat (a new process state) ticks again within the grace, and later the same night
    restarted = make_runtime(database_url=postgres_url, broker_url=redis_url, schedules=schedules)
    for minutes in (1, 30, 90, 600):
        fake_clock[0] = NIGHT_1 + timedelta(minutes=minutes)
        assert all(f.job_id is None for f in fire_due_schedules(restarted))
    assert len(jobs_of(restarted)) == 1
    # the next night fires again, once
    fake_clock[0] = NIGHT_1 + timedelta(days=1)
    assert [f.job_id is not None for f in fire_due_schedules(restarted) + fire_due_schedules(beats[0])] == [True, False]
    periods = periods_of(restarted)
    assert periods == ["2026-12-03T02:30:00+01:00", "2026-12-04T02:30:00+01:00"]


@pytest.mark.swarm
def test_celery_beat_processes_fire_a_schedule_through_a_worker_once_per_period(
        make_runtime: Callable[..., Runtime], postgres_url: str, redis_url: str, tiny_model: Path, docs: Path,
        tmp_path: Path) -> None:
    # every minute is a period, so real beats (real clock) fire at once; two of them run by mistake
    schedules = write_schedules(tmp_path / "schedules.toml", tiny_model, cron="* * * * *")
    runtime = make_runtime(database_url=postgres_url, broker_url=redis_url, schedules=schedules, schedule_tick=0.5)
    env = settings_env(runtime.settings)
    processes: list[ManagedProcess] = [
        ManagedProcess(cli_command("beat"), name=f"beat{i}", log_dir=tmp_path, env=env) for i in range(2)]
    processes.append(start_local_worker(runtime.settings, log_dir=tmp_path))
    try:
        wait_for(lambda: len(jobs_of(runtime)) >= 1, 120, "a scheduled job")
        def ticks() -> int:
            return sum(p.log_path.read_text().count(FIRE_SCHEDULES) for p in processes[:2])
        seen = ticks()
        wait_for(lambda: ticks() >= seen + 6, 60, "more ticks of both beats")
    finally:
        for process in processes:
            process.terminate()
    periods = periods_of(runtime)
    assert periods and len(periods) == len(set(periods)), periods


# ---- incremental nights, on a real swarm ----------------------------------------------------------------------------
def start_worker(runtime: Runtime, swarm: LocalSwarm, log_dir: Path, name: str, batch_size: int = 4,
                 lease_seconds: float = 6.0) -> ManagedProcess:
    settings = runtime.settings.model_copy(update={"initial_peers": swarm.initial_peers, "schedules": None,
                                                   "worker_batch_size": batch_size, "lease_seconds": lease_seconds,
                                                   "sweep_interval": 2.0})
    return start_local_worker(settings, log_dir=log_dir, name=name, verbose=True)


def test_the_second_night_summarizes_only_the_changed_document(
        make_runtime: Callable[..., Runtime], shared_swarm: LocalSwarm, tiny_model: Path, docs: Path,
        tmp_path: Path, fake_clock: list[datetime]) -> None:
    runtime = make_runtime(schedules=write_schedules(tmp_path / "schedules.toml", tiny_model), checkpoint_every=K)
    worker = start_worker(runtime, shared_swarm, tmp_path, "worker")
    try:
        (first,) = fire_due_schedules(runtime)
        assert (first.summarize, first.skipped) == (3, 0)
        wait_for(lambda: job_status(runtime, first.job_id) == "completed", 120, "the first night's job")
        wait_for(lambda: (tmp_path / "summaries" / "index.md").exists(), 30, "the first night's index")
        for key in DOCUMENTS:
            page = (tmp_path / "summaries" / (key.replace("/", "__") + ".md")).read_text()
            assert f"# Summary of {key}" in page and str(docs / key) in page and first.job_id in page
        (docs / "notes/b.md").write_text(DOCUMENTS["notes/b.md"] + "\nBatteries got cheaper too.")
        fake_clock[0] = NIGHT_1 + timedelta(days=1)
        (second,) = fire_due_schedules(runtime)
        assert (second.summarize, second.skipped) == (1, 2)
        wait_for(lambda: job_status(runtime, second.job_id) == "completed", 120, "the second night's job")
        wait_for(lambda: second.job_id in (tmp_path / "summaries" / "index.md").read_text(), 30, "the new index")
    finally:
        worker.terminate()
    assert [r.document for r in requests_of(runtime, second.job_id)] == ["notes/b.md"]
    index = (tmp_path / "summaries" / "index.md").read_text()
    assert "| a.txt | unchanged (skipped) | a.txt.md |" in index and "| notes/b.md | summarized |" in index
    assert second.job_id in (tmp_path / "summaries" / "notes__b.md.md").read_text()
    assert first.job_id in (tmp_path / "summaries" / "a.txt.md").read_text()
    assert "2 unchanged documents skipped" in describe_job(StoreBackend(runtime).get(second.job_id))
    with runtime.session() as session:
        by_document = {s.document: s.job_id for s in session.scalars(select(DocumentSummary))}
    assert by_document == {"a.txt": first.job_id, "notes/c.txt": first.job_id, "notes/b.md": second.job_id}
    assert not list((tmp_path / "summaries").glob(".*")), "no temporary file may be left behind"


# ---- long documents: map-reduce through the durable machinery -------------------------------------------------------
SHORT_CONTEXT = 256


@pytest.fixture(scope="module")
def short_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose context is 256 tokens."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-256", layers=6, seed=3, context=SHORT_CONTEXT)


@process_fixture(scope="module")
def short_swarm(short_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(short_model, [(0, 3), (3, 6)], log_dir=tmp_path_factory.mktemp("short-swarm")) as swarm:
        yield swarm


def test_a_document_three_contexts_long_is_map_reduced_and_survives_kill_9_in_the_map_stage(
        make_runtime: Callable[..., Runtime], short_swarm: LocalSwarm, short_model: Path, tmp_path: Path) -> None:
    runtime = make_runtime(checkpoint_every=K)
    text = " ".join(f"Paragraph {i}: the river dropped to its lowest level in forty years, and farmers asked "
                    f"for help." for i in range(60))
    tokens = len(runtime.tokenizer(str(short_model))(text, add_special_tokens=False).input_ids)
    assert tokens >= 3 * SHORT_CONTEXT
    (tmp_path / "long.txt").write_text(text)
    (schedule,) = load_schedules(write_schedules(tmp_path / "s.toml", short_model, max_tokens=40,
                                                 source="long.txt"))
    firing = fire_now(runtime, schedule)
    chunks = requests_of(runtime, firing.job_id)
    assert len(chunks) >= 3 and all(r.stage == 0 and not r.final for r in chunks)
    # a lease long enough that a loaded CI machine's slow steps never let a live worker's claim lapse
    first = start_worker(runtime, short_swarm, tmp_path, "worker0", batch_size=2, lease_seconds=15.0)
    wait_for(lambda: any(r.status == "in_progress" and len(r.generated_ids) >= K
                         for r in requests_of(runtime, firing.job_id)), 120, "a chunk with committed tokens")
    first.kill()
    at_kill = {r.id: (r.status, r.completed_at, list(r.generated_ids)) for r in requests_of(runtime, firing.job_id)}
    assert all(r.stage == 0 for r in requests_of(runtime, firing.job_id)), "killed in the map stage"
    second = start_worker(runtime, short_swarm, tmp_path, "worker1", batch_size=2, lease_seconds=15.0)
    try:
        wait_for(lambda: job_status(runtime, firing.job_id) == "completed", 180, "the map-reduce job")
        wait_for(lambda: (tmp_path / "summaries" / "long.txt.md").exists(), 30, "the summary file")
    finally:
        second.terminate()
    rows = requests_of(runtime, firing.job_id)
    stage0 = [r for r in rows if r.stage == 0]
    assert len(stage0) == len(chunks) and all(r.status == "completed" for r in rows)
    # no chunk summarized twice: what was done at the kill stays as it was, and the second worker never claimed it
    done_at_kill = {rid for rid, (status, _, _) in at_kill.items() if status == "completed"}
    claimed = {i for ids, _ in claims(second.log_path.read_text()) for i in ids}
    assert not done_at_kill & claimed
    assert all((r.status, r.completed_at, list(r.generated_ids)) == at_kill[r.id] for r in rows if r.id in done_at_kill)
    assert all(r.attempts <= 2 for r in rows)
    # the reduce stage combines every chunk's summary, and its output is the document's summary
    (final,) = [r for r in rows if r.final]
    assert final.stage >= 1 and final.status == "completed"
    previous = [r for r in rows if r.stage == final.stage - 1]
    assert len(previous) > 1 and all((r.output_text or "") in final.body["messages"][0]["content"] for r in previous)
    print(f"\n{tokens} tokens -> {len(stage0)} chunks, {final.stage} reduce stages, {len(rows)} requests")
    assert (final.output_text or "").strip() in (tmp_path / "summaries" / "long.txt.md").read_text()


def test_the_example_schedules_file_is_valid() -> None:
    (schedule,) = load_schedules(Path(__file__).resolve().parents[2] / "samples" / "schedules.example.toml")
    assert schedule.name == "nightly-documents" and schedule.source == "documents/*.txt"


def test_schedules_list_shows_each_next_run_and_run_names_unknown_schedules(
        tmp_path: Path, tiny_model: Path) -> None:
    import json as json_module

    from typer.testing import CliRunner

    import cli

    path = write_schedules(tmp_path / "s.toml", tiny_model)
    listed = CliRunner().invoke(cli.app, ["schedules", "list", "--file", str(path), "--json"])
    assert listed.exit_code == 0, listed.output
    (row,) = json_module.loads(listed.output)
    assert row["name"] == "nightly" and row["next_run"].endswith(("+01:00", "+02:00")) and "02:30:00" in row["next_run"]
    unknown = CliRunner().invoke(cli.app, ["schedules", "run", "weekly", "--file", str(path)])
    assert unknown.exit_code == 2 and "no schedule 'weekly'; known: nightly" in unknown.output
    assert len(unknown.output.strip().splitlines()) == 1


def finish_first_summary(runtime: Runtime, job_id: str, text: str = "Bike lanes grow by twelve miles.") -> str:
    """As a worker would: claim the night's first request and complete it; returns its document."""
    with runtime.session() as session:
        token, (request,) = store.claim_requests(session=session, job_id=job_id, worker="w", limit=1,
                                                 lease_seconds=60, max_attempts=3)
        store.finish_request(session=session, request_id=request.id, token=token, status=RequestStatus.completed,
                             generated=[5, 6], finish_reason="stop", output_text=text)
        session.commit()
        assert request.document is not None
        return request.document


def page_of(output: Path, document: str) -> Path:
    return output / (document.replace("/", "__") + ".md")


def assert_pages_of_an_ended_night(output: Path, job_id: str, document: str, end: str) -> None:
    """The finished summary has its page, and the index names the two other documents as ended."""
    page = page_of(output, document).read_text()
    assert "Bike lanes grow by twelve miles." in page and job_id in page
    index = (output / "index.md").read_text()
    assert f"| {document} | summarized |" in index and index.count(f"| {end} |") == 2 and f"({end})" in index


def summarized_documents(runtime: Runtime) -> list[str]:
    with runtime.session() as session:
        return [s.document for s in session.scalars(select(DocumentSummary))]


def summary_run(runtime: Runtime, job_id: str) -> SummaryRun:
    with runtime.session() as session:
        run = session.get(SummaryRun, job_id)
        assert run is not None
        return run


@pytest.mark.parametrize("end", ["cancelled", "expired"])
def test_a_night_cancelled_or_expired_with_nothing_running_still_writes_its_finished_summaries(
        make_runtime: Callable[..., Runtime], tiny_model: Path, docs: Path, tmp_path: Path,
        fake_clock: list[datetime], end: str) -> None:
    # Given a night whose first document's summary is finished and whose other two are still pending
    runtime = make_runtime(schedules=write_schedules(tmp_path / "schedules.toml", tiny_model))
    (night,) = fire_due_schedules(runtime)
    document = finish_first_summary(runtime, night.job_id)
    # When it is cancelled (nothing runs, so it ends at once) or its window ends, and the workers' sweep comes by
    if end == "cancelled":
        assert StoreBackend(runtime).cancel(night.job_id)["status"] == "cancelled"
    else:
        with runtime.session() as session:
            session.get(Job, night.job_id).expires_at = utcnow() - timedelta(seconds=1)
            session.commit()
    sweep_store(runtime)
    assert job_status(runtime, night.job_id) == end
    sweep_store(runtime)  # a second sweep writes nothing twice
    # Then the finished summary has its page, and the index names the two others as cancelled (expired)
    assert_pages_of_an_ended_night(tmp_path / "summaries", night.job_id, document, end)
    assert summarized_documents(runtime) == [document]


# ---- one lifecycle: whoever ends a night writes its pages, once -----------------------------------------------------
@pytest.mark.parametrize("path", ["api", "cli"])
def test_a_night_cancelled_over_the_api_or_the_cli_writes_its_pages_at_once_and_once(
        make_runtime: Callable[..., Runtime], database_url: str | None, serve: Callable[[Runtime], str],
        tiny_model: Path, docs: Path, tmp_path: Path, fake_clock: list[datetime], path: str) -> None:
    # Given a night whose first document's summary is finished and whose other two are still pending
    runtime = make_runtime(database_url=database_url, schedules=write_schedules(tmp_path / "schedules.toml",
                                                                                tiny_model))
    (night,) = fire_due_schedules(runtime)
    document = finish_first_summary(runtime, night.job_id)
    output = tmp_path / "summaries"
    api = None
    if path == "api":
        # a schedule's job belongs to no key; an operator's key owns this one, so the API may cancel it
        with runtime.session() as session:
            key, plain = store.create_api_key(session=session, name="operator")
            session.get(Job, night.job_id).api_key_id = key.id
            session.commit()
        api = httpx.Client(base_url=serve(runtime), headers={"Authorization": f"Bearer {plain}"}, timeout=60)

    def cancel() -> dict[str, Any]:
        if api is not None:
            return dict(api.post(f"/v1/batches/{night.job_id}/cancel").json())
        return StoreBackend(runtime).cancel(night.job_id)

    # When it is cancelled, with no worker and no sweep running
    job = cancel()
    # Then it is cancelled at once, and its pages are written by that very call
    assert job["status"] == "cancelled" and job["summary"]["pages_written_at"] is not None
    assert_pages_of_an_ended_night(output, night.job_id, document, "cancelled")
    assert summarized_documents(runtime) == [document]
    # And only once: cancelling again writes nothing
    page_of(output, document).unlink()
    (output / "index.md").unlink()
    assert cancel()["status"] == "cancelled"
    assert not page_of(output, document).exists() and not (output / "index.md").exists()
    if api is not None:
        api.close()


def test_a_night_that_a_worker_finds_overdue_writes_its_pages_as_it_expires_it(
        make_runtime: Callable[..., Runtime], tiny_model: Path, docs: Path, tmp_path: Path,
        fake_clock: list[datetime]) -> None:
    # Given a night whose first document's summary is finished, past its deadline
    runtime = make_runtime(schedules=write_schedules(tmp_path / "schedules.toml", tiny_model))
    (night,) = fire_due_schedules(runtime)
    document = finish_first_summary(runtime, night.job_id)
    with runtime.session() as session:
        session.get(Job, night.job_id).expires_at = utcnow() - timedelta(seconds=1)
        session.commit()
    # When a worker's task for it runs (no sweep): the worker expires it
    JobWorker(runtime).process(night.job_id)
    # Then the job expired, and the worker wrote its pages as it did so
    assert job_status(runtime, night.job_id) == "expired"
    assert_pages_of_an_ended_night(tmp_path / "summaries", night.job_id, document, "expired")
    assert summarized_documents(runtime) == [document]


def test_pages_that_cannot_be_written_are_recorded_and_a_later_sweep_writes_them(
        make_runtime: Callable[..., Runtime], database_url: str | None, tiny_model: Path, docs: Path, tmp_path: Path,
        fake_clock: list[datetime], monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a night whose output folder cannot be made (a file holds its name)
    runtime = make_runtime(database_url=database_url, schedules=write_schedules(tmp_path / "schedules.toml",
                                                                                tiny_model))
    output = tmp_path / "summaries"
    output.write_text("not a folder")
    (night,) = fire_due_schedules(runtime)
    document = finish_first_summary(runtime, night.job_id)
    # When it is cancelled: the cancel succeeds, and the failed write is recorded, not raised
    job = StoreBackend(runtime).cancel(night.job_id)
    assert job["status"] == "cancelled" and job["summary"]["pages_written_at"] is None
    assert "pages not written: FileExistsError" in describe_job(job)
    assert summarized_documents(runtime) == []
    first_try = summary_run(runtime, night.job_id)
    assert first_try.pages_attempts == 1 and first_try.pages_retry_at is not None
    # And a sweep before the retry is due does not try again
    monkeypatch.setattr("jobs.worker.sweep.utcnow", lambda: first_try.pages_retry_at - timedelta(seconds=1))
    assert sweep_store(runtime) == []
    assert summary_run(runtime, night.job_id).pages_attempts == 1
    # When the folder is fixed and a sweep runs once the retry is due
    output.unlink()
    monkeypatch.setattr("jobs.worker.sweep.utcnow", lambda: first_try.pages_retry_at)
    assert sweep_store(runtime) == []
    # Then the pages are written, and the error is cleared
    assert_pages_of_an_ended_night(output, night.job_id, document, "cancelled")
    assert summarized_documents(runtime) == [document]
    run = summary_run(runtime, night.job_id)
    assert (run.pages_attempts, run.pages_error, run.pages_retry_at) == (2, None, None)
    assert run.pages_written_at is not None


def test_a_page_write_that_keeps_failing_is_tried_a_bounded_number_of_times(
        make_runtime: Callable[..., Runtime], tiny_model: Path, docs: Path, tmp_path: Path,
        fake_clock: list[datetime], monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a cancelled night whose output folder can never be made
    runtime = make_runtime(schedules=write_schedules(tmp_path / "schedules.toml", tiny_model))
    (tmp_path / "summaries").write_text("not a folder")
    (night,) = fire_due_schedules(runtime)
    finish_first_summary(runtime, night.job_id)
    StoreBackend(runtime).cancel(night.job_id)
    # When sweeps run for days, each one after the previous retry was due
    for day in range(1, 11):
        monkeypatch.setattr("jobs.worker.sweep.utcnow", lambda day=day: utcnow() + timedelta(days=day))
        assert sweep_store(runtime) == []
    # Then it was tried MAX_PAGE_ATTEMPTS times in all, gave up, and keeps the error
    run = summary_run(runtime, night.job_id)
    assert run.pages_attempts == MAX_PAGE_ATTEMPTS and run.pages_retry_at is None
    assert run.pages_error is not None and run.pages_error.startswith("FileExistsError")
    assert StoreBackend(runtime).get(night.job_id)["summary"]["pages_error"] == run.pages_error
