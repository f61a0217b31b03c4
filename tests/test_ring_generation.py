"""The ring through real server processes on 127.0.0.1 (servers/ring.py, ClientConfig.ring): a greedy generation whose
last server holds the head (--ring) gets its next steps guessed there and applied by the first server before the
client sends them, with transformers' tokens; a step of the client that is not the guess is caught by the push audit
and replayed to new sessions, without the ring, changing no output."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from generation_checks import reference_tokens
from test_swarm_generation import PROMPTS
from tiers import process_fixture

from launch.local_swarm import LocalSwarm
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.textgen import load_tokenizer


@process_fixture(scope="module")
def ring_swarm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    """Two servers splitting the tiny model's 6 blocks at 3; the last one holds the head for the ring."""
    with LocalSwarm(tiny_model, [(0, 3), (3, 6)], log_dir=tmp_path_factory.mktemp("ring-swarm"),
                    server_args=["--ring"]) as swarm:
        yield swarm


@process_fixture(scope="module")
def model(tiny_model: Path, ring_swarm: LocalSwarm) -> Iterator[DistributedModelForCausalLM]:
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=ring_swarm.initial_peers) as model:
        yield model


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[2:3]], ids=["batch-4", "batch-1"])
def test_greedy_generation_through_a_ring_equals_transformers(tiny_model: Path, model: DistributedModelForCausalLM,
                                                              prompts: list[str]) -> None:
    batch = load_tokenizer(tiny_model)(prompts, return_tensors="pt", padding=True)
    got = model.generate(batch.input_ids, batch.attention_mask, max_new_tokens=32)
    assert torch.equal(got[:, batch.input_ids.shape[1]:], reference_tokens(tiny_model, batch, 32))


def decode(model: DistributedModelForCausalLM, batch: dict, steps: int, *, ring: bool, pause: float = 0.0,
           other_token_at: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int], int]:
    """A greedy decode driven step by step: (tokens, every step's output, the guessed steps before each step, the
    session's failovers). The client pauses before each step; at step `other_token_at` it feeds another token."""
    ids, mask = batch["input_ids"], batch["attention_mask"].long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    tokens, outputs, guessed = [], [], []
    with model.inference_session(batch_size=ids.shape[0], max_length=ids.shape[1] + steps, ring=ring) as session:
        hidden = session.step(model.head.embed(ids), mask, positions)
        outputs.append(hidden)
        for step_id in range(1, steps):
            token = model.head.logits(hidden[:, -1:, :])[:, -1, :].argmax(-1)
            if step_id == other_token_at:
                token = (token + 1) % model.spec.config.vocab_size
            tokens.append(token)
            mask, positions = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1), positions[:, -1:] + 1
            time.sleep(pause)
            guessed.append(session.guessed_steps)
            hidden = session.step(model.head.embed(token[:, None]), mask, positions)
            outputs.append(hidden)
        return tokens, outputs, guessed, session.failovers


def test_guesses_are_applied_once_confirmed_and_a_step_other_than_the_guess_replays_without_the_ring(
        tiny_model: Path, model: DistributedModelForCausalLM) -> None:
    batch = load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True)
    # Given a client that pauses before each step (so each guess lands first) and feeds another token at step 8
    tokens, outputs, guessed, failovers = decode(model, batch, 12, ring=True, pause=0.15, other_token_at=8)
    # Then the decode steps before it were guessed every other step, from the second on (none follows a prompt): a
    # guess waits for the client's copy of the step before
    assert guessed[7] == 3  # steps 2, 4 and 6; the guesses of 3, 5 and 7 came before the client's 2, 4 and 6
    # and the guess of step 8 was caught (the first server answered the guessed input): the session replayed its
    # steps to new sessions, without the ring from then on
    assert failovers >= 1 and guessed[-1] == 0
    # and nothing differs from a session without the ring fed the same tokens
    expected_tokens, expected_outputs, _, plain_failovers = decode(model, batch, 12, ring=False, other_token_at=8)
    assert plain_failovers == 0 and all(torch.equal(a, b) for a, b in zip(tokens, expected_tokens, strict=True))
    for got, expected in zip(outputs, expected_outputs, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
