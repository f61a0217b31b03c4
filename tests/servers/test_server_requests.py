"""A real server validates every request before compute, answers bad ones with an error, and keeps serving."""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from raw_streams import answer, close, ended, error_code, exchange, exchange_frame, framed, opening, raw_stream, send
from tiers import process_fixture

from launch.local_swarm import LocalSwarm
from servers.background import BACKGROUND_NICE
from servers.block_loading import load_span
from swarmclient.errors import InvalidRequest, PeerFailed
from swarmclient.session import InferenceSession, ServerSession
from swarmclient.swarm import Swarm
from swarmnet import protocol
from swarmnet.data_structures import RouteHop
from swarmnet.model_spec import ModelSpec

MAX_BATCH = 2
HUGE_BATCH = 8192  # server 2's limit: a valid session there could send 8192 x 2048 x 64 float32 = 4 GiB in one step


@process_fixture(scope="module")
def server_and_client(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalSwarm, Swarm]]:
    spec = ModelSpec.open(tiny_model)
    with LocalSwarm(tiny_model, [], log_dir=tmp_path_factory.mktemp("server")) as swarm:
        swarm.start_servers([(0, 6, ["--max-batch-size", str(MAX_BATCH), "--attn-cache-tokens", "64"]),
                             (0, 6, ["--quant", "int8"]), (0, 6, ["--dtype", "bfloat16", "--max-batch-size", str(HUGE_BATCH)])])
        client = Swarm.connect(swarm.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks)
        try:
            yield swarm, client
        finally:
            client.close()


def forward(client: Swarm, peer_id: str, tensors: list[torch.Tensor], meta: dict) -> tuple[list[torch.Tensor], dict]:
    return client.loop.run(client.call_forward(peer_id, meta["start"], meta["end"], tensors))


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


def thread_nice_values(pid: int) -> list[int]:
    """The nice value of each thread of a process (field 19 of /proc/PID/task/TID/stat)."""
    values = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            values.append(int(stat.read_text().rsplit(")", 1)[1].split()[16]))
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            continue
    return values


def test_forwards_compute_on_a_thread_below_the_sessions_priority(tiny_model: Path, server_and_client) -> None:
    # Given a server that answered a stateless forward (what other clients' checks and embeddings send)
    swarm, client = server_and_client
    server = swarm.servers[0]
    (_,), meta = forward(client, server.peer_id, good_inputs(ModelSpec.open(tiny_model).hidden_size), {"start": 0, "end": 6})
    assert protocol.response_error(meta) is None
    # Then one of its threads runs BACKGROUND_NICE steps below the process, and the rest (sessions' steps) do not
    base = os.getpriority(os.PRIO_PROCESS, server.pid)
    values = thread_nice_values(server.pid)
    assert min(19, base + BACKGROUND_NICE) in values
    assert values.count(base) >= 2  # the main thread (event loop: decode steps) and the prefill thread among them


