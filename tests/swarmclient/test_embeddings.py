"""Embeddings through the swarm (one stateless forward through real block servers, pooling here) equal local
transformers' base model with the same pooling, written out by hand below."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from launch.local_swarm import LocalSwarm
from servers.faults import FAULT_INJECTION_ENV
from servers.throughput import TEST_OVERSTATE_ENV
from swarmclient import DistributedModelForCausalLM
from swarmclient.config import ClientConfig
from swarmclient.pooling import Pooling, PoolingMode, finish, read_pooling
from swarmclient.verification_policy import VerificationTally

# noise on every output, and a claimed throughput that draws routes to it
LIAR = {FAULT_INJECTION_ENV: "noise:0.1", TEST_OVERSTATE_ENV: "10000"}
TEXTS = ["The city council voted", "Once upon a time there was a library in an old train station",
         "Rain", "Markets rose on Monday after the central bank said it would keep rates unchanged"]


def reference(model_dir: Path, text: str, mode: PoolingMode) -> torch.Tensor:
    """transformers' base model on one unpadded text, pooled as sentence-transformers pools, normalized."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(text).input_ids])
    with torch.no_grad():
        states = model(input_ids=ids).last_hidden_state[0]
    pooled = {PoolingMode.mean: states.mean(0), PoolingMode.cls: states[0], PoolingMode.lasttoken: states[-1]}[mode]
    return torch.nn.functional.normalize(pooled, dim=-1)


def padded(model_dir: Path, texts: list[str], pad_id: int, *, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [tokenizer(text).input_ids for text in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span], mask[i, span] = torch.tensor(row), 1
    return ids, mask


@pytest.mark.parametrize("left", [True, False], ids=["left-padded", "right-padded"])
def test_swarm_embeddings_equal_local_transformers_within_1e_4_cosine_for_every_pooling(
        embedding_swarm: LocalSwarm, embedding_model: Path, left: bool) -> None:
    # Given the embedding model served by two servers, and a padded batch of texts of different lengths
    with DistributedModelForCausalLM.from_pretrained(embedding_model, initial_peers=embedding_swarm.initial_peers) \
            as model:
        ids, mask = padded(embedding_model, TEXTS, model.pad_token_id, left=left)
        for mode in PoolingMode:
            # When the batch is encoded through the swarm with each pooling
            vectors = finish(model.encode(ids, mask, mode=mode), Pooling(mode))
            # Then every row is transformers' own embedding of that text alone
            for text, vector in zip(TEXTS, vectors, strict=True):
                expected = reference(embedding_model, text, mode)
                assert torch.nn.functional.cosine_similarity(vector, expected, dim=0) > 1 - 1e-4, (mode, text)
                assert torch.allclose(vector, expected, atol=1e-4), (mode, text)


def test_the_models_own_pooling_comes_from_its_sentence_transformers_files(embedding_model: Path,
                                                                           tiny_model: Path) -> None:
    from swarmnet.model_spec import ModelSpec

    declared = read_pooling(embedding_model, ModelSpec.open(embedding_model).config)
    assert (declared.mode, declared.normalize, declared.matryoshka) == (PoolingMode.mean, True, (16, 32))
    plain = read_pooling(tiny_model, ModelSpec.open(tiny_model).config)
    assert (plain.mode, plain.normalize, plain.matryoshka, plain.source) == (PoolingMode.lasttoken, True, None,
                                                                             "default")


def test_a_lying_server_corrupts_unchecked_embeddings_and_checked_hops_catch_it(
        embedding_model: Path, local_swarm: Callable[..., LocalSwarm]) -> None:
    # Given a swarm where a lying server (noise on every output) is the only holder of blocks 0:3
    swarm = local_swarm(embedding_model, [])
    liar = swarm.start_server(0, 3, env=LIAR)
    swarm.start_server(3, 6)
    expected = torch.stack([reference(embedding_model, text, PoolingMode.mean) for text in TEXTS])

    def client(fraction: float) -> DistributedModelForCausalLM:
        return DistributedModelForCausalLM.from_pretrained(embedding_model, initial_peers=swarm.initial_peers,
                                                           config=ClientConfig(verify_fraction=fraction))

    def encode(model: DistributedModelForCausalLM, tally: VerificationTally) -> torch.Tensor:
        ids, mask = padded(embedding_model, TEXTS, model.pad_token_id, left=True)
        return finish(model.encode(ids, mask, verification=tally), model.pooling)

    # When embedding without checks, the vectors are wrong
    with client(0.0) as model:
        tally = VerificationTally()
        assert not torch.allclose(encode(model, tally), expected, atol=1e-3) and not tally.snapshot()
    # When two honest holders of 0:3 join and every hop is checked
    swarm.start_servers([(0, 3, ()), (0, 3, ())])
    tally = VerificationTally()
    with client(1.0) as model:
        # the liar is caught as the hop's server if routing picks it, or as the checker a check picks (each forward
        # draws which holder checks: the liar, a coin's toss); every batch's vectors are transformers' own
        for _ in range(12):
            assert torch.allclose(encode(model, tally), expected, atol=1e-4)
            if model.swarm.bans.banned_for_good(liar.peer_id):
                break
        # Then it is banned for good, after one mismatch, with the 0:3 hops checked and the 3:6 ones uncheckable
        assert model.swarm.bans.banned_for_good(liar.peer_id)
        assert not any(model.swarm.bans.banned_for_good(s.peer_id) for s in swarm.servers if s is not liar)
    counts = tally.snapshot()
    assert counts.mismatches == 1 and counts.verified >= 1 and counts.unverified >= 1
