"""Engines and sessions: built from settings by the composition root, never at import."""
from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from jobs.settings import Settings


def make_engine(settings: Settings) -> Engine:
    """An engine for the configured database (SQLite under SWARMBATCH_HOME by default)."""
    url = settings.resolved_database_url
    if url.startswith("sqlite"):
        settings.home.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True)


def _sqlite_pragmas(connection: Any, _: Any) -> None:
    # WAL lets readers (API, CLI status) run while a worker writes; busy_timeout waits for the write lock
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded objects usable after commit."""
    return sessionmaker(engine, expire_on_commit=False)
