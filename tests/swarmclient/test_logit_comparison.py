"""compare_logits (swarmclient/logit_check.py) on logits made here: the tolerance set from the yardstick, the top-1
rule (a flip where the reference's margin is more than twice the per-logit tolerance fails, a near-tie's flip does
not), and a NaN is never within tolerance. Through real servers: tests/test_logit_check.py."""
from __future__ import annotations

import torch

from swarmclient.logit_check import YARDSTICK_MULTIPLE, TeacherForced, compare_logits

VOCAB, PROMPT, NEW = 10_000, 3, 2


def forced(logits: torch.Tensor, float32: torch.Tensor | None = None) -> TeacherForced:
    """One row: PROMPT prompt tokens (the first a pad), NEW continuation tokens."""
    mask = torch.ones(1, PROMPT + NEW, dtype=torch.long)
    mask[0, 0] = 0
    return TeacherForced(torch.zeros(1, PROMPT + NEW, dtype=torch.long), mask, PROMPT,
                         torch.bfloat16 if float32 is not None else torch.float32, logits, float32)


def reference() -> torch.Tensor:
    """Random logits; at position 3 (decode step 1) a clear top-1 (10 over 8), at position 4 a near-tie."""
    logits = torch.randn(1, PROMPT + NEW, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[0, 3, :2] = torch.tensor([10.0, 8.0])
    logits[0, 4, :2] = torch.tensor([5.0, 4.999])
    return logits


def test_the_tolerance_is_the_yardstick_multiple_and_the_swarm_is_judged_on_real_positions_only() -> None:
    want = reference()
    float32 = want + 0.01 * torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    got = want.clone()
    got[0, 0] = float("nan")  # the pad position: never compared
    got[0, 1:] += 0.015 * torch.randn(got[0, 1:].shape, generator=torch.Generator().manual_seed(2))
    result = compare_logits(got, forced(want, float32))
    assert result.yardstick is not None and 0.009 < result.yardstick < 0.011
    assert result.tolerance == YARDSTICK_MULTIPLE * result.yardstick
    assert result.ok and [s.step for s in result.steps] == [0, 1, 2] and 0.014 < result.relative < 0.017
    got[0, 1:] += 0.03 * torch.randn(got[0, 1:].shape, generator=torch.Generator().manual_seed(3))
    assert not compare_logits(got, forced(want, float32)).ok  # ~3.4x the yardstick


def test_a_top1_flip_fails_where_the_margin_decides_it_and_not_at_a_near_tie() -> None:
    want = reference()
    near_tie = want.clone()
    near_tie[0, 4, 1] = 5.001  # flipped, well within the per-logit tolerance
    result = compare_logits(near_tie, forced(want), tolerance=0.05)
    assert result.ok and result.steps[2].top1_checked == 0
    flipped = want.clone()
    flipped[0, 3, 1] = 10.5  # flipped, relative error 2.5 / ~100 = 0.025: under the limit, but the margin was 2
    result = compare_logits(flipped, forced(want), tolerance=0.05)
    assert result.relative < result.tolerance and not result.ok
    assert (result.steps[1].top1_checked, result.steps[1].top1_agreed) == (1, 0)


def test_nan_logits_are_outside_any_tolerance() -> None:
    want = reference()
    got = want.clone()
    got[0, 4, 7] = float("nan")
    assert not compare_logits(got, forced(want), tolerance=1.0).ok
