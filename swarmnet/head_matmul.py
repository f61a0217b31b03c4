"""`HeadMatmul`: the LM head's product on a CPU, in the fastest of equal forms for each small row count.

The forms and how one is kept are product_forms.py's. The head times them the first time it sees a row count up to
TUNED_ROWS (a decode step at batch 1-8, a job lane's last rows, a micro-batch), on that call's own rows: its weight
(113 MB for SmolLM2) streams from memory on every call, as it does in use. More rows, a small head, or a GPU use
`F.linear`. SmolLM2's 49152 x 576 float32 head, one thread, on an AMD EPYC VM (bench/head_matmul.py): 2 rows took
15.4 ms as F.linear and 4.6 transposed, 4 rows 11.9 vs 5.2, 8 rows 11.5 vs 11.6; on another (session 28's probe),
1 row 10.9 ms as F.linear and 5.9 paired.

Timing costs five extra head products per row count seen, once per process (0.4 s at most for SmolLM2). Another
form must be faster by MARGIN to be kept, so noise between equal forms keeps `F.linear`.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from swarmnet.product_forms import FORMS, TUNED_ROWS, FormTable, candidates, fastest, linear

TUNED_MIN_WEIGHTS = 1 << 22  # a head of fewer weights (16 MiB of float32) costs well under a millisecond: not timed


class HeadMatmul:
    """`weight`'s product with [N, H] rows; times the forms of a small row count on first sight (`clock`: seconds)."""

    def __init__(self, weight: torch.Tensor, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.weight, self.clock = weight, clock
        self.tuned = weight.device.type == "cpu" and weight.numel() >= TUNED_MIN_WEIGHTS
        self.table = FormTable()           # row count -> the form kept for it
        self._lock = threading.Lock()      # lanes' threads may meet a new row count at once: one times it

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
        return FORMS[choice](x, self.weight)

    def _time_forms(self, x: torch.Tensor) -> torch.Tensor:
        """The forms for x's row count on `x`, timed in turn (product_forms.fastest); keeps the fastest."""
        with self._lock:
            kept = self.choices.get(x.shape[0])
            if kept is not None:  # another lane's thread timed this row count while this one waited for the lock
                return FORMS[kept](x, self.weight)
            choice, output = fastest(lambda name: FORMS[name](x, self.weight), candidates(x.shape[0]), self.clock)
            self.choices[x.shape[0]] = choice
        return output
