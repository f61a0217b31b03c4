"""Fixtures of the chaos tests: private Redis and PostgreSQL servers (private_servers.py), one per module."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from private_servers import PrivatePostgres, PrivateRedis


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def private_postgres() -> Iterator[PrivatePostgres]:
    server = PrivatePostgres()
    try:
        server.start()
        yield server
    finally:
        server.stop()
