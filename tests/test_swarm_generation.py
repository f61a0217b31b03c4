"""Generation through real block-server processes on 127.0.0.1 equals transformers' generate."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from generation_checks import generate_killing_first_hop, reference_tokens
from tiers import process_fixture

from launch.local_swarm import LocalSwarm
from servers.span_forms import ROW_FORMS_ENV
from swarmclient.config import ClientConfig
from swarmclient.errors import MissingBlocksError
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.session import InferenceSession
from swarmclient.textgen import load_tokenizer
from swarmnet.errors import DHTUnreachable
from swarmnet.product_forms import packed_available

PROMPTS = ["Hello world, this is", "A", "The quick brown fox jumps over the lazy dog and then", "one two three"]
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                "Summarize in one sentence: The bakery on Main Street has been open for fifty years. It is famous "
                "for its sourdough bread and cinnamon rolls. The owners plan to retire next spring.",
                "List three uses of a paperclip, briefly."]


@process_fixture(scope="module")
def tiny_swarm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    """Two servers splitting the tiny model's 6 blocks at 3."""
    with LocalSwarm(tiny_model, [(0, 3), (3, 6)], log_dir=tmp_path_factory.mktemp("tiny-swarm"),
                    server_args=["--max-batch-size", "4"]) as swarm:
        yield swarm


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[2:3]], ids=["batch-4", "batch-1"])
def test_greedy_generation_through_two_servers_equals_transformers(tiny_model: Path, tiny_swarm: LocalSwarm,
                                                                   prompts: list[str]) -> None:
    """Batch 1 takes the client head's few-row path (a transposed LM head); batch 4 its nn.Linear."""
    batch = load_tokenizer(tiny_model)(prompts, return_tensors="pt", padding=True)
    expected = reference_tokens(tiny_model, batch, 32)
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=tiny_swarm.initial_peers) as model:
        got = model.generate(batch.input_ids, batch.attention_mask, max_new_tokens=32)
    assert torch.equal(got[:, batch.input_ids.shape[1]:], expected)


def test_a_prefill_sent_in_chunks_is_one_step_per_chunk_on_each_server_and_generates_transformers_tokens(
        tiny_model: Path, tiny_swarm: LocalSwarm) -> None:
    # Given 4 prompts padded to L positions, and a client whose prefill steps carry at most 8 tokens (2 positions)
    batch = load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True)
    length = batch.input_ids.shape[1]
    expected = reference_tokens(tiny_model, batch, 16)
    config = ClientConfig(prefill_chunk_tokens=8)
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=tiny_swarm.initial_peers,
                                                     config=config) as model:
        swarm = model.swarm
        peers = [server.peer_id for server in tiny_swarm.servers]

        def steps() -> list[int]:
            return [int(swarm.loop.run(swarm.call_info(peer))["steps"]) for peer in peers]  # type: ignore[call-overload]
        before = steps()
        # When it generates one token (the prefill alone), then 16
        model.generate(batch.input_ids, batch.attention_mask, max_new_tokens=1)
        after_prefill = steps()
        got = model.generate(batch.input_ids, batch.attention_mask, max_new_tokens=16)
    # Then each server computed the prefill as ceil(L / 2) steps, and the tokens are transformers' greedy ones
    assert [b - a for a, b in zip(before, after_prefill, strict=True)] == [-(-length // 2)] * 2
    assert torch.equal(got[:, length:], expected)


def test_prefill_chunk_tokens_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="prefill_chunk_tokens must be at least 1"):
        ClientConfig(prefill_chunk_tokens=0)


def test_sampling_through_the_swarm_is_reproducible_for_a_seed(tiny_model: Path, tiny_swarm: LocalSwarm) -> None:
    batch = load_tokenizer(tiny_model)(PROMPTS[:2], return_tensors="pt", padding=True)
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=tiny_swarm.initial_peers) as model:
        runs = [model.generate(batch.input_ids, batch.attention_mask, max_new_tokens=16, do_sample=True,
                               temperature=1.0, top_p=0.95, seed=seed) for seed in (5, 5, 6)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_micro_batches_run_at_once_and_give_each_row_its_tokens(tiny_model: Path, tiny_swarm: LocalSwarm) -> None:
    # Given the batch of 4 mixed-length prompts, greedy and sampled
    batch = load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True)
    expected = reference_tokens(tiny_model, batch, 32)
    config = ClientConfig(micro_batches=2)
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=tiny_swarm.initial_peers,
                                                     config=config) as model:
        opened: list[int] = []
        open_session = model.inference_session

        def counted(**kwargs: Any) -> InferenceSession:
            opened.append(kwargs["batch_size"])
            return open_session(**kwargs)
        model.inference_session = counted  # type: ignore[method-assign]
        # When it runs as 2 micro-batches (one session each, rows grouped by prompt length)
        greedy = model.generate(batch.input_ids, batch.attention_mask, max_new_tokens=32)
        params = model.sampling_params(4, True, 1.0, 0.95, 7)
        split = model.generate_new_tokens(batch.input_ids, batch.attention_mask, max_new_tokens=16, params=params)
        whole = model.generate_new_tokens(batch.input_ids, batch.attention_mask, max_new_tokens=16, params=params,
                                          micro_batches=1)
    # Then every row gets transformers' greedy tokens, and sampled rows their seeded tokens, as in one session
    assert opened == [2, 2, 2, 2, 4]
    assert torch.equal(greedy[:, batch.input_ids.shape[1]:], expected)
    assert torch.equal(split, whole)


