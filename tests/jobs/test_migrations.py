"""Alembic migrations on the embedded SQLite store and on a real PostgreSQL: up, down, up again, and no drift."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, create_engine, inspect, text
from sqlalchemy.orm import Session

from jobs.batch_input import COMPLETIONS_URL, ParsedBatch, ParsedRequest
from jobs.migrate import downgrade, upgrade
from jobs.models import Base
from jobs.store import create_job

TABLES = {"api_keys", "jobs", "requests", "document_summaries", "worker_heartbeats", "maintenance_slots"}


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'swarmbatch.sqlite'}"
    return str(request.getfixturevalue("postgres_url"))


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


def test_dropping_request_resumes_keeps_the_rows_both_ways(database_url: str, engine: Engine) -> None:
    # Given a database at head holding a job with two requests
    upgrade(database_url)
    with Session(engine) as session:
        job = create_job(session=session, parsed=ParsedBatch([parsed_line(1), parsed_line(2)], [], COMPLETIONS_URL),
                         model="tiny")
        session.commit()
        job_id = job.id
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
    with Session(engine) as session:
        job = create_job(session=session, parsed=ParsedBatch([parsed_line(1), parsed_line(2)], [], COMPLETIONS_URL),
                         model="tiny")
        session.commit()
        job_id = job.id
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


def parsed_line(line_number: int) -> ParsedRequest:
    """A good completions line."""
    return ParsedRequest(line_number=line_number, custom_id=f"req-{line_number}", url=COMPLETIONS_URL,
                         body={"model": "tiny", "prompt": "hi"}, prompt_ids=[1, 2], max_tokens=4, temperature=0.0,
                         top_p=1.0, seed=0, stop=[])
