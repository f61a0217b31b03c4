"""What the micro-benchmarks share: the median time of one call."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_call_seconds(fn: Callable[[], object], *, reps: int, loops: int = 1) -> float:
    """The median over `reps` of the mean time of one call of `fn` over `loops` calls, in seconds."""
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        for _ in range(loops):
            fn()
        times.append((time.perf_counter() - began) / loops)
    return statistics.median(times)
