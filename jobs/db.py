"""Engines and sessions: built from settings by the composition root, never at import; the store's retry policy."""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_delay, wait_random_exponential

from jobs.errors import StoreUnavailable
from jobs.settings import Settings

logger = logging.getLogger(__name__)
T = TypeVar("T")

CONNECT_TIMEOUT = 10  # seconds; a database host that drops packets must fail an attempt, not hang it
MAX_RETRY_WAIT = 4.0  # seconds between retries at most: a worker notices a restarted database this soon
# SQLite reports a schema mistake as OperationalError too; it never passes by itself
_SCHEMA_ERROR = re.compile(r"no such (table|column)|has no column|syntax error", re.IGNORECASE)


def make_engine(settings: Settings) -> Engine:
    """An engine for the configured database (SQLite under SWARMBATCH_HOME by default)."""
    url = settings.resolved_database_url
    if url.startswith("sqlite"):
        settings.home.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    # client_encoding: a database created with SQL_ASCII (initdb under the C locale) would otherwise make the driver
    # encode text as ASCII, and a generated "–" would fail the checkpoint; UTF-8 goes through either way
    connect_args = {"connect_timeout": CONNECT_TIMEOUT, "client_encoding": "utf8"} if url.startswith("postgresql") else {}
    return create_engine(url, pool_pre_ping=True, connect_args=connect_args)


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


# where a long read (a streamed download) gets each of its pages: a short session of its own per page
# (Runtime.session), so nothing is held between pages, or one session the caller holds (`held`)
SessionScope = Callable[[], AbstractContextManager[Session]]


def held(session: Session) -> SessionScope:
    """Every page read in `session` (the worker's transaction, which sees its own uncommitted writes)."""
    return lambda: nullcontext(session)


def is_transient(error: BaseException) -> bool:
    """Whether a database error may pass by itself: a lost connection, a restarting server, a lock or pool timeout."""
    if isinstance(error, PoolTimeout):
        return True
    if not isinstance(error, DBAPIError):
        return False
    if error.connection_invalidated:
        return True
    return isinstance(error, OperationalError) and not _SCHEMA_ERROR.search(str(error.orig))


def retry_store(unit: Callable[[], T], *, what: str, within: float) -> T:
    """Run `unit`, one whole transaction (it opens its session and commits), retrying transient database errors.

    Retries back off exponentially with full jitter, one log line each, for `within` seconds in all; then
    StoreUnavailable. A retry may follow a commit whose answer was lost, so `unit` must be idempotent: the
    worker's writes are fenced by their lease token, and a retried unit re-reads what it needs.
    """
    def log(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        logger.warning("%s: the database failed (%s); retry %d in %.1f s", what, first_line(error),
                       state.attempt_number, state.next_action.sleep if state.next_action else 0.0)

    retrying = Retrying(stop=stop_after_delay(within), wait=wait_random_exponential(multiplier=0.2, max=MAX_RETRY_WAIT),
                        retry=retry_if_exception(is_transient), before_sleep=log, reraise=True)
    try:
        return retrying(unit)
    except Exception as error:
        if is_transient(error):
            raise StoreUnavailable(f"{what}: the database did not answer for {within:.0f} s "
                                   f"({first_line(error)})") from error
        raise


def first_line(error: BaseException | None) -> str:
    """The first line of an error, prefixed by its type (SQLAlchemy's messages run over several lines)."""
    if error is None:
        return ""
    cause = error.orig if isinstance(error, DBAPIError) else error
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__
