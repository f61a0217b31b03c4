"""A push session's answers (swarmclient/answers.py): only answers to steps the client sent are kept, and a server
that sends answers to steps never sent, or push failures naming a peer that is not its next hop, is taken for
faulty after a few (issue 28, N14). The server here is a real stream's other end, written frame by frame."""
from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from swarmclient.answers import MAX_STRAYS, AnswerReader, StreamBroken
from swarmclient.config import ClientConfig
from swarmclient.errors import PushReported
from swarmclient.server_session import ServerSession
from swarmclient.session import InferenceSession
from swarmclient.swarm import Swarm
from swarmnet import protocol
from swarmnet.data_structures import RouteHop

Server = asyncio.StreamWriter


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


async def reader_and_server(on_push_failure: Callable[[int, str, str], bool] = lambda *report: True
                            ) -> tuple[AnswerReader, Server]:
    """An AnswerReader on one end of a stream, and the server's end to write answers with."""
    one, other = socket.socketpair()
    client_reader, client_writer = await asyncio.open_connection(sock=one)
    _, server = await asyncio.open_connection(sock=other)
    kept.append(client_writer)  # a writer collected closes its transport, which would end the reader's stream too
    return AnswerReader(client_reader, on_push_failure), server


kept: list[asyncio.StreamWriter] = []


def answer(step_id: int, value: float = 0.0, **meta: Any) -> bytes:
    """A step's answer frame: one row's output."""
    return protocol.length_prefixed(protocol.encode([torch.full((1, 1, 4), value)], {"step_id": step_id, **meta}))


def push_failed(step_id: int, peer: str) -> bytes:
    return protocol.length_prefixed(protocol.encode([], {"step_id": step_id,
                                                         "push_failed": {"peer": peer, "reason": "broken"}}))


async def settle(server: Server) -> None:
    """Wait until the reader has taken what the server wrote."""
    await server.drain()
    await asyncio.sleep(0.05)


def test_answers_to_a_hundred_thousand_steps_never_sent_keep_nothing_and_mark_the_server_faulty() -> None:
    async def test() -> None:
        # Given a reader that sent step 0, and a server that answers it honestly
        reader, server = await reader_and_server()
        reader.expect(0, 1 << 16)
        server.write(answer(0, 1.0))
        tensors, meta = await reader.answer(0, timeout=5)
        assert meta["step_id"] == 0 and tensors[0].eq(1.0).all()
        # and the client's next step, sent and not answered yet
        reader.expect(1, 1 << 16)
        waiting = asyncio.ensure_future(reader.answer(1, timeout=30))
        # When the server sends answers to the next 100,000 steps, which the client never sent
        server.write(b"".join(answer(step_id) for step_id in range(2, 100_002)))
        # Then the reader kept none of them, took the server for faulty after a few, and the waiter knows why
        with pytest.raises(StreamBroken, match="never sent.*taken for faulty"):
            await waiting
        assert reader.pending == 0 and reader.strays == MAX_STRAYS + 1 and reader.broken is not None
        server.close()
    run(test)


def test_answers_out_of_order_and_late_copies_of_taken_ones_are_no_fault() -> None:
    async def test() -> None:
        # Given a reader that sent steps 0 and 1 (the server before pushes step 1's, which may come first)
        reader, server = await reader_and_server()
        for step_id in (0, 1):
            reader.expect(step_id, 1 << 16)
        server.write(answer(1, 1.0) + answer(0, 0.5))
        assert (await reader.answer(0, timeout=5))[0][0].eq(0.5).all()
        assert (await reader.answer(1, timeout=5))[0][0].eq(1.0).all()
        # When copies of both come again, many times (duplicate steps answered again), and an error for step 1
        server.write((answer(0) + answer(1)) * 50)
        await settle(server)
        # Then they are dropped, and the next step is read as ever
        reader.expect(2, 1 << 16)
        server.write(answer(2, 2.0))
        assert (await reader.answer(2, timeout=5))[0][0].eq(2.0).all()
        assert reader.strays == 0 and reader.broken is None and reader.pending == 0
        reader.close()
        server.close()
    run(test)


