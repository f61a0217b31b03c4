"""A chain of a float32 server and a bfloat16 server: activations travel in each server's compute dtype."""
from __future__ import annotations

from pathlib import Path

import torch

from servers.block_loading import load_span
from servers.config import DType
from swarmclient.generation import generate_tokens
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.sampling import SamplingParams
from swarmclient.textgen import load_tokenizer
from swarmnet.model_spec import ModelSpec

PROMPTS = ["Hello world, this is", "The quick brown fox jumps over the lazy dog and then", "one two three", "A"]
NEW_TOKENS = 12


def local_chain(model_dir: Path) -> tuple[object, list[torch.nn.Module]]:
    """The same chain in this process: blocks 0:3 in float32, 3:6 in bfloat16, with their caches."""
    spec = ModelSpec.open(model_dir)
    spans = [load_span(spec, 0, 3, device="cpu"), load_span(spec, 3, 6, dtype=DType.bfloat16, device="cpu")]
    caches = [span.new_caches(span.start, span.end) for span in spans]

    def step(hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        for span, cache in zip(spans, caches, strict=True):
            hidden = span(hidden, mask, positions, cache)
        return hidden
    return step, spans


PROOF_BYTES = 700  # a push proof in an answer's header, at most


def test_a_float32_and_a_bfloat16_server_generate_as_the_same_chain_does_locally_with_half_the_bytes(
        tiny_model: Path, local_swarm) -> None:
    swarm = local_swarm(tiny_model, [])
    swarm.start_servers([(0, 3, ["--dtype", "float32"]), (3, 6, ["--dtype", "bfloat16"])])
    batch = load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True)
    params = [SamplingParams()] * len(PROMPTS)
    sent: list[int] = []  # hidden values each hop answers with: one per (row, token, hidden unit)
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers) as model:
        options = {"max_new_tokens": NEW_TOKENS, "params": params, "eos_token_ids": set(), "pad_token_id": 0}
        with model.inference_session(batch_size=len(PROMPTS), max_length=64) as session:

            def step(hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
                sent.append(hidden.numel())
                output = session.step(hidden, mask, positions)
                assert output.dtype == torch.bfloat16  # the last hop's compute dtype, as it came
                return output
            got = generate_tokens(model.head, step, batch.input_ids, batch.attention_mask, **options)
            received = session.received_bytes
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the servers run (--num-threads 1): the same kernels, the same rounding
        try:
            want = generate_tokens(model.head, local_chain(tiny_model)[0], batch.input_ids, batch.attention_mask,
                                   **options)
        finally:
            torch.set_num_threads(threads)
    assert got.shape == (len(PROMPTS), NEW_TOKENS) and torch.equal(got, want)
    # the float32 hop's answers carry 4 bytes a value, the bfloat16 hop's 2 (the same frames otherwise, give or take
    # a header's few bytes and alignment, and the proof the pushed-into hop returns with each answer: the pusher's
    # RSA-2048 signature and the statement it signs, swarmnet/push_proof.py): half the activation bytes
    assert set(received) == {0, 3}
    frames = len(sent) + 1  # each step's answer and the open's
    header, proof = 32 * frames, PROOF_BYTES * frames
    assert -header - proof <= (received[0] - received[3]) - 2 * sum(sent) <= header, (received, sum(sent))
    assert received[3] < 0.5 * received[0] + 200 * frames + proof
