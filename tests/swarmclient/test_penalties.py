"""Penalties, biases, top-k and min-p equal transformers' logits processors (or OpenAI's formula) on the same logits."""
from __future__ import annotations

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from swarmclient.penalties import History, Penalties, apply_penalties
from swarmclient.sampling import SamplingParams, sample_next, sample_row, sampling_probs

VOCAB = 64
PROMPT = [3, 5, 5, 9, 12]
OUTPUT = [7, 5, 7, 7, 40]  # generated so far: 7 three times, 5 once (also in the prompt), 40 once


def logits_of(seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


def history(earlier: int = len(OUTPUT)) -> History:
    return History(PROMPT + OUTPUT, earlier, VOCAB)


def test_repetition_penalty_equals_transformers_over_prompt_and_output() -> None:
    logits = logits_of(0)
    for penalty in (1.3, 0.7):
        ours = apply_penalties(logits, Penalties(repetition_penalty=penalty), history())
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([PROMPT + OUTPUT]), logits[None].clone())[0]
        assert torch.equal(ours, theirs)


def test_frequency_and_presence_penalties_follow_openais_formula_over_generated_tokens_only() -> None:
    logits = logits_of(1)
    ours = apply_penalties(logits, Penalties(frequency_penalty=0.5, presence_penalty=1.25), history())
    expected = logits.clone()
    for token in set(OUTPUT):  # mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
        expected[token] -= OUTPUT.count(token) * 0.5 + 1.25
    assert torch.allclose(ours, expected)
    assert ours[3] == logits[3] and ours[12] == logits[12]  # prompt-only tokens are not penalized


def test_logit_bias_equals_transformers_sequence_bias_for_single_tokens() -> None:
    logits = logits_of(2)
    bias = ((4, 100.0), (8, -100.0), (9, 2.5))
    ours = apply_penalties(logits, Penalties(logit_bias=bias), None)
    theirs = SequenceBiasLogitsProcessor([[[token], value] for token, value in bias])(
        torch.tensor([PROMPT]), logits[None].clone())[0]
    assert torch.allclose(ours, theirs)
    assert sample_row(logits, SamplingParams(penalties=Penalties(logit_bias=bias)), 0) == 4


@pytest.mark.parametrize("top_k, top_p, min_p", [(5, 1.0, 0.0), (1, 1.0, 0.0), (0, 1.0, 0.2), (0, 1.0, 0.9),
                                                 (10, 0.8, 0.05)])
def test_top_k_and_min_p_draw_from_transformers_distribution(top_k: int, top_p: float, min_p: float) -> None:
    logits = logits_of(3)
    params = SamplingParams(temperature=0.7, top_p=top_p, top_k=top_k, min_p=min_p)
    ours = sampling_probs(logits, params)
    scores = TemperatureLogitsWarper(0.7)(torch.tensor([PROMPT]), logits[None].clone())
    warpers = [(top_k > 0, TopKLogitsWarper), (top_p < 1, TopPLogitsWarper), (min_p > 0, MinPLogitsWarper)]
    for value, (on, warper) in zip((top_k, top_p, min_p), warpers, strict=True):
        scores = warper(value)(torch.tensor([PROMPT]), scores) if on else scores  # type: ignore[arg-type]
    theirs = torch.softmax(scores[0].double(), dim=-1)
    assert torch.equal(ours > 0, theirs > 0)
    assert torch.allclose(ours / ours.sum(), theirs, atol=1e-6)


def test_a_resumed_history_counts_the_earlier_output_as_generated_and_the_rest_as_prompt() -> None:
    # Given the same tokens seen, as one uninterrupted run (5 generated) and as a fresh one (all prompt)
    resumed, fresh = history(), history(earlier=0)
    # Then repetition sees all of them alike, and only the resumed one counts output for the frequency penalty
    assert torch.equal(resumed.seen, fresh.seen)
    assert resumed.generated[7] == 3 and resumed.generated[5] == 1 and fresh.generated.sum() == 0
    # And adding a token generated next counts it
    resumed.add(3)
    assert resumed.generated[3] == 1


def test_greedy_rows_with_penalties_take_the_argmax_of_the_penalized_logits() -> None:
    logits = torch.stack([logits_of(4), logits_of(4)])
    top = int(logits[0].argmax())
    tokens_seen = History([top], 1, VOCAB)
    params = [SamplingParams(), SamplingParams(penalties=Penalties(presence_penalty=2, frequency_penalty=2))]
    chosen = sample_next(logits, params, [0, 0], [None, tokens_seen]).tolist()
    assert chosen[0] == top and chosen[1] == int(apply_penalties(logits[1], params[1].penalties, tokens_seen).argmax())
    assert chosen[1] != top or logits[1].sort(descending=True).values[1] < logits[1][top] - 4


@pytest.mark.parametrize("kwargs, name", [({"frequency_penalty": 2.5}, "frequency_penalty"),
                                          ({"presence_penalty": -3}, "presence_penalty"),
                                          ({"repetition_penalty": 0}, "repetition_penalty"),
                                          ({"logit_bias": ((1, 101.0),)}, "logit_bias")])
def test_invalid_penalties_are_refused_naming_the_parameter(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Penalties(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs, name", [({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p")])
def test_invalid_top_k_and_min_p_are_refused_naming_the_parameter(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
