"""Alembic migrations on the embedded SQLite store and on a real PostgreSQL: up, down, up again, and no drift."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, create_engine, inspect

from jobs.migrate import downgrade, upgrade
from jobs.models import Base

TABLES = {"api_keys", "jobs", "requests", "document_summaries"}


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
