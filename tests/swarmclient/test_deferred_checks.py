"""DeferredChecks on a real event loop: a window's checks run while the next window's steps do, and a checkpoint waits
only for the windows before the one it closes."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from swarmclient.deferred_checks import DeferredChecks
from swarmclient.errors import LieCaught
from swarmclient.verification_policy import Verdict
from swarmnet.data_structures import RouteHop
from swarmnet.network import LoopThread

HOP = RouteHop("liar-peer-id", 0, 3)


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread("test-deferred-checks")
    yield thread
    thread.stop()


class GatedCheck:
    """A check that answers `verdict` once `release` is called (from any thread)."""

    def __init__(self, loop: LoopThread, verdict: Verdict) -> None:
        self.loop, self.verdict, self.gate = loop, verdict, asyncio.Event()
        self.started = threading.Event()

    async def __call__(self) -> Verdict:
        self.started.set()
        await self.gate.wait()
        return self.verdict

    def release(self) -> None:
        self.loop.loop.call_soon_threadsafe(self.gate.set)


def schedule(checks: DeferredChecks, check: GatedCheck, step: int) -> None:
    """What the session does when a window closes: start the window's sampled checks."""
    async def start_window() -> None:
        await checks.start(HOP, step, check)
    checks.before_settle = start_window


def test_closing_a_window_leaves_its_checks_running_and_the_next_close_waits_for_them(loop: LoopThread) -> None:
    checks = DeferredChecks(loop)
    first = GatedCheck(loop, Verdict.AGREE)
    schedule(checks, first, 0)
    # When window 0 closes, its check starts and the caller goes on at once: its tokens are not checked yet
    assert checks.close_window() is False and first.started.wait(5)
    # and when window 1 closes (no check sampled), it waits for window 0's check
    checks.before_settle = DeferredChecks(loop).before_settle  # nothing sampled in window 1
    releaser = threading.Timer(0.3, first.release)
    releaser.start()
    assert checks.close_window() is True  # window 0 passed, and window 1 had nothing left to check
    releaser.join()


def test_a_lie_in_a_window_still_being_checked_is_raised_at_the_next_checkpoint(loop: LoopThread) -> None:
    checks = DeferredChecks(loop)
    caught: list[str] = []
    checks.on_caught = lambda lie: caught.append(lie.hop.peer_id)
    lie = GatedCheck(loop, Verdict.CHECKED_FAULTY)
    schedule(checks, lie, 8)
    assert checks.close_window() is False  # window 0's check of step 8 runs on
    lie.release()
    checks.before_settle = DeferredChecks(loop).before_settle
    # Then the next checkpoint raises LieCaught: the caller keeps nothing since its last commit
    with pytest.raises(LieCaught) as raised:
        checks.close_window()
    assert raised.value.peer_id == HOP.peer_id and caught == [HOP.peer_id]


def test_a_session_end_settles_every_window(loop: LoopThread) -> None:
    checks = DeferredChecks(loop)
    first = GatedCheck(loop, Verdict.AGREE)
    schedule(checks, first, 0)
    assert checks.close_window() is False
    last = GatedCheck(loop, Verdict.AGREE)
    schedule(checks, last, 8)
    for gate in (first, last):
        threading.Timer(0.2, gate.release).start()
    checks.settle()  # the session's end: the last window's checks too
    assert first.started.is_set() and last.started.is_set()
    checks.before_settle = DeferredChecks(loop).before_settle
    assert checks.close_window() is True  # nothing was left running
