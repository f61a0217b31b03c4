"""The ring on the servers (servers/ring.py): a last server that holds the head guesses a greedy session's next step
and pushes it to the first server, which applies it only once the client's copy of the step before came, and only
from the session's own last server; the client's copy of a guessed step confirms it in a few bytes, or ends the ring.

Real handlers of the tiny model in this process, over socket pairs (tests/servers/in_process.py), with real RSA peer
keys; the client's messages are raw frames. The guessed input is checked against transformers' own head.
"""
from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from in_process import Streams, Wires, identity, nothing_within, peer, read, run, send, serve
from transformers import AutoModelForCausalLM

from servers.block_loading import load_span
from servers.handler import BlockHandler
from servers.ring import RingGuesser
from servers.span import BlockSpan
from swarmnet import protocol
from swarmnet.model_spec import ModelSpec
from swarmnet.push_proof import input_digest, sign_push

CLIENT = "client"


@pytest.fixture(scope="module")
def span(tiny_model: Path) -> BlockSpan:
    return load_span(ModelSpec.open(tiny_model), 0, 6)


@pytest.fixture(scope="module")
def guesser(tiny_model: Path) -> RingGuesser:
    return RingGuesser(ModelSpec.open(tiny_model), torch.device("cpu"))


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


class Ring:
    """A client's push sessions on a first server (blocks 0:3) and a last one (3:6) that may form a ring."""

    def __init__(self, wires: Wires, first: str, last: str) -> None:
        self.wires, self.names = wires, (first, last)
        self.ids = (uuid.uuid4().hex, uuid.uuid4().hex)
        self.streams: list[Streams] = []
        self.opened: list[dict[str, Any]] = []

    async def open(self, *, ring_to: bool = True, ring_from: str | None = "last", ends: tuple[int, int] = (3, 6)
                   ) -> Ring:
        first, last = self.names
        ring_meta = [{"ring_from": peer(ring_from)} if ring_from else {},
                     {"ring_to": [[peer(first), self.ids[0]], [peer(last), self.ids[1]]]} if ring_to else {}]
        for name, session_id, (start, end), extra in zip(self.names, self.ids, [(0, 3), ends], ring_meta, strict=True):
            stream = await self.wires.open(peer(CLIENT), peer(name), protocol.RPC_INFERENCE)
            await send(stream, [], {"open": True, "push": True, "session_id": session_id, "start": start, "end": end,
                                    "batch_size": 2, "max_length": 16, **extra})
            answer = await read(stream)
            assert answer is not None and answer[1].get("opened") is True, answer
            self.streams.append(stream)
            self.opened.append(answer[1])
        return self

    async def send(self, tensors: list[torch.Tensor], step_id: int) -> None:
        """A step of the client, to the first server, routed on to the last."""
        await send(self.streams[0], tensors, {"session_id": self.ids[0], "step_id": step_id,
                                              "route": [[peer(self.names[1]), self.ids[1]]]})

    async def answers(self, step_id: int) -> tuple[Any, Any]:
        """Both servers' answers to a step."""
        got = await read(self.streams[0]), await read(self.streams[1])
        assert all(a is not None and a[1].get("step_id") == step_id for a in got), got
        return got


def prefill(span: BlockSpan) -> list[torch.Tensor]:
    """A prefill of 2 rows of 4 tokens, the first row left-padded by one."""
    hidden = torch.randn(2, 4, span.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    return [hidden, mask, (mask.cumsum(-1) - 1).clamp(min=0)]


def decode_step(span: BlockSpan, seed: int) -> list[torch.Tensor]:
    """The client's first decode step after `prefill` (any token's embedding will do)."""
    hidden = torch.randn(2, 1, span.spec.hidden_size, generator=torch.Generator().manual_seed(seed))
    return [hidden, torch.ones(2, 5, dtype=torch.long), torch.tensor([[3], [4]])]


def greedy_next(reference: Any, output: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
                ) -> list[torch.Tensor]:
    """The next step of a greedy client, by transformers' own norm, LM head and embeddings."""
    with torch.inference_mode():
        logits = reference.lm_head(reference.model.norm(output[:, -1:, :]))[:, -1, :]
        hidden = reference.model.embed_tokens(logits.argmax(-1)[:, None])
    return [hidden.contiguous(), torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1), positions[:, -1:] + 1]


def ring_servers(wires: Wires, span: BlockSpan, guesser: RingGuesser) -> tuple[BlockHandler, BlockHandler]:
    return serve(wires, "first", span), serve(wires, "last", span, guesser=guesser)


