"""`HeadMatmul`: the LM head's product on a CPU, in the faster of two equal forms for each small row count.

logits = x · Wᵀ is `F.linear(x, W)`, and equally `(W · xᵀ)ᵀ`: the same weight (no copy), the same sums in another
order (the two differ by float rounding, about 1e-6 relative). On a CPU, MKL's speed for each form depends on the
row count and on the CPU. Measured on an AMD EPYC VM (SmolLM2's 49152 x 576 float32 head, one thread,
bench/head_matmul.py), `F.linear` against `(W · xᵀ)ᵀ`: 1 row 7.0 vs 7.3 ms, 2 rows 15.4 vs 4.6, 3 rows 21.0 vs 5.8,
4 rows 11.9 vs 5.2, 8 rows 11.5 vs 11.6, 12 rows 16.3 vs 24.9, 64 rows 45.5 vs 46.7. So the head times both forms
the first time it sees a row count up to TUNED_ROWS (a decode step at batch 1-8, a job lane's last rows, a
micro-batch) and keeps the faster one for that count; more rows, a small head, or a GPU use `F.linear`.

Timing costs five extra head products per row count seen, once per process (0.4 s at most for SmolLM2). The other
form must be faster by MARGIN to be kept, so noise between two equal forms keeps `F.linear`.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

TUNED_ROWS = 8           # row counts up to this are timed; MKL's large-M path is good above it
TUNED_MIN_WEIGHTS = 1 << 22  # a head of fewer weights (16 MiB of float32) costs well under a millisecond: not timed
MARGIN = 0.9             # the other form is kept when it takes at most this fraction of F.linear's time
TIMING_ROUNDS = 3        # each form runs this many times on first sight of a row count; its fastest run counts

Form = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[N, H] x [V, H] -> [N, V], as nn.Linear computes it."""
    return F.linear(x, weight)


def transposed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same product as `linear`, computed as (W · xᵀ)ᵀ (MKL's path for a tall, thin product), made contiguous as
    F.linear's is (what sampling, penalties and log-softmax read row by row; the copy costs 0.1-0.4 ms at 2-6 rows)."""
    return (weight @ x.t()).t().contiguous()


FORMS: dict[str, Form] = {"linear": linear, "transposed": transposed}


class HeadMatmul:
    """`weight`'s product with [N, H] rows; times the forms of a small row count on first sight (`clock`: seconds)."""

    def __init__(self, weight: torch.Tensor, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.weight, self.clock = weight, clock
        self.tuned = weight.device.type == "cpu" and weight.numel() >= TUNED_MIN_WEIGHTS
        self.choices: dict[int, str] = {}  # row count -> the form kept for it
        self._lock = threading.Lock()      # lanes' threads may meet a new row count at once: one times it

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if not self.tuned or rows > TUNED_ROWS:
            return linear(x, self.weight)
        choice = self.choices.get(rows)
        if choice is None:
            return self._time_forms(x)
        return FORMS[choice](x, self.weight)

    def _time_forms(self, x: torch.Tensor) -> torch.Tensor:
        """Both forms on `x`, TIMING_ROUNDS times each, in turn (the first round warms the paths); keeps the form
        whose fastest run was faster for x's row count."""
        with self._lock:
            kept = self.choices.get(x.shape[0])
            if kept is not None:  # another lane's thread timed this row count while this one waited for the lock
                return FORMS[kept](x, self.weight)
            best: dict[str, float] = {}
            outputs: dict[str, torch.Tensor] = {}
            for _ in range(TIMING_ROUNDS):
                for name, form in FORMS.items():
                    start = self.clock()
                    outputs[name] = form(x, self.weight)
                    best[name] = min(best.get(name, float("inf")), self.clock() - start)
            choice = "transposed" if best["transposed"] <= MARGIN * best["linear"] else "linear"
            self.choices[x.shape[0]] = choice
        return outputs[choice]
