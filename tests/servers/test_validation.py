"""Step validation on its own: the finiteness check of hidden states."""
from __future__ import annotations

import pytest
import torch

from servers.errors import RequestRejected
from servers.validation import validate_step


def step(hidden: torch.Tensor) -> list[torch.Tensor]:
    return [hidden, torch.ones(1, 2, dtype=torch.long), torch.arange(2)[None]]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_non_finite_hidden_state_is_refused(bad: float, dtype: torch.dtype) -> None:
    hidden = torch.zeros(1, 2, 8, dtype=dtype)
    hidden[0, 1, 3] = bad
    with pytest.raises(RequestRejected, match="NaN or Inf"):
        validate_step(step(hidden), batch_size=1, past=0, max_length=4, hidden_size=8)


def test_the_largest_finite_values_pass_although_their_float32_sum_would_overflow() -> None:
    hidden = torch.full((1, 2, 8), torch.finfo(torch.float32).max)
    assert torch.isinf(hidden.sum())  # a float32 sum would call these states non-finite
    validated, _, _ = validate_step(step(hidden), batch_size=1, past=0, max_length=4, hidden_size=8)
    assert torch.equal(validated, hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hidden_states_in_each_compute_dtype_pass_as_they_came(dtype: torch.dtype) -> None:
    hidden = torch.randn(1, 2, 8).to(dtype)
    validated, _, _ = validate_step(step(hidden), batch_size=1, past=0, max_length=4, hidden_size=8)
    assert validated.dtype == dtype and torch.equal(validated, hidden)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.uint8])
def test_hidden_states_of_another_dtype_are_refused(dtype: torch.dtype) -> None:
    with pytest.raises(RequestRejected, match="float32/bfloat16/float16"):
        validate_step(step(torch.zeros(1, 2, 8, dtype=dtype)), batch_size=1, past=0, max_length=4, hidden_size=8)
