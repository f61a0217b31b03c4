"""Every family added beyond Llama/Mistral/Qwen2 generates, through two real servers, what transformers generates.

Mixtral, the mixture of experts, also survives a server killed mid-generation and merges concurrent sessions.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from generation_checks import generate_killing_first_hop, reference_tokens
from test_swarm_generation import PROMPTS

from modelprep import write_tiny_model
from servers.block_loading import load_span
from swarmclient.generation import prefill_positions
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.textgen import load_tokenizer
from swarmclient.verification_policy import TOLERANCES, relative_error
from swarmnet.model_spec import ModelSpec

NEW_FAMILIES = ["gemma2", "gemma3_text", "phi3", "qwen3", "mixtral", "falcon"]
MakeModel = Callable[[str], Path]


@pytest.fixture(scope="module")
def family_model(tmp_path_factory: pytest.TempPathFactory) -> MakeModel:
    """A tiny random 4-layer model of a family (model_type), written once per module."""
    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            made[arch] = write_tiny_model(tmp_path_factory.mktemp("families") / arch, layers=4, arch=arch, seed=3)
        return made[arch]
    return make


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3_text", "falcon"])
def test_a_history_without_its_leading_padding_gives_the_same_outputs_sliding_windows_included(
        arch: str, family_model: MakeModel) -> None:
    # What a check sends (hop_verifier.unpadded_start): a row's history without the pad columns before its prompt.
    # Given a left-padded batch whose rows are longer than the tiny Gemmas' sliding window (8 tokens)
    spec = ModelSpec.open(family_model(arch))
    span = load_span(spec, 0, 4)
    torch.manual_seed(0)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :6] = 0
    hidden, positions = torch.randn(2, 20, spec.config.hidden_size), prefill_positions(mask)
    padded = span.forward(hidden, mask, positions)
    # When row 1 runs alone without its 6 pad columns
    alone = span.forward(hidden[1:, 6:], mask[1:, 6:], positions[1:, 6:])
    # Then its outputs are those of the padded batch up to float32 rounding, far inside what a check allows
    assert relative_error(alone, padded[1:, 6:], mask[1:, 6:]) <= 1e-5 < TOLERANCES["float32"]


@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_greedy_generation_of_each_family_through_two_servers_equals_transformers(
        arch: str, family_model: MakeModel, local_swarm) -> None:
    model_dir = family_model(arch)
    batch = load_tokenizer(model_dir)(PROMPTS, return_tensors="pt", padding=True)
    expected = reference_tokens(model_dir, batch, 24)
    swarm = local_swarm(model_dir, [(0, 2), (2, 4)])
    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers) as model:
        got = model.generate(batch.input_ids, batch.attention_mask, max_new_tokens=24)
    assert torch.equal(got[:, batch.input_ids.shape[1]:], expected)


def test_a_mixtral_server_killed_mid_generation_changes_no_token(family_model: MakeModel, local_swarm) -> None:
    # Given a tiny Mixtral on three servers: one with all blocks, two with halves
    model_dir = family_model("mixtral")
    swarm = local_swarm(model_dir, [(0, 4), (0, 2), (2, 4)])
    batch = load_tokenizer(model_dir)(PROMPTS, return_tensors="pt", padding=True)
    expected = reference_tokens(model_dir, batch, 32)
    # When the server of the first hop is killed -9 mid-generation
    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers) as model:
        run = generate_killing_first_hop(model, swarm, batch, 32)
    # Then the generation completes with the same tokens, on other servers
    assert run.killed and torch.equal(run.tokens, expected)
    assert run.failovers >= 1 and all(hop.peer_id not in run.killed for hop in run.route_after)
    print(f"\nmixtral failover stall after kill -9: {run.stall:.2f} s (normal step {run.normal_step:.3f} s)")


def test_concurrent_mixtral_sessions_merged_by_the_servers_give_the_tokens_of_each_alone(
        family_model: MakeModel, local_swarm) -> None:
    # Given two servers that wait up to 200 ms to merge decode steps, and two clients with their own prompts
    model_dir = family_model("mixtral")
    swarm = local_swarm(model_dir, [(0, 2), (2, 4)], server_args=["--batch-wait-ms", "200", "--max-batch-size", "8"])
    tokenizer = load_tokenizer(model_dir)
    batches = [tokenizer(prompts, return_tensors="pt", padding=True) for prompts in (PROMPTS[:2], PROMPTS[2:])]
    expected = [reference_tokens(model_dir, batch, 16) for batch in batches]
    models = [DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers)
              for _ in batches]
    try:
        # When both generate at the same time
        with ThreadPoolExecutor(len(models)) as pool:
            got = list(pool.map(lambda model, batch: model.generate(batch.input_ids, batch.attention_mask,
                                                                    max_new_tokens=16), models, batches))
        infos = [models[0].swarm.loop.run(models[0].swarm.call_info(server.peer_id)) for server in swarm.servers]
    finally:
        for model in models:
            model.close()
    # Then the servers ran their decode steps merged, and each client got what it gets alone
    assert all(info["merged_steps"] >= 1 and info["max_merged"] == 2 for info in infos), infos
    for batch, tokens, reference in zip(batches, got, expected, strict=True):
        assert torch.equal(tokens[:, batch.input_ids.shape[1]:], reference)
