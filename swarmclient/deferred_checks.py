"""`DeferredChecks`: a session's checks by window, run beside its generation and settled before its tokens are kept.

Inline checks (hop_verifier.py) recompute one sampled hop step on a second holder: the stateless forward of the hop's
whole history (rows x tokens so far) to compare one step's outputs, while the step waits. A job's lane checks by
window instead (session.py): the steps between two of its checkpoints are a window, and when the lane settles its
checks (before each checkpoint, and when its session ends) each row of each hop is sampled with the verify fraction F;
the sampled rows' history is recomputed once and compared at every position of the window. A row that leaves the
session within a window (finished) is sampled and checked when it leaves. The checks run as tasks beside the lane's
steps, and a window's checks go on running while the next window's steps do: a checkpoint (`close_window`) waits
only for the checks of the windows before the one it closes, and tells the caller whether that one's are done too.
A job's lane commits the tokens up to the closed window when they are, and else those up to the checkpoint before
(whose checks it just waited for), so no token is committed before its window's checks passed, and the lane waits
for a check only when a whole window's steps were not time enough for it. A lie found raises `LieCaught` at the next
checkpoint, or at the session's next step if found sooner. The caller drops every token since its last commit (a job
gives the lane's requests back to resume from it, which every earlier window's checks passed), and the liar is banned
for good, so the retry routes around it.

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
    """The pending checks of one inference session, by window; `close_window` and `settle` (sync, from any thread)
    wait for them.

    `on_caught` is told of a lie once, when it is found (the session marks the liar's hop and every later one broken).
    """

    def __init__(self, loop: LoopThread) -> None:
        self.loop = loop
        self.window = 0  # the window whose steps run now; its checks start when it closes
        self._tasks: deque[tuple[int, asyncio.Future[Caught | None]]] = deque()  # (window, check), oldest first
        self._caught: Caught | None = None
        self.on_caught: Callable[[Caught], None] = lambda caught: None
        self.before_settle: Callable[[], Awaitable[None]] = _nothing  # the session starts its window's checks
        self.on_window_open: Callable[[], None] = lambda: None  # the next window's steps follow (warm_checks.py)

    async def start(self, hop: RouteHop, step: int, check: Callable[[], Awaitable[Verdict | None]]) -> None:
        """Run `check` of this hop step beside the session (after the oldest, if MAX_PENDING already run)."""
        self.raise_caught()
        while len(self._tasks) >= MAX_PENDING:
            await self._finish(self._tasks.popleft()[1])
        self.start_now(hop, step, check)

    @staticmethod
    async def _run(hop: RouteHop, step: int, check: Callable[[], Awaitable[Verdict | None]]) -> Caught | None:
        return Caught(hop, step) if await check() is Verdict.CHECKED_FAULTY else None

    def start_now(self, hop: RouteHop, step: int, check: Callable[[], Awaitable[Verdict | None]]) -> None:
        """`start` without waiting for room (from synchronous code; MAX_PENDING is enforced at the next `start`)."""
        self._tasks.append((self.window, asyncio.ensure_future(self._run(hop, step, check))))

    def raise_caught(self) -> None:
        """Raise LieCaught if a finished check caught a lie (the ones still running are left to run)."""
        while self._tasks and self._tasks[0][1].done():
            self._note(self._tasks.popleft()[1].result())
        for _, task in self._tasks:
            if task.done():
                self._note(task.result())
        if self._caught is not None:
            raise self._caught.error()

    async def asettle(self, *, keep_last: bool = False) -> bool:
        """Start the window's checks and close it; wait for every pending check (keep_last: every check of the
        windows before the one just closed, whose own checks go on running); raise LieCaught if one caught a lie.
        True when no check is left running."""
        self.raise_caught()
        await self.before_settle()
        self.window += 1
        if keep_last:  # a checkpoint: the session goes on, and its next window opens
            self.on_window_open()
        last = self.window - 1 if keep_last else self.window
        while self._tasks and self._tasks[0][0] < last:
            await self._finish(self._tasks.popleft()[1])
        self.raise_caught()
        return not self._tasks

    def settle(self) -> None:
        """`asettle` from a thread outside the session's event loop: every check done (a session's end)."""
        self.loop.run(self.asettle())

    def close_window(self) -> bool:
        """The caller's checkpoint: start this window's checks, which run while the next window's steps do, and wait
        for the earlier windows' (raises LieCaught). What the caller got before the window just closed is checked;
        True when the closed window's own checks are done too (none sampled, or already passed)."""
        return self.loop.run(self.asettle(keep_last=True))

    def cancel(self) -> None:
        """Drop the pending checks (the session is closing on an error: its tokens are dropped anyway)."""
        for _, task in self._tasks:
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
