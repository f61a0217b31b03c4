"""`DeferredChecks`: a session's sampled hop checks, run beside its generation instead of stalling its steps.

Checked outputs recompute a sampled hop step on a second holder (hop_verifier.py). Inline, the step waits for that
recompute (the hop's whole history: rows x tokens so far), so every check stalls its lane for dozens of decode steps.
Deferred, the step starts the check as a task and goes on; whoever makes tokens durable settles the checks first (a
job's lane, before each checkpoint), and a check that caught a lie raises `LieCaught` then, or at the session's
next step if it is caught sooner. The caller drops every token since its last settled point: a job gives the
lane's requests back to resume from their last checkpoint, which every check sampled before it passed; the liar is
banned for good, so the retry routes around it.

The catch guarantee is the checks' own: the same steps are sampled, the same holders recompute them, a lie is caught
with the same probability. What changes is when it is acted on (at the next checkpoint at the latest, instead of
the same step) and that a caught lie costs the lane's tokens since its last checkpoint instead of one hop's replay.
At most MAX_PENDING checks of a session run at once; another waits for the oldest (a slow checker cannot pile up
histories in memory).
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

    async def start(self, hop: RouteHop, step: int, check: Callable[[], Awaitable[Verdict | None]]) -> None:
        """Run `check` of this hop step beside the session (after the oldest, if MAX_PENDING already run)."""
        self.raise_caught()
        while len(self._tasks) >= MAX_PENDING:
            await self._finish(self._tasks.popleft())

        async def run() -> Caught | None:
            return Caught(hop, step) if await check() is Verdict.CHECKED_FAULTY else None
        self._tasks.append(asyncio.ensure_future(run()))

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
        """Wait for every pending check; raise LieCaught if one caught a lie."""
        while self._tasks:
            await self._finish(self._tasks.popleft())
        self.raise_caught()

    def settle(self) -> None:
        """`asettle` from a thread outside the session's event loop (a job's lane, before it checkpoints; its session
        is between steps then, so nothing else changes the pending checks)."""
        if self._tasks or self._caught is not None:
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
