"""The one retry policy: backoff with jitter, growing bans, recoverable vs unrecoverable errors."""
from __future__ import annotations

import asyncio

import pytest
from factories import ManualClock

from swarmclient.config import ClientConfig
from swarmclient.errors import InvalidRequest, PeerFailed
from swarmclient.retry import BanList, backoff_delay, with_retries

FAST = ClientConfig(min_backoff=0.001, max_backoff=0.004, max_retries=4)


def test_backoff_grows_exponentially_up_to_the_cap() -> None:
    config = ClientConfig(min_backoff=1.0, max_backoff=8.0)
    assert 0.5 <= backoff_delay(1, config) <= 1.0
    assert 2.0 <= backoff_delay(3, config) <= 4.0
    assert 4.0 <= backoff_delay(10, config) <= 8.0


def test_each_further_failure_doubles_a_ban_and_a_ban_expires() -> None:
    clock = ManualClock(1000.0)
    bans = BanList(10.0, 100.0, clock=clock)
    assert bans.ban("p") == 10.0 and bans.ban("p") == 20.0 and bans.ban("p") == 40.0
    assert bans.is_banned("p") and bans.banned() == {"p"}
    clock.now += 41
    assert not bans.is_banned("p")


def test_forgiving_a_peer_resets_its_ban_length() -> None:
    bans = BanList(10.0, 100.0, clock=ManualClock(1000.0))
    bans.ban("p")
    bans.ban("p")
    bans.forgive("p")
    assert bans.ban("p") == 10.0


def test_a_recoverable_failure_is_retried_and_reported() -> None:
    calls, failures = [], []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise PeerFailed("peer" * 4, "boom")
        return "ok"

    async def on_failure(exc: BaseException) -> None:
        failures.append(exc)

    assert asyncio.run(with_retries(flaky, config=FAST, on_failure=on_failure)) == "ok"
    assert len(calls) == 3 and len(failures) == 2


def test_retries_stop_at_the_limit_with_the_last_error() -> None:
    calls, failures = [], []

    async def always() -> None:
        calls.append(1)
        raise PeerFailed("peer" * 4, f"down {len(calls)}")

    async def on_failure(exc: BaseException) -> None:
        failures.append(exc)

    with pytest.raises(PeerFailed, match="down 4"):
        asyncio.run(with_retries(always, config=FAST, on_failure=on_failure))
    # every attempt but the last is reported (the caller bans the peer and reroutes before the next one)
    assert len(calls) == FAST.max_retries and [str(e)[-6:] for e in failures] == ["down 1", "down 2", "down 3"]


def test_an_invalid_request_is_never_retried() -> None:
    calls = []

    async def bad() -> None:
        calls.append(1)
        raise InvalidRequest("wrong shape")

    async def ignore(exc: BaseException) -> None:
        pass

    with pytest.raises(InvalidRequest):
        asyncio.run(with_retries(bad, config=FAST, on_failure=ignore))
    assert calls == [1]
