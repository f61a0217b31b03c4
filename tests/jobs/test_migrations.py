"""Alembic migrations on the embedded SQLite store and on a real PostgreSQL: up, down, up again, and no drift."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import JSON, Engine, create_engine, inspect, select, text
from sqlalchemy import column as sa_column
from sqlalchemy import table as sa_table
from sqlalchemy.orm import Session

from jobs.batch_input import COMPLETIONS_URL, ParsedBatch, ParsedRequest
from jobs.migrate import downgrade, upgrade
from jobs.models import Base, Job, JobKind, JobStatus, UTCDateTime
from jobs.store import create_job

ROOT = Path(__file__).resolve().parents[2]

TABLES = {"api_keys", "jobs", "requests", "document_summaries", "summary_runs", "worker_heartbeats", "maintenance_slots",
          "files", "file_chunks", "swarm_snapshots"}


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'swarmbatch.sqlite'}"
    return str(request.getfixturevalue("empty_postgres_url"))


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """An engine on that database, disposed of afterwards (PostgreSQL drops the database at teardown)."""
    engine = create_engine(database_url)
    yield engine
    engine.dispose()


def table_names(engine: Engine) -> set[str]:
    """The tables the database holds now."""
    return set(inspect(engine).get_table_names())


def schema_diffs(engine: Engine) -> list[object]:
    """What Alembic autogenerate would change to make the database match `jobs.models`."""
    with engine.connect() as connection:
        return list(compare_metadata(MigrationContext.configure(connection), Base.metadata))


def test_upgrade_to_head_creates_the_tables(database_url: str, engine: Engine) -> None:
    upgrade(database_url)

    assert TABLES <= table_names(engine)


def test_downgrade_to_base_drops_the_tables_and_upgrade_works_again(database_url: str, engine: Engine) -> None:
    # Given a database at head
    upgrade(database_url)
    # When it is downgraded to base
    downgrade(database_url)
    # Then our tables are gone (only Alembic's own version table may stay)
    assert not TABLES & table_names(engine)
    assert table_names(engine) <= {"alembic_version"}
    # And upgrading again builds them again
    upgrade(database_url)
    assert TABLES <= table_names(engine)


def test_upgrade_to_head_twice_changes_nothing(database_url: str, engine: Engine) -> None:
    upgrade(database_url)
    upgrade(database_url)

    assert TABLES <= table_names(engine)
    assert schema_diffs(engine) == []


def test_the_models_match_the_migrated_schema(database_url: str, engine: Engine) -> None:
    upgrade(database_url)

    assert schema_diffs(engine) == []


def test_an_unmigrated_database_differs_from_the_models(database_url: str, engine: Engine) -> None:
    # Guards the drift check itself: compare_metadata must see missing tables, or the test above proves nothing
    diffs = schema_diffs(engine)

    added = {diff[1].name for diff in diffs if isinstance(diff, tuple) and diff[0] == "add_table"}
    assert added == TABLES


def job_with_two_requests(engine: Engine) -> str:
    """A committed job of two requests, written by the store at the current head; returns its id."""
    with Session(engine) as session:
        job = create_job(session=session, parsed=ParsedBatch([parsed_line(1), parsed_line(2)], [], COMPLETIONS_URL),
                         model="tiny")
        session.commit()
        return job.id


def test_dropping_request_resumes_keeps_the_rows_both_ways(database_url: str, engine: Engine) -> None:
    # Given a database at head holding a job with two requests
    upgrade(database_url)
    job_id = job_with_two_requests(engine)
    # When it is downgraded to before 0003, the column comes back, 0 on the rows that exist
    downgrade(database_url, "0002_summaries")
    with engine.connect() as connection:
        resumes = connection.execute(text("SELECT resumes FROM requests WHERE job_id = :id"), {"id": job_id})
        assert list(resumes.scalars()) == [0, 0]
    # And upgrading again drops it, keeps the requests and matches the models
    upgrade(database_url)
    assert "resumes" not in {c["name"] for c in inspect(engine).get_columns("requests")}
    with engine.connect() as connection:
        count = connection.execute(text("SELECT count(*) FROM requests WHERE job_id = :id"), {"id": job_id})
        assert count.scalar() == 2
    assert schema_diffs(engine) == []


def test_the_generated_count_is_filled_from_the_stored_token_ids(database_url: str, engine: Engine) -> None:
    # Given requests with generated tokens, at the revision before 0006 (which has no generated_count)
    upgrade(database_url)
    job_id = job_with_two_requests(engine)
    downgrade(database_url, "0005_api_key_revocation")
    assert "generated_count" not in {c["name"] for c in inspect(engine).get_columns("requests")}
    with engine.begin() as connection:
        connection.execute(text("UPDATE requests SET generated_ids = '[5, 6, 7]' WHERE custom_id = 'req-1'"))
    # When it is upgraded, Then each row counts its stored tokens
    upgrade(database_url)
    with engine.connect() as connection:
        counts = connection.execute(text("SELECT custom_id, generated_count FROM requests WHERE job_id = :id"),
                                    {"id": job_id})
        assert dict(counts.tuples().all()) == {"req-1": 3, "req-2": 0}
    assert schema_diffs(engine) == []


def test_0012_fills_the_prompt_count_from_the_stored_prompt_ids_and_drops_it_on_downgrade(
        database_url: str, engine: Engine) -> None:
    # Given requests at the revision before 0012 (which has no prompt_count), one with a longer prompt
    upgrade(database_url)
    job_id = job_with_two_requests(engine)
    downgrade(database_url, "0011_openai_files")
    assert "prompt_count" not in {c["name"] for c in inspect(engine).get_columns("requests")}
    with engine.begin() as connection:
        connection.execute(text("UPDATE requests SET prompt_ids = '[1, 2, 3, 4, 5]' WHERE custom_id = 'req-1'"))
    # When it is upgraded, Then each row counts its stored prompt tokens
    upgrade(database_url)
    with engine.connect() as connection:
        counts = connection.execute(text("SELECT custom_id, prompt_count FROM requests WHERE job_id = :id"),
                                    {"id": job_id})
        assert dict(counts.tuples().all()) == {"req-1": 5, "req-2": 2}
    assert schema_diffs(engine) == []


def parsed_line(line_number: int) -> ParsedRequest:
    """A good completions line."""
    return ParsedRequest(line_number=line_number, custom_id=f"req-{line_number}", url=COMPLETIONS_URL,
                         body={"model": "tiny", "prompt": "hi"}, prompt_ids=[1, 2], max_tokens=4, temperature=0.0,
                         top_p=1.0, seed=0, stop=[])


# ---- 0007: a summary job's state moves out of the user's metadata ------------------------------------------------
OLD_SUMMARY_METADATA = {
    "schedule": "nightly", "period": "2026-12-03T02:30:00+01:00", "model_id": "tiny@r1",
    "output": "/srv/summaries/notes", "template_sha": "t" * 64,
    "summarize": {"prompt": "Summarize: {document}", "reduce_prompt": "Combine: {summaries}", "chat": True,
                  "max_tokens": 12, "temperature": 0.0, "top_p": 1.0, "seed": 0, "chunk_overlap": 64},
    "documents": [{"key": "a.txt", "source": "/docs/a.txt", "sha": "s" * 64, "action": "summarize"},
                  {"key": "b.txt", "source": "/docs/b.txt", "sha": "u" * 64, "action": "skip"}],
    "skipped": 1, "outputs_written": True}
# what a key holder could submit before 0007: the service's keys, in a user's batch
HOSTILE_METADATA = {"summarize": 1, "schedule": "nightly", "period": "p", "output": "/etc", "team": "docs"}

old_jobs = sa_table("jobs", *(sa_column(name) for name in (
    "id", "api_key_id", "model", "endpoint", "status", "checkpoint_every", "completion_window_s", "idempotency_key")),
    *(sa_column(name, UTCDateTime()) for name in ("created_at", "expires_at", "completed_at")),
    sa_column("line_errors", JSON), sa_column("metadata", JSON))


def old_job(job_id: str, metadata: dict[str, object], *, api_key_id: int | None = None,
            idempotency_key: str | None = None) -> dict[str, object]:
    """A completed job row as the code before 0007 wrote it."""
    now = datetime.now(UTC)
    return {"id": job_id, "api_key_id": api_key_id, "model": "tiny", "endpoint": COMPLETIONS_URL,
            "status": "completed", "line_errors": [], "checkpoint_every": 8, "completion_window_s": 3600,
            "idempotency_key": idempotency_key, "created_at": now, "expires_at": now + timedelta(hours=1),
            "completed_at": now, "metadata": metadata}


def test_0007_moves_a_summary_jobs_state_out_of_the_metadata_and_back(database_url: str, engine: Engine) -> None:
    # Given a database at 0004 with an old-style summary job, a user's batch holding the same keys, and a plain one
    upgrade(database_url, "0004_worker_maintenance")
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO api_keys (id, name, key_hash, created_at) "
                                "VALUES (7, 'user', :hash, CURRENT_TIMESTAMP)"), {"hash": "h" * 64})
        connection.execute(old_jobs.insert(), [
            old_job("batch_summary", OLD_SUMMARY_METADATA,
                    idempotency_key=f"schedule:nightly:{OLD_SUMMARY_METADATA['period']}"),
            old_job("batch_hostile", HOSTILE_METADATA, api_key_id=7),
            old_job("batch_plain", {"team": "docs"}, api_key_id=7)])
    # When it is upgraded
    upgrade(database_url)
    # Then the summary job is of kind summary, its state is in its summary run, and its metadata is empty
    with Session(engine) as session:
        summary = session.get(Job, "batch_summary")
        assert summary is not None and summary.kind == JobKind.summary and summary.metadata_json == {}
        run = summary.summary
        assert run is not None
        assert (run.schedule, run.period, run.model_id, run.output_dir, run.template_sha, run.skipped) == (
            "nightly", OLD_SUMMARY_METADATA["period"], "tiny@r1", "/srv/summaries/notes", "t" * 64, 1)
        assert run.shape == OLD_SUMMARY_METADATA["summarize"] and run.documents == OLD_SUMMARY_METADATA["documents"]
        assert run.pages_written_at is not None and run.pages_retry_at is None and run.pages_error is None
        # And the user's batches stay batches with their metadata as it was: nothing a user wrote becomes state
        for job_id, metadata in (("batch_hostile", HOSTILE_METADATA), ("batch_plain", {"team": "docs"})):
            job = session.get(Job, job_id)
            assert job is not None and job.kind == JobKind.batch and job.summary is None
            assert job.metadata_json == metadata
    assert schema_diffs(engine) == []
    # When it is downgraded to 0004, Then the metadata is as the old code wrote it, and the new schema is gone
    downgrade(database_url, "0004_worker_maintenance")
    with engine.connect() as connection:
        rows = connection.execute(select(old_jobs.c.id, old_jobs.c.metadata)).all()
    assert dict(rows) == {"batch_summary": OLD_SUMMARY_METADATA, "batch_hostile": HOSTILE_METADATA,
                          "batch_plain": {"team": "docs"}}
    assert "summary_runs" not in table_names(engine)
    assert "kind" not in {c["name"] for c in inspect(engine).get_columns("jobs")}


def test_0011_makes_queued_jobs_validating_and_back(database_url: str, engine: Engine) -> None:
    # Given a database at 0010 with a job that waits for its first claim (queued, as the code before 0011 said)
    upgrade(database_url, "0010_job_pipeline")
    with engine.begin() as connection:
        connection.execute(old_jobs.insert(), [{**old_job("batch_waiting", {}), "status": "queued",
                                                "completed_at": None}, old_job("batch_done", {})])
    # When it is upgraded, Then it is validating (OpenAI's first status), with no files yet, and the other unchanged
    upgrade(database_url)
    with Session(engine) as session:
        waiting, done = session.get(Job, "batch_waiting"), session.get(Job, "batch_done")
        assert waiting is not None and waiting.status == JobStatus.validating and waiting.input_file_id is None
        assert done is not None and done.status == JobStatus.completed
    # and a downgrade gives the old status back
    downgrade(database_url, "0010_job_pipeline")
    with engine.connect() as connection:
        assert connection.execute(text("SELECT status FROM jobs ORDER BY id")).scalars().all() == ["completed", "queued"]


# ---- 0013: the swarm snapshots that workers publish for the web view ------------------------------------------
def test_0013_adds_the_swarm_snapshots_table_and_takes_it_away_again(database_url: str, engine: Engine) -> None:
    # Given a database at head with a snapshot in it
    upgrade(database_url)
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO swarm_snapshots (model, worker, taken_at, report) "
                                "VALUES ('tiny', 'host:1', CURRENT_TIMESTAMP, '{\"blocks\": []}')"))
    # When it is downgraded to 0012, only that table goes
    downgrade(database_url, "0012_request_prompt_count")
    assert table_names(engine) == (TABLES - {"swarm_snapshots"}) | {"alembic_version"}
    # And upgrading again brings it back, empty, matching the models
    upgrade(database_url)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM swarm_snapshots")).scalar() == 0
    assert schema_diffs(engine) == []


# ---- 0014: retention of the Files API ------------------------------------------------------------------------------
def test_0014_adds_the_expiry_columns_keeping_the_files_and_takes_them_away_again(database_url: str,
                                                                                 engine: Engine) -> None:
    # Given a database at 0013 holding a file
    upgrade(database_url, "0013_swarm_snapshots")
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO files (id, purpose, filename, bytes, created_at) "
                                "VALUES ('file-1', 'batch', 'a.jsonl', 3, CURRENT_TIMESTAMP)"))
    # When it is upgraded, Then the file is kept, expiring never, and the schema matches the models
    upgrade(database_url)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT id, expires_at FROM files")).all() == [("file-1", None)]
    assert schema_diffs(engine) == []
    # And downgraded again, the columns go and the file stays
    downgrade(database_url, "0013_swarm_snapshots")
    with engine.connect() as connection:
        assert connection.execute(text("SELECT id FROM files")).scalars().all() == ["file-1"]
    assert "expires_at" not in {c["name"] for c in inspect(engine).get_columns("files")}
    assert "outputs_expired_at" not in {c["name"] for c in inspect(engine).get_columns("jobs")}


# ---- 0015: embeddings -----------------------------------------------------------------------------------------------
def test_0015_adds_the_embedding_column_keeping_the_requests_and_takes_it_away_again(database_url: str,
                                                                                    engine: Engine) -> None:
    # Given a database at 0014 holding a job's requests (written at head, the column then dropped)
    upgrade(database_url)
    job_id = job_with_two_requests(engine)
    downgrade(database_url, "0014_retention")
    # When it is upgraded, Then the requests are kept without an embedding, and the schema matches the models
    upgrade(database_url)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT embedding FROM requests WHERE job_id = :j"), {"j": job_id}
                                  ).scalars().all() == [None, None]
    assert schema_diffs(engine) == []
    # And downgraded again, the column goes and the requests stay
    downgrade(database_url, "0014_retention")
    with engine.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM requests WHERE job_id = :j"), {"j": job_id}).scalar() == 2
    assert "embedding" not in {c["name"] for c in inspect(engine).get_columns("requests")}


@pytest.mark.swarm  # starts processes
def test_processes_starting_together_on_a_new_embedded_store_each_migrate_it_without_error(tmp_path: Path) -> None:
    # Given three processes (the demo, its worker, an api) opening the same new SQLite store at once
    code = ("import sys; from jobs.assembly import build_runtime; from jobs.settings import Settings; "
            "build_runtime(Settings(home=sys.argv[1])).ensure_store()")
    started = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, stderr=subprocess.PIPE)
               for _ in range(3)]
    # Then each finds it migrated (one at a time), none fails with "table ... already exists"
    for process in started:
        _, err = process.communicate(timeout=120)
        assert process.returncode == 0, err.decode()[-500:]
