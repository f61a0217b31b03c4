"""What a session's pushes may take from a server is bounded (issue 28, N5): a duplicate step is pushed again only
where its push failed, a session has at most MAX_PUSHES_IN_FLIGHT pushes in flight, a push that gets no answer
times out, a duplicate keeps no stream alive, and a step sent too often ends its stream.

Real handlers of the tiny model in this process, over socket pairs (tests/servers/in_process.py); the caller's
messages are raw frames, sent as a misbehaving member would.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from in_process import Streams, Wires, nothing_within, peer, read, run, send, serve

from servers.block_loading import load_span
from servers.handler import MAX_DUPLICATES_PER_STEP, BlockHandler
from servers.push import MAX_PUSHES_IN_FLIGHT, Pusher
from servers.span import BlockSpan
from swarmnet import protocol
from swarmnet.model_spec import ModelSpec

CLIENT = "client"


@pytest.fixture(scope="module")
def span(tiny_model: Path) -> BlockSpan:
    return load_span(ModelSpec.open(tiny_model), 0, 6)


def step(span: BlockSpan, past: int, tokens: int) -> list[torch.Tensor]:
    """A step's tensors (hidden, mask, positions) of one row."""
    hidden = torch.randn(1, tokens, span.spec.hidden_size, generator=torch.Generator().manual_seed(past))
    return [hidden, torch.ones(1, past + tokens, dtype=torch.long), torch.arange(past, past + tokens).view(1, tokens)]


async def open_session(wires: Wires, server: str, start: int, end: int, session_id: str | None = None) -> Streams:
    """The client's push session on `server` over blocks [start, end)."""
    stream = await wires.open(peer(CLIENT), peer(server), protocol.RPC_INFERENCE)
    await send(stream, [], {"open": True, "push": True, "session_id": session_id or uuid.uuid4().hex, "start": start,
                            "end": end, "batch_size": 1, "max_length": 64})
    answer = await read(stream)
    assert answer is not None and answer[1].get("opened") is True, answer
    stream_ids[stream] = answer[1]["session_id"]
    return stream


stream_ids: dict[Any, str] = {}


def meta(stream: Streams, step_id: int, route: list[list[str]] | None = None) -> dict[str, Any]:
    return {"session_id": stream_ids[stream], "step_id": step_id, **({"route": route} if route else {})}


def test_a_thousand_duplicates_with_a_route_push_once_and_end_the_stream(span: BlockSpan) -> None:
    async def test(wires: Wires) -> None:
        # Given an upstream server and a downstream one, and a client's push sessions on both
        upstream, downstream = serve(wires, "up", span), serve(wires, "down", span)
        down = await open_session(wires, "down", 3, 6)
        up = await open_session(wires, "up", 0, 3)
        route = [[peer("down"), stream_ids[down]]]
        # whose first step the upstream computes and pushes on, once
        await send(up, step(span, 0, 8), meta(up, 0, route))
        first = await read(up)
        assert first is not None and first[1]["step_id"] == 0
        pushed = await read(down)
        assert pushed is not None and pushed[1]["step_id"] == 0 and pushed[0][0].shape == (1, 8, 64)
        # When the client sends that step again up to 1,000 times, naming the same route, each once the one before
        # it is answered
        began = time.perf_counter()
        answers = []
        for _ in range(1000):
            await send(up, [], meta(up, 0, route))
            answer = await read(up)
            assert answer is not None
            answers.append(answer[1])
            if protocol.response_error(answer[1]) is not None:
                break
        up[1].write_eof()  # the server lingers until the caller closes its side too
        # Then it was pushed nowhere again and nothing was computed again, and after a few copies the stream was
        # refused and ended
        assert await read(up) is None
        assert upstream.pusher.pushed == 1 and upstream.pusher.failed == 0
        assert upstream.pusher.in_flight(stream_ids[up]) == 0
        assert upstream.stats.steps == 1 and downstream.stats.steps == 1
        assert len(answers) == MAX_DUPLICATES_PER_STEP + 1
        assert all(a.get("step_id") == 0 and "error" not in a for a in answers[:-1])
        assert "ending the stream" in str(answers[-1])
        assert stream_ids[up] not in upstream.sessions  # its session was freed with the stream
        assert await nothing_within(down, 0.2)  # and the downstream session got nothing more
        print(f"\n1,000 duplicates answered in {time.perf_counter() - began:.3f} s")
    run(test)


