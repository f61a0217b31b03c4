"""A real server validates every request before compute, answers bad ones with an error, and keeps serving."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from tiers import process_fixture

from launch.local_swarm import LocalSwarm
from servers.block_loading import load_span
from swarmclient import protocol
from swarmclient.data_structures import RouteHop
from swarmclient.errors import InvalidRequest, PeerFailed
from swarmclient.model_spec import ModelSpec
from swarmclient.session import InferenceSession, ServerSession
from swarmclient.swarm import Swarm

MAX_BATCH = 2


@process_fixture(scope="module")
def server_and_client(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalSwarm, Swarm]]:
    spec = ModelSpec.open(tiny_model)
    with LocalSwarm(tiny_model, [], log_dir=tmp_path_factory.mktemp("server")) as swarm:
        swarm.start_servers([(0, 6, ["--max-batch-size", str(MAX_BATCH), "--attn-cache-tokens", "64"]),
                             (0, 6, ["--quant", "int8"]), (0, 6, ["--dtype", "bfloat16"])])
        client = Swarm.connect(swarm.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks)
        try:
            yield swarm, client
        finally:
            client.close()


def forward(client: Swarm, peer_id: str, tensors: list[torch.Tensor], meta: dict) -> tuple[list[torch.Tensor], dict]:
    request = protocol.make_request(tensors, meta)
    response = client.loop.run(client.p2p.call_protobuf_handler(PeerID.from_base58(peer_id), protocol.RPC_FORWARD,
                                                                request, runtime_pb2.ExpertResponse))
    return protocol.read_message(response)


def good_inputs(hidden_size: int, batch: int = 1, length: int = 4) -> list[torch.Tensor]:
    hidden = torch.randn(batch, length, hidden_size, generator=torch.Generator().manual_seed(0))
    return [hidden, torch.ones(batch, length, dtype=torch.long), torch.arange(length).expand(batch, length)]


def test_a_remote_forward_equals_the_same_blocks_run_locally(tiny_model: Path, server_and_client) -> None:
    swarm, client = server_and_client
    spec = ModelSpec.open(tiny_model)
    inputs = good_inputs(spec.hidden_size)
    (remote,), meta = forward(client, swarm.servers[0].peer_id, inputs, {"start": 1, "end": 5})
    assert protocol.response_error(meta) is None
    assert torch.equal(remote, load_span(spec, 1, 5)(*inputs))


@pytest.mark.parametrize("case, tensors, meta, message", [
    ("wrong hidden size", lambda h: [torch.zeros(1, 4, h + 1), torch.ones(1, 4, dtype=torch.long),
                                     torch.arange(4)[None]], {"start": 0, "end": 6}, "hidden states must be"),
    ("wrong dtype", lambda h: [torch.zeros(1, 4, h, dtype=torch.int64), torch.ones(1, 4, dtype=torch.long),
                               torch.arange(4)[None]], {"start": 0, "end": 6}, "float32"),
    ("too many tokens", lambda h: [torch.zeros(1, 4096, h), torch.ones(1, 4096, dtype=torch.long),
                                   torch.arange(4096)[None]], {"start": 0, "end": 6}, "too many tokens"),
    ("batch over the limit", lambda h: good_inputs(h, batch=MAX_BATCH + 1), {"start": 0, "end": 6}, "batch size"),
    ("blocks outside the span", lambda h: good_inputs(h), {"start": 0, "end": 7}, "'end'"),
    ("a missing tensor", lambda h: good_inputs(h)[:2], {"start": 0, "end": 6}, "expected 3 tensors"),
    ("NaN hidden states", lambda h: [torch.full((1, 4, h), float("nan"))] + good_inputs(h)[1:],
     {"start": 0, "end": 6}, "NaN or Inf"),
])
def test_a_malformed_forward_gets_an_error_and_the_next_good_one_is_served(
        tiny_model: Path, server_and_client, case: str, tensors, meta: dict, message: str) -> None:
    swarm, client = server_and_client
    hidden_size = ModelSpec.open(tiny_model).hidden_size
    peer = swarm.servers[0].peer_id
    _, error_meta = forward(client, peer, tensors(hidden_size), meta)
    code, text = protocol.response_error(error_meta) or (None, "")
    assert code == protocol.ErrorCode.INVALID and message in text, case
    (output,), ok_meta = forward(client, peer, good_inputs(hidden_size), {"start": 0, "end": 6})
    assert protocol.response_error(ok_meta) is None and output.shape == (1, 4, hidden_size)


def open_session(client: Swarm, peer_id: str, *, batch_size: int = 1, max_length: int = 16) -> ServerSession:
    session = ServerSession(client, RouteHop(peer_id, 0, 6), batch_size=batch_size, max_length=max_length)
    return client.loop.run(session.open())


def step(client: Swarm, session: ServerSession, inputs: list[torch.Tensor]) -> torch.Tensor:
    return client.loop.run(session.step(*inputs))


def test_a_step_for_an_unknown_session_is_refused_and_the_session_goes_on(tiny_model: Path, server_and_client) -> None:
    swarm, client = server_and_client
    hidden_size = ModelSpec.open(tiny_model).hidden_size
    session = open_session(client, swarm.servers[0].peer_id)
    step(client, session, good_inputs(hidden_size, length=3))
    real_id, session.session_id = session.session_id, "not-this-session"
    with pytest.raises(InvalidRequest, match="unknown_session"):
        step(client, session, good_inputs(hidden_size, length=1))
    session.session_id = real_id
    hidden, _, _ = good_inputs(hidden_size, length=1)
    output = step(client, session, [hidden, torch.ones(1, 4, dtype=torch.long), torch.tensor([[3]])])
    assert output.shape == (1, 1, hidden_size)
    client.loop.run(session.close())


def test_a_session_step_past_its_length_is_refused(tiny_model: Path, server_and_client) -> None:
    swarm, client = server_and_client
    hidden_size = ModelSpec.open(tiny_model).hidden_size
    session = open_session(client, swarm.servers[0].peer_id, max_length=4)
    with pytest.raises(InvalidRequest, match="too many tokens"):
        step(client, session, good_inputs(hidden_size, length=5))
    assert step(client, session, good_inputs(hidden_size, length=4)).shape == (1, 4, hidden_size)
    client.loop.run(session.close())


def test_a_session_that_does_not_fit_the_cache_is_refused_as_retryable(tiny_model: Path, server_and_client) -> None:
    swarm, client = server_and_client
    hidden_size = ModelSpec.open(tiny_model).hidden_size
    session = open_session(client, swarm.servers[0].peer_id, batch_size=2, max_length=64)  # 128 > 64 tokens
    with pytest.raises(PeerFailed, match="cache_full"):
        step(client, session, good_inputs(hidden_size, batch=2))
    client.loop.run(session.close())


@pytest.mark.parametrize("server, tolerance", [(1, 0.1), (2, 0.05)], ids=["int8", "bfloat16"])
def test_a_quantized_or_bfloat16_server_answers_float32_close_to_float32(
        tiny_model: Path, server_and_client, server: int, tolerance: float) -> None:
    swarm, client = server_and_client
    inputs = good_inputs(ModelSpec.open(tiny_model).hidden_size)
    (exact,), _ = forward(client, swarm.servers[0].peer_id, inputs, {"start": 0, "end": 6})
    (approx,), meta = forward(client, swarm.servers[server].peer_id, inputs, {"start": 0, "end": 6})
    assert protocol.response_error(meta) is None and approx.dtype == torch.float32
    assert (approx - exact).norm() / exact.norm() < tolerance


def test_info_reports_the_servers_announcement(tiny_model: Path, server_and_client) -> None:
    swarm, client = server_and_client
    info = client.loop.run(client.call_info(swarm.servers[1].peer_id))
    assert info["start"] == 0 and info["end"] == 6 and info["quant"] == "int8" and info["state"] == "online"
    assert info["model_id"] == ModelSpec.open(tiny_model).model_id


def raw_stream(client: Swarm, peer_id: str):
    """A bare `inference` stream (reader, writer), to send what ServerSession never would."""
    _, reader, writer = client.loop.run(client.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id),
                                                                             protocol.RPC_INFERENCE))
    return reader, writer


def exchange(client: Swarm, reader, writer, payload: bytes) -> dict:
    async def run() -> dict:
        writer.write(payload)
        return protocol.decode(await protocol.read_frame(reader, 1 << 24))[1]
    return client.loop.run(run())


def test_an_undecodable_step_gets_an_error_and_the_stream_goes_on(tiny_model: Path, server_and_client) -> None:
    swarm, client = server_and_client
    hidden_size = ModelSpec.open(tiny_model).hidden_size
    reader, writer = raw_stream(client, swarm.servers[0].peer_id)
    garbage = b"\x00\x00\x00\x03abc"
    meta = exchange(client, reader, writer, protocol.length_prefixed(garbage))
    code, text = protocol.response_error(meta) or (None, "")
    assert code == protocol.ErrorCode.INVALID and "malformed" in text
    good = protocol.encode(good_inputs(hidden_size, length=2), {"session_id": "s" * 32, "start": 0, "end": 6,
                                                                 "batch_size": 1, "max_length": 8})
    meta = exchange(client, reader, writer, protocol.length_prefixed(good))
    assert protocol.response_error(meta) is None and meta["cache_len"] == 2
    client.loop.run(_close(writer))


def test_an_oversized_message_is_refused_unread_and_the_server_keeps_serving(tiny_model: Path,
                                                                             server_and_client) -> None:
    swarm, client = server_and_client
    peer = swarm.servers[0].peer_id
    reader, writer = raw_stream(client, peer)
    meta = exchange(client, reader, writer, (1 << 40).to_bytes(8, "big"))  # a terabyte announced, nothing sent
    code, text = protocol.response_error(meta) or (None, "")
    assert code == protocol.ErrorCode.INVALID and "exceeds the limit" in text
    assert client.loop.run(asyncio.wait_for(reader.read(), timeout=10)) == b""  # the server ended the stream
    client.loop.run(_close(writer))
    session = open_session(client, peer)
    assert step(client, session, good_inputs(ModelSpec.open(tiny_model).hidden_size)).shape[1] == 4
    client.loop.run(session.close())


async def _close(writer) -> None:
    writer.close()


def test_closing_a_session_frees_it_on_the_server_before_close_returns(tiny_model: Path, server_and_client) -> None:
    swarm, client = server_and_client
    hidden_size = ModelSpec.open(tiny_model).hidden_size
    peer = swarm.servers[0].peer_id
    for _ in range(5):
        session = open_session(client, peer)
        step(client, session, good_inputs(hidden_size))
        assert client.loop.run(client.call_info(peer))["sessions"] == 1
        client.loop.run(session.close())
        assert client.loop.run(client.call_info(peer))["sessions"] == 0


def framed(tensors: list[torch.Tensor], meta: dict) -> bytes:
    return protocol.length_prefixed(protocol.encode(tensors, meta))


def test_a_close_message_frees_the_session_answers_and_ends_the_stream(tiny_model: Path, server_and_client) -> None:
    swarm, client = server_and_client
    hidden_size = ModelSpec.open(tiny_model).hidden_size
    peer = swarm.servers[0].peer_id
    reader, writer = raw_stream(client, peer)
    opening = {"session_id": "c" * 32, "start": 0, "end": 6, "batch_size": 1, "max_length": 8}
    assert exchange(client, reader, writer, framed(good_inputs(hidden_size, length=2), opening))["cache_len"] == 2
    # a close naming another session is refused and changes nothing: the session goes on
    meta = exchange(client, reader, writer, framed([], {"session_id": "x" * 32, "close": True}))
    assert (protocol.response_error(meta) or (None,))[0] == protocol.ErrorCode.UNKNOWN_SESSION
    assert client.loop.run(client.call_info(peer))["sessions"] == 1
    # the answer to its own close comes after the session is freed, not merely after the stream ends
    assert exchange(client, reader, writer, framed([], {"session_id": "c" * 32, "close": True})) == {"closed": True}
    assert client.loop.run(client.call_info(peer))["sessions"] == 0
    assert client.loop.run(asyncio.wait_for(reader.read(), timeout=10)) == b""  # then the server ends the stream
    client.loop.run(_close(writer))


def test_closing_a_stream_that_never_stepped_is_answered(server_and_client) -> None:
    swarm, client = server_and_client
    reader, writer = raw_stream(client, swarm.servers[0].peer_id)
    assert exchange(client, reader, writer, framed([], {"session_id": "n" * 32, "close": True})) == {"closed": True}
    client.loop.run(_close(writer))


def test_a_session_reports_the_servers_compute_of_its_last_step(tiny_model: Path, server_and_client) -> None:
    _, client = server_and_client
    hidden_size = ModelSpec.open(tiny_model).hidden_size
    with InferenceSession(client, batch_size=1, max_length=16) as session:
        assert session.last_compute_seconds == 0.0
        began = time.perf_counter()
        session.step(*good_inputs(hidden_size, length=8))
        wall = time.perf_counter() - began
        # the servers' own forward time: positive, and part of (less than) the step's round trip
        assert 0 < session.last_compute_seconds < wall
