"""`DeferredChecks`: a session's checks by window, run beside its generation and settled before its tokens are kept.

Inline checks (hop_verifier.py) recompute one sampled hop step on a second holder: the stateless forward of the hop's
whole history (rows x tokens so far) to compare one step's outputs, while the step waits. A job's lane checks by
window instead (session.py): the steps between two of its checkpoints are a window, and when the lane settles its
checks (before each checkpoint, and when its session ends) each row of each hop is sampled with the verify fraction F;
the sampled rows' history is recomputed once and compared at every position of the window. A row that leaves the
session within a window (finished) is sampled and checked when it leaves. The checks run as tasks beside the lane's
steps, and the lane waits for them only at the checkpoint; a lie found raises `LieCaught` then, or at the session's
next step if found sooner. The caller drops every token since its last checkpoint (a job gives the lane's requests
back to resume from it, which every earlier window's checks passed), and the liar is banned for good, so the retry
routes around it.

Against per-step checks at the same F: each token (a row's position on a hop) is compared with probability F either
way; a server lying on every row is caught in the first window where one of its B rows is sampled (1 - (1 - F)^B per
window of K steps: 15 % for B = 8, F = 0.02, i.e. after ~7 windows, 53 steps of K = 8, against ~1/F = 50 steps), and
its tokens from that window are never kept; but one check now recomputes F x B rows once per window where per-step
checks recomputed all B rows F x K times, so checks cost about K times less. At most MAX_PENDING checks of a session
run at once; another waits for the oldest (a slow checker cannot pile up histories in memory).
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from swarmclient.errors import LieCaught
from swarmclient.verification_policy import Verdict
from swarmnet.data_structures import RouteHop
from swarmnet.network import LoopThread

MAX_PENDING = 4


@dataclass(frozen=True)
class Caught:
    """A deferred check's lie: the hop and step it was found on."""

    hop: RouteHop
    step: int

    def error(self) -> LieCaught:
        return LieCaught(self.hop.peer_id, self.step)


class DeferredChecks:
    """The pending checks of one inference session; `settle` (sync, from any thread) waits for them all.

    `on_caught` is told of a lie once, when it is found (the session marks the liar's hop and every later one broken).
    """

    def __init__(self, loop: LoopThread) -> None:
        self.loop = loop
        self._tasks: deque[asyncio.Future[Caught | None]] = deque()
        self._caught: Caught | None = None
        self.on_caught: Callable[[Caught], None] = lambda caught: None
        self.before_settle: Callable[[], Awaitable[None]] = _nothing  # the session starts its window's checks

    async def start(self, hop: RouteHop, step: int, check: Callable[[], Awaitable[Verdict | None]]) -> None:
        """Run `check` of this hop step beside the session (after the oldest, if MAX_PENDING already run)."""
        self.raise_caught()
        while len(self._tasks) >= MAX_PENDING:
            await self._finish(self._tasks.popleft())
        self._tasks.append(asyncio.ensure_future(self._run(hop, step, check)))

    @staticmethod
    async def _run(hop: RouteHop, step: int, check: Callable[[], Awaitable[Verdict | None]]) -> Caught | None:
        return Caught(hop, step) if await check() is Verdict.CHECKED_FAULTY else None

    def start_now(self, hop: RouteHop, step: int, check: Callable[[], Awaitable[Verdict | None]]) -> None:
        """`start` without waiting for room (from synchronous code; MAX_PENDING is enforced at the next `start`)."""
        self._tasks.append(asyncio.ensure_future(self._run(hop, step, check)))

    def raise_caught(self) -> None:
        """Raise LieCaught if a finished check caught a lie (the ones still running are left to run)."""
        while self._tasks and self._tasks[0].done():
            self._note(self._tasks.popleft().result())
        for task in self._tasks:
            if task.done():
                self._note(task.result())
        if self._caught is not None:
            raise self._caught.error()

    async def asettle(self) -> None:
        """Start the window's checks, wait for every pending check; raise LieCaught if one caught a lie."""
        self.raise_caught()
        await self.before_settle()
        while self._tasks:
            await self._finish(self._tasks.popleft())
        self.raise_caught()

    def settle(self) -> None:
        """`asettle` from a thread outside the session's event loop (a job's lane, before it checkpoints)."""
        self.loop.run(self.asettle())

    def cancel(self) -> None:
        """Drop the pending checks (the session is closing on an error: its tokens are dropped anyway)."""
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()

    async def _finish(self, task: asyncio.Future[Caught | None]) -> None:
        self._note(await task)
        if self._caught is not None:
            raise self._caught.error()

    def _note(self, caught: Caught | None) -> None:
        if caught is not None and self._caught is None:
            self._caught = caught
            self.on_caught(caught)


async def _nothing() -> None:
    return None