def test_a_duplicate_after_a_failed_push_is_pushed_again_and_its_copies_are_not(span: BlockSpan) -> None:
    async def test(wires: Wires) -> None:
        # Given an upstream push session whose first step names a downstream session that is not open yet
        upstream, downstream = serve(wires, "up", span), serve(wires, "down", span)
        up = await open_session(wires, "up", 0, 3)
        later = uuid.uuid4().hex
        route = [[peer("down"), later]]
        tensors = step(span, 0, 4)
        await send(up, tensors, meta(up, 0, route))
        # Then the client gets the step's answer, then the push's failure
        answers = [await read(up), await read(up)]
        assert answers[0] is not None and answers[0][1]["step_id"] == 0
        assert answers[1] is not None and answers[1][1]["push_failed"]["peer"] == peer("down")
        # When that session opens and the client sends the step again, with the same route
        down = await open_session(wires, "down", 3, 6, later)
        await send(up, [], meta(up, 0, route))
        again = await read(up)
        assert again is not None and torch.equal(again[0][0], answers[0][0][0])
        # Then it is pushed again, and the downstream session applies it, as if the first push had worked
        pushed = await read(down)
        assert pushed is not None and pushed[1]["step_id"] == 0
        assert torch.allclose(pushed[0][0], span(again[0][0], tensors[1], tensors[2], None, 3, 6), atol=1e-5)
        # and a further copy, now that the push worked, is answered and pushed nowhere
        await send(up, [], meta(up, 0, route))
        assert await read(up) is not None
        assert await nothing_within(down, 0.3)
        assert (upstream.pusher.pushed, upstream.pusher.failed) == (1, 1) and downstream.stats.steps == 1
    run(test)


def test_pushes_in_flight_are_bounded_per_session_and_time_out(span: BlockSpan) -> None:
    async def test(wires: Wires) -> None:
        # Given a member server that attaches push streams and never answers a push
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await protocol.read_frame(reader, protocol.OPEN_FRAME_LIMIT)
            protocol.write_frame(writer, protocol.encode([], {"attached": True}))
            while await reader.read(1 << 16):
                pass
        wires.raw[peer("silent")] = silent
        pusher = Pusher(timeout=1.0, timeout_per_token=0.0)
        serve(wires, "up", span, pusher=pusher)
        up = await open_session(wires, "up", 0, 6)
        route = [[peer("silent"), uuid.uuid4().hex]]
        # When the client sends three steps naming it, one after the other
        reports = []
        for step_id in range(3):
            await send(up, step(span, step_id * 4, 4), meta(up, step_id, route))
            while (answer := await read(up)) is not None and answer[1].get("push_failed"):
                reports.append(answer[1])
            assert answer is not None and answer[1]["step_id"] == step_id and answer[0]
            if step_id == MAX_PUSHES_IN_FLIGHT - 1:
                assert pusher.in_flight(stream_ids[up]) == MAX_PUSHES_IN_FLIGHT
        # Then the third is not pushed: its push is reported failed as busy at once, before its answer (the client
        # sends it on itself)
        assert [(r["step_id"], r["push_failed"]["reason"].split(":")[0]) for r in reports] == [(2, "busy")]
        # and the two in flight fail after the timeout, reported too, and nothing is left in flight
        began = time.perf_counter()
        late = [await read(up, timeout=5.0), await read(up, timeout=5.0)]
        assert sorted(r[1]["step_id"] for r in late if r) == [0, 1]
        assert all(r and "no answer to a push" in r[1]["push_failed"]["reason"] for r in late)
        assert time.perf_counter() - began < 2.0 and pusher.in_flight(stream_ids[up]) == 0
    run(test)


def test_duplicates_keep_no_stream_alive(span: BlockSpan) -> None:
    async def test(wires: Wires) -> None:
        # Given a server whose streams close a second after their last accepted message
        handler: BlockHandler = serve(wires, "up", span, session_timeout=1.0)
        up = await open_session(wires, "up", 0, 6)
        await send(up, step(span, 0, 4), meta(up, 0))
        assert await read(up) is not None
        # When the client only repeats that step, every 0.2 s
        began = time.perf_counter()
        answered = 0.0  # seconds after `began` of the last answer
        while time.perf_counter() - began < 8.0:
            await send(up, [], meta(up, 0))
            if await read(up) is None:
                break
            answered = time.perf_counter() - began
            await asyncio.sleep(0.2)
        # Then the stream was closed a second after the step (and ended once the server's linger ran out), its
        # session freed, long before the copies ran out
        assert 0.4 < answered < 1.2 and not handler.sessions
    run(test)
