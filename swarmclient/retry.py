"""The one retry policy of the client: exponential backoff with jitter (tenacity) and growing peer bans."""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt

from swarmclient.config import ClientConfig
from swarmclient.errors import MissingBlocksError, PeerFailed

logger = logging.getLogger(__name__)
T = TypeVar("T")


def backoff_delay(attempt: int, config: ClientConfig) -> float:
    """Seconds to wait before retry number `attempt` (1-based): exponential, capped, with full jitter."""
    ceiling = min(config.max_backoff, config.min_backoff * 2 ** (attempt - 1))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


@dataclass
class BanList:
    """Peers to avoid for a while; each further failure doubles the ban, a success forgives.

    A peer caught computing wrong outputs is banned for good (`ban_for_good`): for the rest of the process.
    """

    base_timeout: float
    max_timeout: float
    clock: Callable[[], float] = time.monotonic
    _until: dict[str, float] = field(default_factory=dict)
    _strikes: dict[str, int] = field(default_factory=dict)
    _for_good: set[str] = field(default_factory=set)

    def ban(self, peer_id: str) -> float:
        """Ban a peer; returns the ban's duration in seconds."""
        strikes = self._strikes.get(peer_id, 0)
        duration = min(self.max_timeout, self.base_timeout * 2**strikes)
        self._strikes[peer_id] = strikes + 1
        self._until[peer_id] = self.clock() + duration
        return duration

    def ban_for_good(self, peer_id: str) -> None:
        """Never route to this peer again in this process (its outputs were found wrong)."""
        self._for_good.add(peer_id)

    def banned_for_good(self, peer_id: str) -> bool:
        """Whether the peer was caught computing wrong outputs."""
        return peer_id in self._for_good

    def lift(self, peer_id: str) -> None:
        """End a peer's ban now (its failure turned out not to be its own); its strikes stay."""
        self._until.pop(peer_id, None)

    def forgive(self, peer_id: str) -> None:
        """Reset a peer's strikes after it served us well."""
        self._strikes.pop(peer_id, None)

    def is_banned(self, peer_id: str) -> bool:
        """Whether the peer is banned now."""
        return peer_id in self._for_good or self._until.get(peer_id, 0.0) > self.clock()

    def banned(self) -> set[str]:
        """All peers banned now."""
        now = self.clock()
        return {peer for peer, until in self._until.items() if until > now} | self._for_good


def _is_recoverable(exc: BaseException) -> bool:
    return isinstance(exc, (PeerFailed, MissingBlocksError))


async def with_retries(
    fn: Callable[[], Awaitable[T]],
    *,
    config: ClientConfig,
    on_failure: Callable[[BaseException], Awaitable[None]],
) -> T:
    """Call `fn` until it succeeds; after each recoverable failure, await `on_failure(exc)`, then back off.

    Unrecoverable errors (InvalidRequest, ModelDirError, ...) propagate at once; after `config.max_retries`
    failed attempts the last error propagates. The first attempt runs without tenacity's bookkeeping: every
    hop of every decode step comes through here, and nearly all of them succeed the first time.
    """
    try:
        return await fn()
    except Exception as exc:
        if not _is_recoverable(exc) or config.max_retries <= 1:
            raise
        await _before_retry(1, exc, on_failure)
    await asyncio.sleep(backoff_delay(1, config))

    async def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        if exc is not None:
            await _before_retry(state.attempt_number + 1, exc, on_failure)

    retrying = AsyncRetrying(  # attempts 2 .. max_retries
        stop=stop_after_attempt(config.max_retries - 1),
        wait=lambda state: backoff_delay(state.attempt_number + 1, config),
        retry=retry_if_exception(_is_recoverable),
        before_sleep=before_sleep,
        reraise=True,
    )
    async def attempt() -> T:  # tenacity awaits only real coroutine functions, not lambdas returning coroutines
        return await fn()

    return await retrying(attempt)


async def _before_retry(attempt: int, exc: BaseException, on_failure: Callable[[BaseException], Awaitable[None]]
                        ) -> None:
    logger.warning("Attempt %d failed (%s); retrying", attempt, exc)
    await on_failure(exc)
