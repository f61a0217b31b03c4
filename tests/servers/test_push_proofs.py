"""Push proofs on the servers (issue 28, N4): a pushed step carries its pusher's signed proof, the receiving server
applies only a proven push, and a push session's answers name the digest of the input they were computed on.

Real handlers of the tiny model in this process, over socket pairs (tests/servers/in_process.py), with real RSA peer
keys; the client's messages are raw frames.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from in_process import Wires, identity, peer, read, send, serve
from test_push_bounds import CLIENT, meta, open_session, run, step, stream_ids

from servers.block_loading import load_span
from servers.span import BlockSpan
from swarmnet import protocol
from swarmnet.model_spec import ModelSpec
from swarmnet.push_proof import input_digest, proof_signer


@pytest.fixture(scope="module")
def span(tiny_model: Path) -> BlockSpan:
    return load_span(ModelSpec.open(tiny_model), 0, 6)


def test_a_pushed_steps_answer_names_the_input_it_was_computed_on_with_the_pushers_proof(span: BlockSpan) -> None:
    async def test(wires: Wires) -> None:
        # Given a client's push sessions on two servers, and a step sent to the first with the second on its route
        serve(wires, "up", span), serve(wires, "down", span)
        down = await open_session(wires, "down", 3, 6)
        up = await open_session(wires, "up", 0, 3)
        tensors = step(span, 0, 8)
        await send(up, tensors, meta(up, 0, [[peer("down"), stream_ids[down]]]))
        first, pushed = await read(up), await read(down)
        assert first is not None and pushed is not None
        # Then the first answer names the digest of what the client sent
        hidden, mask, positions = tensors
        assert first[1]["input_digest"] == input_digest(hidden, mask, positions, None, 0)
        # and the second's, the digest of the first's answer, with the first server's proof of that push
        digest = input_digest(first[0][0], mask, positions, None, 0)
        assert pushed[1]["input_digest"] == digest
        signer = proof_signer(pushed[1]["push_proof"], owner=peer(CLIENT), target_session=stream_ids[down], step_id=0,
                              digest=digest)
        assert signer is not None and (signer.peer_id, signer.upstream_session) == (peer("up"), stream_ids[up])
    run(test)


def test_a_push_without_a_proof_of_its_pusher_is_refused_and_reported_to_the_client(span: BlockSpan) -> None:
    async def test(wires: Wires) -> None:
        # Given an upstream server that signs its pushes with a key that is not its peer id's
        upstream, downstream = serve(wires, "up", span), serve(wires, "down", span)
        upstream.pusher.identity = identity("someone else")
        down = await open_session(wires, "down", 3, 6)
        up = await open_session(wires, "up", 0, 3)
        # When a step goes to it with the downstream server on its route
        await send(up, step(span, 0, 8), meta(up, 0, [[peer("down"), stream_ids[down]]]))
        answers = [await read(up), await read(up)]
        # Then the downstream server refused the push before applying it, and the client hears that the push failed
        assert answers[0] is not None and answers[0][1]["step_id"] == 0 and "error" not in answers[0][1]
        assert answers[1] is not None and answers[1][1]["push_failed"]["peer"] == peer("down")
        assert "push proof" in answers[1][1]["push_failed"]["reason"]
        assert downstream.stats.steps == 0 and downstream.sessions[stream_ids[down]].applied == 0
        # and the client's own copy of the step is applied there, its answer naming what the client sent
        tensors = step(span, 0, 8)
        tensors[0] = answers[0][0][0]
        await send(down, tensors, meta(down, 0))
        direct = await read(down)
        assert direct is not None and direct[1]["input_digest"] == input_digest(*tensors, None, 0)
        assert "push_proof" not in direct[1] and downstream.stats.steps == 1
    run(test)


def test_a_session_not_opened_for_push_answers_without_a_digest(span: BlockSpan) -> None:
    async def test(wires: Wires) -> None:
        serve(wires, "solo", span)
        stream = await wires.open(peer(CLIENT), peer("solo"), protocol.RPC_INFERENCE)
        await send(stream, [], {"open": True, "session_id": "s" * 32, "start": 0, "end": 6, "batch_size": 1,
                                "max_length": 64})
        assert (await read(stream) or ([], {}))[1].get("opened") is True
        await send(stream, step(span, 0, 4), {"session_id": "s" * 32})
        answer = await read(stream)
        assert answer is not None and answer[0][0].shape == (1, 4, 64) and "input_digest" not in answer[1]
        assert torch.isfinite(answer[0][0]).all()
    run(test)