async def past_a_guess(wires: Wires, span: BlockSpan, guesser: RingGuesser
                       ) -> tuple[BlockHandler, BlockHandler, Ring, Any, Any]:
    """A client's ring after its prefill, its first decode step and the last server's guess of step 2: (first server,
    last server, the ring, the last server's answer to step 1, the first server's to the guess)."""
    first, last = ring_servers(wires, span, guesser)
    ring = await Ring(wires, "first", "last").open()
    await ring.send(prefill(span), 0)
    await ring.answers(0)
    assert await nothing_within(ring.streams[0], 0.2)  # no guess after a prompt: more of it may come
    await ring.send(decode_step(span, 1), 1)
    _, decoded = await ring.answers(1)
    guessed, _ = await ring.answers(2)
    return first, last, ring, decoded, guessed


def test_the_last_server_guesses_the_next_step_and_the_clients_copy_confirms_it(span: BlockSpan, guesser: RingGuesser,
                                                                                 reference: Any) -> None:
    async def test(wires: Wires) -> None:
        # Given a client's sessions on a first server and on a last one that holds the head, opened for the ring,
        # When the client sends its prefill and its first decode step
        first, last, ring, (outputs, _), (guessed, meta) = await past_a_guess(wires, span, guesser)
        assert [answer["ring"] for answer in ring.opened] == [True, True]
        # Then, before the client sends anything more, both servers answered step 2: the last server guessed it
        step = decode_step(span, 1)
        expected = greedy_next(reference, outputs[0], *step[1:])
        assert meta["guess"] is True and meta["input_digest"] == input_digest(*expected, None, 2)
        # and the client's own copy of step 2, the same input, is confirmed in a few bytes, not computed again
        await ring.send(expected, 2)
        confirmed = await read(ring.streams[0])
        assert confirmed is not None and confirmed == ([], {"step_id": 2, "confirmed": True})
        assert first.sessions[ring.ids[0]].applied == last.sessions[ring.ids[1]].applied == 3
        assert first.stats.steps == last.stats.steps == 3
        # and what the first server answered for it is what its blocks give for that input after the steps before
        with torch.inference_mode():
            caches = span.new_caches(0, 3, 16)
            span(*prefill(span), caches, 0, 3)
            span(*step, caches, 0, 3)
            direct = span(*expected, caches, 0, 3)
        torch.testing.assert_close(guessed[0], direct, rtol=1e-5, atol=1e-5)
    run(test)


def test_a_guessed_step_whose_push_failed_is_pushed_on_when_the_clients_copy_confirms_it(
        span: BlockSpan, guesser: RingGuesser, reference: Any) -> None:
    async def test(wires: Wires) -> None:
        # Given a ring after its prefill, whose first server's push of the next step it applies cannot start (as when
        # the session has its pushes in flight already: the push is refused BUSY and the client told)
        first, last = ring_servers(wires, span, guesser)
        ring = await Ring(wires, "first", "last").open()
        await ring.send(prefill(span), 0)
        await ring.answers(0)
        push_later, calls = first.pusher.push_later, []

        def second_push_refused(*args: Any, **kwargs: Any) -> bool:
            calls.append(args[2])
            return len(calls) != 2 and push_later(*args, **kwargs)
        first.pusher.push_later = second_push_refused  # type: ignore[method-assign]
        # When the client's first decode step goes round, and the last server's guess of step 2 is applied first
        step = decode_step(span, 1)
        await ring.send(step, 1)
        _, (outputs, _) = await ring.answers(1)
        report, guessed = await read(ring.streams[0]), await read(ring.streams[0])
        assert report is not None and report[1]["step_id"] == 2 and "in flight" in report[1]["push_failed"]["reason"]
        assert guessed is not None and guessed[1]["step_id"] == 2 and guessed[1]["guess"] is True
        assert await nothing_within(ring.streams[1], 0.3)  # the guess never reached the last server
        # (the report came before the client sent step 2: a client waits for no answer to it yet, and drops it)
        # Then the client's own copy of step 2 is confirmed, and pushed on to the last server, which answers it
        await ring.send(greedy_next(reference, outputs[0], *step[1:]), 2)
        assert await read(ring.streams[0]) == ([], {"step_id": 2, "confirmed": True})
        answered = await read(ring.streams[1])
        assert answered is not None and answered[1]["step_id"] == 2 and "error" not in answered[1]
        assert last.sessions[ring.ids[1]].applied >= 3  # (and the ring goes on: it may have guessed step 3 since)
    run(test)


def test_a_guess_ahead_of_the_clients_copy_is_dropped_and_the_ring_never_runs_ahead(span: BlockSpan,
                                                                                    guesser: RingGuesser) -> None:
    async def test(wires: Wires) -> None:
        # Given a ring whose guess of step 2 the first server applied
        first, last, ring, _, _ = await past_a_guess(wires, span, guesser)
        # When the client has not sent its copy of step 2 yet
        # Then the last server's guess of step 3 is dropped: nothing more is computed or answered
        assert await nothing_within(ring.streams[0], 0.5)
        assert first.sessions[ring.ids[0]].applied == 3 and first.stats.steps == 3
        assert last.sessions[ring.ids[1]].applied == 3
    run(test)