def test_micro_batches_group_rows_of_similar_length() -> None:
    from swarmclient.model import micro_batch_rows
    mask = torch.tensor([[0, 0, 1], [1, 1, 1], [0, 1, 1], [0, 0, 1], [1, 1, 1]])
    assert [g.tolist() for g in micro_batch_rows(mask, 2)] == [[0, 3, 2], [1, 4]]
    assert [g.tolist() for g in micro_batch_rows(mask, 1)] == [[0, 1, 2, 3, 4]]
    assert [g.tolist() for g in micro_batch_rows(mask[:1], 4)] == [[0]]
    assert len(micro_batch_rows(mask, 9)) == 5  # never an empty micro-batch


@pytest.mark.slow
def test_smollm2_through_two_servers_equals_transformers(smollm2_model: Path, local_swarm) -> None:
    tokenizer = load_tokenizer(smollm2_model)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in CHAT_PROMPTS]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert len(set(batch.attention_mask.sum(1).tolist())) == 4, "prompts of different lengths"
    expected = reference_tokens(smollm2_model, batch, 32)
    alone = tokenizer(texts[2:3], return_tensors="pt", add_special_tokens=False)  # batch 1: the few-row head
    expected_alone = reference_tokens(smollm2_model, alone, 32)
    swarm = local_swarm(smollm2_model, [(0, 15), (15, 30)])
    with DistributedModelForCausalLM.from_pretrained(smollm2_model, initial_peers=swarm.initial_peers) as model:
        got = model.generate(batch.input_ids, batch.attention_mask, max_new_tokens=32)
        got_alone = model.generate(alone.input_ids, alone.attention_mask, max_new_tokens=32)
    assert torch.equal(got[:, batch.input_ids.shape[1]:], expected)
    assert torch.equal(got_alone[:, alone.input_ids.shape[1]:], expected_alone)


@pytest.mark.parametrize("table", ["1:paired,2:transposed,3:transposed,4:transposed", "*:packed"],
                         ids=["dense-forms", "packed"])
def test_servers_whose_products_take_other_forms_generate_transformers_tokens(tiny_model: Path, local_swarm,
                                                                              table: str) -> None:
    # Given two servers whose products of 1 row are paired and of 2-4 rows transposed (a CPU where those are faster),
    # or whose weights are all packed for oneDNN
    if table == "*:packed" and not packed_available():
        pytest.skip("this torch build has no oneDNN packed product")
    swarm = local_swarm(tiny_model, [])
    forms = {ROW_FORMS_ENV: table}
    servers = [swarm.start_server(start, end, env=forms) for start, end in ((0, 3), (3, 6))]
    tokenizer = load_tokenizer(tiny_model)
    batches = [tokenizer(prompts, return_tensors="pt", padding=True) for prompts in (PROMPTS[2:3], PROMPTS[:3])]
    expected = [reference_tokens(tiny_model, batch, 24) for batch in batches]
    # When a batch of 1 and a batch of 3 are generated through them
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers) as model:
        got = [model.generate(b.input_ids, b.attention_mask, max_new_tokens=24) for b in batches]
    # Then both servers took those forms, and the tokens are transformers' greedy ones
    for server in servers:
        assert "Product forms of blocks" in server.log_path.read_text()
    for batch, tokens, want in zip(batches, got, expected, strict=True):
        assert torch.equal(tokens[:, batch.input_ids.shape[1]:], want)


def test_killing_the_server_in_use_mid_generation_changes_no_token(tiny_model: Path, local_swarm) -> None:
    # Given three servers: one with all blocks, two with halves
    swarm = local_swarm(tiny_model, [(0, 6), (0, 3), (3, 6)])
    batch = load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True)
    expected = reference_tokens(tiny_model, batch, 32)
    # When the server of the first hop is killed -9 mid-generation
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers) as model:
        run = generate_killing_first_hop(model, swarm, batch, 32)
    # Then the generation completes with the same tokens, on other servers, after a short stall
    assert run.killed and torch.equal(run.tokens, expected)
    assert run.failovers >= 1
    assert all(hop.peer_id not in run.killed for hop in run.route_after)
    print(f"\nfailover stall after kill -9: {run.stall:.2f} s (normal step {run.normal_step:.3f} s)")
    assert run.stall < 5.0


def test_a_server_without_cache_room_is_routed_around(tiny_model: Path, local_swarm) -> None:
    swarm = local_swarm(tiny_model, [])
    swarm.start_servers([(0, 6, ["--attn-cache-tokens", "4"]),   # far too small for any session
                         (0, 3, []), (3, 6, [])])
    batch = load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True)
    expected = reference_tokens(tiny_model, batch, 8)
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers) as model:
        got = model.generate(batch.input_ids, batch.attention_mask, max_new_tokens=8)
    assert torch.equal(got[:, batch.input_ids.shape[1]:], expected)


def test_missing_blocks_are_named_in_one_error(tiny_model: Path, local_swarm) -> None:
    swarm = local_swarm(tiny_model, [(0, 4)])
    config = ClientConfig(max_retries=2, min_backoff=0.01)
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers,
                                                     config=config) as model:
        with pytest.raises(MissingBlocksError, match=r"blocks 4:6 .*swarmbatch serve"):
            model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)


@pytest.mark.swarm  # its client starts a p2pd
def test_an_unreachable_dht_is_one_clear_error(tiny_model: Path) -> None:
    dead_peer = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWCxbSVdL8unKt3Y4pzF1KX9GJLuq7DiGtDJwP5HhSaFRP"
    with pytest.raises(DHTUnreachable, match="swarmbatch dht"):
        DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=[dead_peer])
