"""`LoopWatch`: how long an event loop was kept from its other work, measured on the loop itself.

A ticker task sleeps `tick` seconds at a time; between two ticks, whatever else ran on the loop ran in one piece.
Per gap it records the CPU time the loop's thread spent (`time.thread_time`, which a busy machine descheduling the
thread does not inflate) and the wall time. The longest CPU gap is the longest the loop was busy with one thing,
e.g. decoding one answer.
"""
from __future__ import annotations

import asyncio
import gc
import time
from concurrent.futures import Future
from types import TracebackType


class LoopWatch:
    """`with LoopWatch(loop):` ticks on `loop` (an asyncio loop running in another thread) for the block's duration."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tick: float = 0.002) -> None:
        self.loop, self.tick = loop, tick
        self.cpu: list[float] = []   # per gap: seconds of the loop thread's CPU
        self.wall: list[float] = []  # per gap: seconds of wall time
        self._running = False
        self._task: Future[None] | None = None

    async def _run(self) -> None:
        cpu, wall = time.thread_time(), time.perf_counter()
        while self._running:
            await asyncio.sleep(self.tick)
            now_cpu, now_wall = time.thread_time(), time.perf_counter()
            self.cpu.append(now_cpu - cpu)
            self.wall.append(now_wall - wall)
            cpu, wall = now_cpu, now_wall

    def __enter__(self) -> LoopWatch:
        gc.collect()  # a collection of the test process's garbage (torch's, ...) is not what is measured
        gc.disable()
        self._running = True
        self._task = asyncio.run_coroutine_threadsafe(self._run(), self.loop)
        time.sleep(self.tick * 5)  # the first ticks have run: the block is watched from its start
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._running = False
        gc.enable()
        assert self._task is not None
        self._task.result(timeout=30)

    @property
    def longest_cpu(self) -> float:
        """The most CPU the loop's thread spent between two ticks (seconds)."""
        return max(self.cpu, default=0.0)
