"""Checked outputs, the policy (no I/O): which hop steps are checked, how far two servers may differ, who lies.

A sampled hop step is recomputed on a second server that holds the hop's blocks (the stateless `forward` of the
hop's whole input history) and the two outputs of the step's tokens are compared. The measure is the relative
error of each real token's hidden state, ||a - b|| / ||b||, at its worst token: it does not depend on the
model's scale, and a token with a huge norm (SmolLM2's first token: ~22,000 against ~170) hides no other's error.

Two honest servers of one precision differ by rounding only: a decode step on a cache against a prefill of the
whole history, merged decode batches, other batch sizes. Measured on SmolLM2 (bench/verify_tolerance.py, worst
token over prefill, 24 decode steps alone and merged, whole batch and row by row): float32 2.2e-6, bfloat16
6.6e-2, int8 (bitsandbytes LLM.int8, whose outlier columns depend on the batch) 1.0e-1, nf4 0 (on a CPU). The
tolerances leave room for other machines' kernels: ~450x for float32, ~4x for bfloat16, 3x for int8. Servers of
different precisions are never compared: a float32 and an nf4 server differ by 0.41 (bfloat16: 0.11), as much as
a lie would have to, so a hop is only checked on a holder of its own precision.
"""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from swarmnet.data_structures import ServerInfo

# the largest relative error allowed between two honest servers of this precision (dtype, or quantization)
TOLERANCES: dict[str, float] = {"float32": 1e-3, "nf4": 0.1, "bfloat16": 0.25, "int8": 0.3}
LOOSEST = max(TOLERANCES.values())  # a precision this client does not know


def precision(info: ServerInfo) -> str:
    """What bounds a server's rounding: its quantization, or else its dtype."""
    return info.quant if info.quant != "none" else info.dtype


def comparable(first: ServerInfo, second: ServerInfo) -> bool:
    """Whether one server can check the other: same precision (and so the same rounding, up to kernels)."""
    return (first.dtype, first.quant) == (second.dtype, second.quant)


def tolerance(first: ServerInfo, second: ServerInfo) -> float:
    """The largest relative error allowed between two servers' outputs (the looser precision decides)."""
    return max(TOLERANCES.get(precision(first), LOOSEST), TOLERANCES.get(precision(second), LOOSEST))


def _unit(*parts: object) -> float:
    """A uniform number in [0, 1) that only depends on `parts` (reproducible across processes and runs)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def sampled(fraction: float, key: str, step: int, hop_start: int) -> bool:
    """Whether step `step` of the session `key` is checked on the hop starting at block `hop_start`."""
    return fraction >= 1.0 or (fraction > 0.0 and _unit(key, step, hop_start) < fraction)


def sampled_row(fraction: float, key: str, window: int, row: int, hop_start: int) -> bool:
    """Whether row `row` of the session `key` is checked on the hop starting at `hop_start` over window `window` (the
    steps between two checkpoints of a job's lane: deferred_checks.py)."""
    return fraction >= 1.0 or (fraction > 0.0 and _unit(key, "window", window, row, hop_start) < fraction)


def verifier_order(peers: Iterable[str], key: str, step: int, hop_start: int) -> list[str]:
    """The holders to ask, in an order that changes with every step: each holder gets to check (and be checked)."""
    return sorted(peers, key=lambda peer: _unit(key, step, hop_start, peer))


def relative_error(got: torch.Tensor, want: torch.Tensor, real: torch.Tensor) -> float:
    """The worst ||got - want|| / ||want|| over the real tokens (`real`: [B, T] mask) of [B, T, H] hidden states."""
    got, want = got.float(), want.float()
    errors = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)
    errors = errors.masked_fill(real == 0, 0.0)
    error = float(errors.max()) if errors.numel() else 0.0
    return error if error == error else float("inf")  # a NaN is no match


def max_difference(got: torch.Tensor, want: torch.Tensor, real: torch.Tensor) -> float:
    """The largest absolute difference of one value over the real tokens (for the log line)."""
    diff = (got.float() - want.float()).abs().amax(dim=-1).masked_fill(real == 0, 0.0)
    return float(diff.max()) if diff.numel() else 0.0


class Verdict(Enum):
    """What a check concluded about the server whose step it checked."""

    AGREE = "agree"                      # the second server agrees: the step's output stands
    CHECKED_FAULTY = "checked_faulty"    # the checked server is the odd one out (or nobody can tell): ban it
    SECOND_FAULTY = "second_faulty"      # a third server sides with the checked one: the second lied, ban it


def judge(second_agrees: bool, third_agrees_checked: bool | None) -> Verdict:
    """The majority rule. `third_agrees_checked` is None when no third holder answered.

    Without a third holder the checked server is treated as faulty (its output is not used). With one, the
    checked server stands only if the third agrees with it (two against one); otherwise it goes.
    """
    if second_agrees:
        return Verdict.AGREE
    return Verdict.SECOND_FAULTY if third_agrees_checked else Verdict.CHECKED_FAULTY


def stack_history(parts: Sequence[tuple[torch.Tensor, torch.Tensor, tuple[int, ...] | None]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A hop's whole input so far from its steps' (hidden [b,T,H], positions [b,T], keep_rows), in order.

    keep_rows drops rows of everything before it (the rows that left the session); returns the hidden
    states [B, L, H] and position ids [B, L] of the rows still in the session.
    """
    hidden: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    for step_hidden, step_positions, keep_rows in parts:
        if keep_rows is not None and hidden:
            rows = torch.tensor(keep_rows, dtype=torch.long)
            hidden, positions = [h[rows] for h in hidden], [p[rows] for p in positions]
        hidden.append(step_hidden)
        positions.append(step_positions)
    return torch.cat(hidden, dim=1), torch.cat(positions, dim=1)


@dataclass(frozen=True)
class VerificationCounts:
    """Hop steps checked on a second server, those whose outputs differed, and those nobody could check."""

    verified: int = 0
    mismatches: int = 0
    unverified: int = 0
    warm: int = 0  # of the verified, those whose second holder answered a warm check (warm_checks.py)

    def __sub__(self, other: VerificationCounts) -> VerificationCounts:
        return VerificationCounts(self.verified - other.verified, self.mismatches - other.mismatches,
                                  self.unverified - other.unverified, self.warm - other.warm)

    def __bool__(self) -> bool:
        return bool(self.verified or self.mismatches or self.unverified)


@dataclass
class VerificationTally:
    """Counts shared by the sessions of one job's batch (lanes run in threads)."""

    _counts: VerificationCounts = VerificationCounts()
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, *, verified: int = 0, mismatches: int = 0, unverified: int = 0, warm: int = 0) -> None:
        """Count checks."""
        with self._lock:
            c = self._counts
            self._counts = VerificationCounts(c.verified + verified, c.mismatches + mismatches,
                                              c.unverified + unverified, c.warm + warm)

    def snapshot(self) -> VerificationCounts:
        """The counts so far."""
        with self._lock:
            return self._counts
