"""`HeadMatmul`: the LM head's product on a CPU, in the fastest of equal forms for each small row count.

The forms and how one is kept are product_forms.py's. The head times them the first time it sees a row count up to
TUNED_ROWS (a decode step at batch 1-8, a job lane's last rows, a micro-batch), on that call's own rows: its weight
(113 MB for SmolLM2) streams from memory on every call, as it does in use. More rows, a small head, or a GPU use
`F.linear`. SmolLM2's 49152 x 576 float32 head, one thread, on an AMD EPYC VM (bench/head_matmul.py): 2 rows took
15.4 ms as F.linear and 4.6 transposed, 4 rows 11.9 vs 5.2, 8 rows 11.5 vs 11.6; on another (session 28's probe),
1 row 10.9 ms as F.linear and 5.9 paired.

Where the process may run on more than one core, a third form is timed: `split`, the product cut into one slice of
the vocabulary per core (at most MAX_SPLIT), each slice's F.linear on its own thread. One thread's matrix-vector
product streams the weight at about 14 GB/s on these VMs, two at once at about twice that (session 32's probe: 1 row
of SmolLM2's head 7.9 ms as F.linear, 5.0 ms split in two). At batch 1 the client's head runs while the servers wait
for its token, so the other cores are idle; where they are busy (a worker beside its servers), the split only takes
what the timing found faster, on the cores as they were then.

Timing costs a few extra head products per row count seen, once per process (0.4 s at most for SmolLM2). Another
form must be faster by MARGIN to be kept, so noise between equal forms keeps `F.linear`.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from swarmnet.product_forms import FORMS, TUNED_ROWS, FormTable, candidates, fastest, linear

TUNED_MIN_WEIGHTS = 1 << 22  # a head of fewer weights (16 MiB of float32) costs well under a millisecond: not timed
SPLIT = "split"              # the product cut into a slice of the vocabulary per core, each on its own thread
MAX_SPLIT = 4                # slices at most: each thread's stream of memory adds less past a few


def usable_cores() -> int:
    """How many cores this process may run on (its affinity where the OS says, else the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class SplitProduct:
    """x · Wᵀ with W's rows cut into `parts` slices: the first slice's product on the caller's thread, the others' on
    a pool's threads at the same time, joined in order (each output column is the same dot product as F.linear's)."""

    def __init__(self, weight: torch.Tensor, parts: int) -> None:
        self.slices = weight.chunk(parts)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        pool = self._threads()
        others = [pool.submit(self._slice, x, part) for part in self.slices[1:]]
        return torch.cat([F.linear(x, self.slices[0]), *(future.result() for future in others)], dim=1)

    def _threads(self) -> ThreadPoolExecutor:
        """The pool, started on first use in this process: a process forked after a product (a prefork worker) has
        none of its parent's threads, and a pool it inherited would queue work that no thread runs."""
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(len(self.slices) - 1, thread_name_prefix="head-split")
            self._pool_pid = os.getpid()
        return self._pool

    @staticmethod
    def _slice(x: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():  # thread-local: the pool's threads do not inherit the caller's mode
            return F.linear(x, part)


class HeadMatmul:
    """`weight`'s product with [N, H] rows; times the forms of a small row count on first sight (`clock`: seconds)."""

    def __init__(self, weight: torch.Tensor, *, clock: Callable[[], float] = time.perf_counter,
                 cores: int | None = None) -> None:
        self.weight, self.clock = weight, clock
        self.tuned = weight.device.type == "cpu" and weight.numel() >= TUNED_MIN_WEIGHTS
        self.table = FormTable()           # row count -> the form kept for it
        self._lock = threading.Lock()      # lanes' threads may meet a new row count at once: one times it
        parts = min(usable_cores() if cores is None else cores, MAX_SPLIT)
        self.split = SplitProduct(weight, parts) if self.tuned and parts > 1 else None

    @property
    def choices(self) -> dict[int, str]:
        return self.table.choices

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if not self.tuned or rows > TUNED_ROWS:
            return linear(x, self.weight)
        choice = self.choices.get(rows)
        if choice is None:
            return self._time_forms(x)
        return self._product(choice, x)

    def _product(self, form: str, x: torch.Tensor) -> torch.Tensor:
        if form == SPLIT and self.split is not None:
            return self.split(x)
        return FORMS[form](x, self.weight)

    def _candidates(self, rows: int) -> tuple[str, ...]:
        return candidates(rows) + ((SPLIT,) if self.split is not None else ())

    def _time_forms(self, x: torch.Tensor) -> torch.Tensor:
        """The forms for x's row count on `x`, timed in turn (product_forms.fastest); keeps the fastest."""
        with self._lock:
            kept = self.choices.get(x.shape[0])
            if kept is not None:  # another lane's thread timed this row count while this one waited for the lock
                return self._product(kept, x)
            choice, output = fastest(lambda name: self._product(name, x), self._candidates(x.shape[0]), self.clock)
            self.choices[x.shape[0]] = choice
        return output