def test_a_client_step_other_than_the_guess_gets_the_guessed_answer_and_ends_the_ring(span: BlockSpan,
                                                                                     guesser: RingGuesser) -> None:
    async def test(wires: Wires) -> None:
        # Given a ring whose guess of step 2 the first server applied
        first, _, ring, _, (guessed, meta) = await past_a_guess(wires, span, guesser)
        # When the client's own step 2 is another token
        other = [torch.randn(2, 1, span.spec.hidden_size), torch.ones(2, 6, dtype=torch.long),
                 torch.tensor([[4], [5]])]
        await ring.send(other, 2)
        # Then it gets the guessed step's answer again, whose digest its audit finds is not its input
        again = await read(ring.streams[0])
        assert again is not None and again[1]["input_digest"] == meta["input_digest"] != input_digest(*other, None, 2)
        assert torch.equal(again[0][0], guessed[0])
        # and the first server takes no guess of that session any more
        assert first.sessions[ring.ids[0]].ring_from is None
    run(test)


def test_guesses_from_another_server_are_dropped_unapplied(span: BlockSpan, guesser: RingGuesser) -> None:
    async def test(wires: Wires) -> None:
        # Given a first server whose session takes the guesses of the server "last" only, after a prefill
        first, _ = serve(wires, "first", span), serve(wires, "last", span)
        ring = await Ring(wires, "first", "last").open(ring_to=False)
        tensors = prefill(span)
        await send(ring.streams[0], tensors, {"session_id": ring.ids[0], "step_id": 0})
        assert await read(ring.streams[0]) is not None
        # When another member server pushes a guess of step 1, with a valid proof of its own
        push = await wires.open(peer("other"), peer("first"), protocol.RPC_PUSH)
        await send(push, [], {"attach": True, "session_id": ring.ids[0]})
        assert (await read(push)) == ([], {"attached": True})
        hidden = torch.randn(2, 1, span.spec.hidden_size)
        mask, positions = torch.ones(2, 5, dtype=torch.long), torch.tensor([[3], [4]])
        proof = sign_push(identity("other"), owner=peer(CLIENT), upstream_session="theirs", target_session=ring.ids[0],
                          step_id=1, digest=input_digest(hidden, mask, positions, None, 1))
        await send(push, [hidden, mask, positions], {"session_id": ring.ids[0], "step_id": 1, "guess": True,
                                                     "push_proof": proof})
        # Then it is dropped: accepted as a push, applied nowhere, told nobody
        assert (await read(push)) == ([], {"accepted": 1, "dropped": True})
        assert first.sessions[ring.ids[0]].applied == 1 and first.stats.steps == 1
        assert await nothing_within(ring.streams[0], 0.2)
    run(test)


def test_only_a_session_the_ring_can_serve_joins_it(span: BlockSpan, guesser: RingGuesser) -> None:
    async def test(wires: Wires) -> None:
        # A last server without the head, a session that does not end at the last block, a first hop that does
        # not start at block 0: none is in a ring, and says so when opened
        serve(wires, "first", span), serve(wires, "plain", span), serve(wires, "last", span, guesser=guesser)
        no_head = await Ring(wires, "first", "plain").open()
        assert no_head.opened[1]["ring"] is False
        short = await Ring(wires, "first", "last").open(ends=(3, 5))
        assert short.opened[1]["ring"] is False
        stream = await wires.open(peer(CLIENT), peer("last"), protocol.RPC_INFERENCE)
        await send(stream, [], {"open": True, "push": True, "session_id": uuid.uuid4().hex, "start": 3, "end": 6,
                                "batch_size": 1, "max_length": 8, "ring_from": peer("first")})
        answer = await read(stream)
        assert answer is not None and answer[1]["opened"] is True and answer[1]["ring"] is False
    run(test)


def test_a_full_session_is_not_guessed_past_its_max_length(span: BlockSpan, guesser: RingGuesser) -> None:
    async def test(wires: Wires) -> None:
        # Given a ring of sessions of 16 tokens
        first, last = ring_servers(wires, span, guesser)
        ring = await Ring(wires, "first", "last").open()
        # When the client's prefill of 15 tokens and a decode step fill them whole
        hidden = torch.randn(2, 15, span.spec.hidden_size)
        await ring.send([hidden, torch.ones(2, 15, dtype=torch.long), torch.arange(15).expand(2, 15)], 0)
        await ring.answers(0)
        step = [torch.randn(2, 1, span.spec.hidden_size), torch.ones(2, 16, dtype=torch.long), torch.tensor([[15]] * 2)]
        await ring.send(step, 1)
        await ring.answers(1)
        # Then no step is guessed past it
        assert await nothing_within(ring.streams[0], 0.3)
        await asyncio.sleep(0)
        assert first.sessions[ring.ids[0]].applied == 2 and last.pusher.pushed == 0
    run(test)