@dataclass
class PushChain:
    """A client's chain of two push sessions at step 0, the server ends of their streams, the wait for the second's
    answer."""

    inference: InferenceSession
    first: ServerSession
    second: ServerSession
    server: Server         # the first session's server end
    second_server: Server  # kept open: the second session waits on it
    waiting: asyncio.Future[torch.Tensor]


async def push_chain() -> PushChain:
    """A client's chain of two push sessions, first (blocks 0:3) then second (3:6), at step 0: the first's answers
    are read from a stream whose server end is returned, and the client waits for the second's answer."""
    swarm = Swarm(None, None, None, model_id="tiny", num_blocks=6, config=ClientConfig())  # type: ignore[arg-type]
    inference = InferenceSession(swarm, batch_size=1, max_length=8)
    first, second = (ServerSession(swarm, RouteHop(peer, start, end), batch_size=1, max_length=8, push=True,
                                   on_push_failure=inference._push_failed)
                     for peer, start, end in (("first-peer", 0, 3), ("second-peer", 3, 6)))
    inference._sessions = {0: first, 3: second}
    first._answers, server = await reader_and_server(
        lambda step_id, peer, reason: inference._push_failed(first, step_id, peer, reason))
    second._answers, second_server = await reader_and_server()
    second.expect(torch.Size((1, 1, 4)), 0)
    return PushChain(inference, first, second, server, second_server,
                     asyncio.ensure_future(second.answer(0, torch.Size((1, 1, 4)))))


def test_a_push_failure_steers_the_client_only_when_it_names_the_reporters_next_hop() -> None:
    async def test() -> None:
        # Given a client's chain of two push sessions, first (blocks 0:3) then second (3:6), at step 0, whose first
        # server's answers are read from its stream, and whose client waits for the second's answer
        chain = await push_chain()
        inference, first, second, server, waiting = (chain.inference, chain.first, chain.second, chain.server,
                                                     chain.waiting)
        # When the first server reports failed pushes of step 0 to a peer that is not its next hop (nor any hop)
        server.write(push_failed(0, "stranger-peer") * MAX_STRAYS)
        await settle(server)
        # Then the client is not steered: it still waits for the second server, and counts the reports against the
        # first
        assert not waiting.done() and first._answers.strays == MAX_STRAYS and first._answers.broken is None
        # and the second server's own report of a next hop it does not have is no better
        assert not inference._push_failed(second, 0, "first-peer", "broken")
        # When the first server reports a failed push to its next hop, Then the client stops waiting for it at once
        server.write(push_failed(0, "second-peer"))
        with pytest.raises(PushReported):
            await asyncio.wait_for(waiting, 5)
        assert first._answers.broken is None
        # and one more report naming a stranger takes the first server for faulty
        server.write(push_failed(0, "stranger-peer"))
        await settle(server)
        assert first._answers.broken is not None and "not its next hop" in first._answers.broken
        for session in (first, second):
            assert session._answers is not None
            session._answers.close()
        server.close()
    run(test)


def test_a_servers_push_failure_reason_reaches_the_clients_log_escaped(caplog: pytest.LogCaptureFixture) -> None:
    async def test() -> None:
        # Given a client's chain of two push sessions, whose client waits for the second's answer to step 0
        chain = await push_chain()
        inference, first, second, server, waiting = (chain.inference, chain.first, chain.second, chain.server,
                                                     chain.waiting)
        # When the first server reports a failed push whose reason forges a log line
        forged = "broken\nWARNING swarmclient.session: FORGED line: Server 12345678 failed; banned"
        server.write(protocol.length_prefixed(protocol.encode([], {"step_id": 0, "push_failed": {
            "peer": "second-peer", "reason": forged}})))
        with pytest.raises(PushReported) as reported:
            await asyncio.wait_for(waiting, 5)
        # and the client handles the failure (it logs it, and sends the step to the second server directly)
        caplog.set_level(logging.INFO, logger="swarmclient.session")
        await inference._on_failure(reported.value)
        # Then the reason is in the log escaped, on one line
        [logged] = [r.getMessage() for r in caplog.records if "sending the step to it directly" in r.getMessage()]
        assert "\n" not in logged and "broken\\nWARNING swarmclient.session: FORGED line" in logged, logged
        for session in (first, second):
            assert session._answers is not None
            session._answers.close()
        server.close()
    run(test)