@pytest.mark.parametrize("case, tensors, meta, message", [
    ("wrong hidden size", lambda h: [torch.zeros(1, 4, h + 1), torch.ones(1, 4, dtype=torch.long),
                                     torch.arange(4)[None]], {"start": 0, "end": 6}, "hidden states must be"),
    ("wrong dtype", lambda h: [torch.zeros(1, 4, h, dtype=torch.int64), torch.ones(1, 4, dtype=torch.long),
                               torch.arange(4)[None]], {"start": 0, "end": 6}, "float32"),
    ("too many tokens", lambda h: [torch.zeros(1, 4096, h), torch.ones(1, 4096, dtype=torch.long),
                                   torch.arange(4096)[None]], {"start": 0, "end": 6}, "'length'"),
    ("batch over the limit", lambda h: good_inputs(h, batch=MAX_BATCH + 1), {"start": 0, "end": 6}, "'batch_size'"),
    ("positions past the model", lambda h: good_inputs(h)[:2] + [torch.arange(4096, 4100)[None]],
     {"start": 0, "end": 6}, "position_ids"),
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


# a first step of 2 x 4 tokens goes right behind the open message; one of 2 x 1024 tokens (512 KiB, more than the
# server reads before a session exists) waits for the open's answer: either way the refusal reaches the client
@pytest.mark.parametrize("length", [4, 1024], ids=["pipelined", "after-the-open"])
def test_a_session_that_does_not_fit_the_cache_is_refused_as_retryable(tiny_model: Path, server_and_client,
                                                                      length: int) -> None:
    swarm, client = server_and_client
    hidden_size = ModelSpec.open(tiny_model).hidden_size
    session = open_session(client, swarm.servers[0].peer_id, batch_size=2, max_length=1024)  # 2048 > 64 tokens
    with pytest.raises(PeerFailed, match="cache_full"):
        step(client, session, good_inputs(hidden_size, batch=2, length=length))
    client.loop.run(session.close())


@pytest.mark.parametrize("server, tolerance, dtype", [(1, 0.1, torch.float32), (2, 0.05, torch.bfloat16)],
                         ids=["int8", "bfloat16"])
def test_a_quantized_or_bfloat16_server_answers_in_its_compute_dtype_close_to_float32(
        tiny_model: Path, server_and_client, server: int, tolerance: float, dtype: torch.dtype) -> None:
    swarm, client = server_and_client
    inputs = good_inputs(ModelSpec.open(tiny_model).hidden_size)
    (exact,), _ = forward(client, swarm.servers[0].peer_id, inputs, {"start": 0, "end": 6})
    (approx,), meta = forward(client, swarm.servers[server].peer_id, inputs, {"start": 0, "end": 6})
    assert protocol.response_error(meta) is None and approx.dtype == dtype  # bfloat16: half float32's bytes
    assert (approx.float() - exact).norm() / exact.norm() < tolerance


def test_info_reports_the_servers_announcement(tiny_model: Path, server_and_client) -> None:
    swarm, client = server_and_client
    info = client.loop.run(client.call_info(swarm.servers[1].peer_id))
    assert info["start"] == 0 and info["end"] == 6 and info["quant"] == "int8" and info["state"] == "online"
    assert info["model_id"] == ModelSpec.open(tiny_model).model_id


def test_fifteen_hundred_info_calls_in_a_row_are_all_answered(server_and_client) -> None:
    # a server that closed a stream before its caller did lost about 1 answer in 500 to p2pd's reset (a lost ping
    # gets a server banned): now the caller closes first
    swarm, client = server_and_client
    peer = swarm.servers[1].peer_id
    failures = []
    for _ in range(1500):
        try:
            client.loop.run(client.call_info(peer))
        except PeerFailed as e:
            failures.append(str(e))
    assert not failures, failures[:3]


def test_an_undecodable_message_gets_an_error_and_the_stream_goes_on(tiny_model: Path, server_and_client) -> None:
    swarm, client = server_and_client
    hidden_size = ModelSpec.open(tiny_model).hidden_size
    stream = raw_stream(client, swarm.servers[0].peer_id)
    meta = exchange(client, stream, protocol.length_prefixed(b"\x00\x00\x00\x03abc"))
    code, text = protocol.response_error(meta) or (None, "")
    assert code == protocol.ErrorCode.INVALID and "malformed" in text
    assert exchange(client, stream, opening("s" * 32)) == {"opened": True, "session_id": "s" * 32}
    meta = exchange(client, stream, framed(good_inputs(hidden_size, length=2), {"session_id": "s" * 32}))
    assert protocol.response_error(meta) is None and meta["cache_len"] == 2
    close(client, stream)


def test_a_background_session_computes_the_span_behind_sessions_and_takes_no_push(tiny_model: Path,
                                                                                  server_and_client) -> None:
    # Given a fresh server process (its background thread not started yet by any stateless forward)
    swarm, client = server_and_client
    spec = ModelSpec.open(tiny_model)
    server = swarm.start_server(0, 6)
    try:
        # When a caller opens a session with "background" (another client's warm check) and sends two steps
        stream = raw_stream(client, server.peer_id)
        meta = exchange(client, stream, framed([], {"open": True, "session_id": "w" * 32, "start": 0, "end": 6,
                                                    "batch_size": 1, "max_length": 8, "background": True}))
        assert meta["opened"]
        inputs = good_inputs(spec.hidden_size, length=6)
        (first,), _ = protocol.decode(exchange_frame(client, stream, framed(
            [inputs[0][:, :4], inputs[1][:, :4], inputs[2][:, :4]], {"session_id": "w" * 32})))
        (second,), _ = protocol.decode(exchange_frame(client, stream, framed(
            [inputs[0][:, 4:], inputs[1], inputs[2][:, 4:]], {"session_id": "w" * 32})))
        close(client, stream)
        # Then its outputs are the span's on the whole sequence, computed on the thread below the sessions' priority
        whole = load_span(spec, 0, 6)(*inputs)
        assert torch.allclose(torch.cat([first, second], dim=1), whole, atol=1e-5)
        assert min(19, os.getpriority(os.PRIO_PROCESS, server.pid) + BACKGROUND_NICE) in thread_nice_values(server.pid)
        # and one asking for push as well is refused, reserving nothing
        stream = raw_stream(client, server.peer_id)
        meta = exchange(client, stream, framed([], {"open": True, "session_id": "x" * 32, "start": 0, "end": 6,
                                                    "batch_size": 1, "max_length": 8, "background": True, "push": True}))
        assert error_code(meta) == protocol.ErrorCode.INVALID and "takes no push and no ring" in str(meta)
        assert client.loop.run(client.call_info(server.peer_id))["sessions"] == 0
        close(client, stream)
    finally:
        server.terminate()


def test_a_step_before_the_open_message_is_refused_and_reserves_nothing(tiny_model: Path, server_and_client) -> None:
    swarm, client = server_and_client
    hidden_size, peer = ModelSpec.open(tiny_model).hidden_size, swarm.servers[0].peer_id
    stream = raw_stream(client, peer)
    # the old protocol's first step: session fields and the prefill, no open message
    old_opening = {"session_id": "o" * 32, "start": 0, "end": 6, "batch_size": 1, "max_length": 8}
    meta = exchange(client, stream, framed(good_inputs(hidden_size, length=2), old_opening))
    assert error_code(meta) == protocol.ErrorCode.UNKNOWN_SESSION and "open message" in str(meta)
    info = client.loop.run(client.call_info(peer))
    assert info["sessions"] == 0 and info["cache_tokens_left"] == 64
    close(client, stream)


@pytest.mark.parametrize("rpc", [protocol.RPC_INFERENCE, protocol.RPC_INFO, protocol.RPC_FORWARD])
def test_a_2_gib_message_before_a_session_is_refused_having_read_only_its_length(server_and_client, rpc: str) -> None:
    swarm, client = server_and_client
    peer = swarm.servers[2].peer_id  # max batch 8192: a session there may send gigabytes, an opening 64 KiB
    stream = raw_stream(client, peer, rpc)
    # 8 bytes announcing 2 GiB and 100 of them: the server answers and ends the stream without waiting for more
    meta = exchange(client, stream, (2 << 30).to_bytes(8, "big") + bytes(100))
    code, text = protocol.response_error(meta) or (None, "")
    assert code == protocol.ErrorCode.INVALID and "exceeds the limit of 65536" in text
    assert ended(client, stream)
    close(client, stream)
    assert client.loop.run(client.call_info(peer))["state"] == "online"


def test_a_message_over_its_sessions_shape_is_refused_unread_and_frees_the_session(tiny_model: Path,
                                                                                  server_and_client) -> None:
    swarm, client = server_and_client
    hidden_size, peer = ModelSpec.open(tiny_model).hidden_size, swarm.servers[0].peer_id
    stream = raw_stream(client, peer)
    assert exchange(client, stream, opening("b" * 32, max_length=8))["opened"]
    # batch 1 x 8 tokens x 64 floats is a few KiB; 1 MiB announced (and 100 bytes sent) is refused at once
    meta = exchange(client, stream, (1 << 20).to_bytes(8, "big") + bytes(100))
    code, text = protocol.response_error(meta) or (None, "")
    assert code == protocol.ErrorCode.INVALID and "exceeds the limit" in text
    assert ended(client, stream)
    close(client, stream)
    assert client.loop.run(client.call_info(peer))["sessions"] == 0
    session = open_session(client, peer)
    assert step(client, session, good_inputs(hidden_size)).shape[1] == 4
    client.loop.run(session.close())


def test_forward_tensors_over_their_headers_shape_are_refused_unread(tiny_model: Path, server_and_client) -> None:
    swarm, client = server_and_client
    hidden_size = ModelSpec.open(tiny_model).hidden_size
    stream = raw_stream(client, swarm.servers[0].peer_id, protocol.RPC_FORWARD)
    header = {"start": 0, "end": 6, "batch_size": 1, "length": 1, "dtype": "float32"}
    assert exchange(client, stream, framed([], header)) == {"admitted": True}
    meta = exchange(client, stream, (1 << 20).to_bytes(8, "big"))  # 1 MiB announced for a 1 x 1 token forward
    code, text = protocol.response_error(meta) or (None, "")
    assert code == protocol.ErrorCode.INVALID and "exceeds the limit" in text
    assert ended(client, stream)
    close(client, stream)
    (output,), _ = forward(client, swarm.servers[0].peer_id, good_inputs(hidden_size, length=1), {"start": 0, "end": 6})
    assert output.shape == (1, 1, hidden_size)


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


def test_a_close_message_frees_the_session_answers_and_ends_the_stream(tiny_model: Path, server_and_client) -> None:
    swarm, client = server_and_client
    hidden_size = ModelSpec.open(tiny_model).hidden_size
    peer = swarm.servers[0].peer_id
    stream = raw_stream(client, peer)
    # the open message and the first step back to back, as the client sends them; two answers, in order
    send(client, stream, opening("c" * 32) + framed(good_inputs(hidden_size, length=2), {"session_id": "c" * 32}))
    assert answer(client, stream)["opened"] and answer(client, stream)["cache_len"] == 2
    # a close naming another session is refused and changes nothing: the session goes on
    meta = exchange(client, stream, framed([], {"session_id": "x" * 32, "close": True}))
    assert error_code(meta) == protocol.ErrorCode.UNKNOWN_SESSION
    assert client.loop.run(client.call_info(peer))["sessions"] == 1
    # the answer to its own close comes after the session is freed, not merely after the stream ends
    assert exchange(client, stream, framed([], {"session_id": "c" * 32, "close": True})) == {"closed": True}
    assert client.loop.run(client.call_info(peer))["sessions"] == 0
    assert ended(client, stream)  # then the server ends the stream
    close(client, stream)


def test_closing_a_stream_that_never_stepped_is_answered(server_and_client) -> None:
    swarm, client = server_and_client
    stream = raw_stream(client, swarm.servers[0].peer_id)
    assert exchange(client, stream, framed([], {"session_id": "n" * 32, "close": True})) == {"closed": True}
    close(client, stream)


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


def test_a_step_whose_header_fills_its_frame_is_refused_unparsed_and_its_stream_ended(
        tiny_model: Path, server_and_client) -> None:
    swarm, client = server_and_client
    hidden_size, peer = ModelSpec.open(tiny_model).hidden_size, swarm.servers[1].peer_id  # a default cache budget
    stream = raw_stream(client, peer)
    # a session whose step frames may be over 1 MiB (4 rows x 1024 tokens)
    assert exchange(client, stream, opening("h" * 32, batch_size=4, max_length=1024))["opened"]
    # Given a step frame of 1 MiB whose msgpack header is a million empty arrays (seconds and hundreds of MiB to unpack)
    bomb = (1 << 20).to_bytes(4, "big") + b"\x90" * (1 << 20)
    refused = client.loop.run(client.call_info(peer))["errors"].get("invalid_request", 0)
    try:
        meta = exchange(client, stream, protocol.length_prefixed(bomb))
    except ConnectionError:  # p2pd resets a stream ended with bytes unread, and the answer may go with it
        meta = {}
    # Then it is refused by its header's length, unparsed (having read its first 12 bytes:
    # tests/servers/test_member_limits.py), and the stream is ended, as for any oversized message
    code, text = protocol.response_error(meta) or (protocol.ErrorCode.INVALID, "frame header of 1048576 bytes")
    assert code == protocol.ErrorCode.INVALID and "frame header of 1048576 bytes" in text
    assert client.loop.run(client.call_info(peer))["errors"]["invalid_request"] == refused + 1
    close(client, stream)
    # and the server serves the next session
    stream = raw_stream(client, peer)
    assert exchange(client, stream, opening("i" * 32, batch_size=4, max_length=1024))["opened"]
    answer = exchange(client, stream, framed(good_inputs(hidden_size, batch=4), {"session_id": "i" * 32}))
    assert protocol.response_error(answer) is None and answer["cache_len"] == 4
    close(client, stream)
