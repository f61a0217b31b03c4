"""Sampling: greedy is argmax; sampled tokens depend only on (seed, position), not on batch neighbours."""
from __future__ import annotations

import pytest
import torch

from swarmclient.generation import step_logprobs
from swarmclient.sampling import SamplingParams, sample_next, sample_row, top_p_filter


def test_greedy_picks_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    assert sample_next(logits, [SamplingParams()] * 2, [0, 0]).tolist() == [1, 0]


def test_a_sampled_token_is_the_same_for_the_same_seed_and_position() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=7)
    assert len({sample_row(logits, params, 42) for _ in range(5)}) == 1


def test_different_positions_draw_different_tokens() -> None:
    logits = torch.zeros(1000)  # uniform: every draw is the generator's choice
    params = SamplingParams(temperature=1.0, seed=7)
    assert len({sample_row(logits, params, position) for position in range(20)}) > 10


def test_a_row_samples_the_same_whatever_its_batch_neighbours() -> None:
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in (1, 2, 3)]
    together = sample_next(logits, params, [10, 11, 12]).tolist()
    alone = [sample_row(logits[i], params[i], 10 + i) for i in range(3)]
    assert together == alone


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert top_p_filter(probs, 0.7).tolist() == pytest.approx([0.5, 0.3, 0.0, 0.0])
    assert top_p_filter(probs, 0.1).tolist() == pytest.approx([0.5, 0.0, 0.0, 0.0])


def test_invalid_sampling_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_step_logprobs_are_the_models_log_softmax_for_the_session_rows_only() -> None:
    # Given a batch of 3 whose row 1 has left the session, and the logits of rows 0 and 2
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    sampled = torch.tensor([1, 2])
    # When the step's logprobs are taken with the 2 most likely tokens
    got = step_logprobs(logits, sampled, torch.tensor([0, 2]), batch=3, k=2)
    # Then each session row has its chosen token's log-probability and its top 2, and row 1 reads zeros
    expected = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(got.chosen, torch.tensor([expected[0, 1], 0.0, expected[1, 2]]))
    assert got.top_ids.tolist() == [[0, 1], [0, 0], [2, 3]]
    assert torch.allclose(got.top_values[2], expected[1, [2, 3]]) and got.top_values[1].tolist() == [0.0, 0.0]
    assert step_logprobs(logits, sampled, torch.tensor([0, 2]), batch=3, k=0).top_ids.shape == (3, 0)
