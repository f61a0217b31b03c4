"""What one caller (a peer id) can take from a server is bounded: sessions, KV cache, queued forwards, and time.

Real servers and two real clients (two peers); the bad requests are sent for real, as raw frames.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from raw_streams import (
    Stream,
    answer,
    answer_frame,
    close,
    ended,
    error_code,
    exchange,
    framed,
    opening,
    raw_stream,
    send,
)
from server_calls import eventually, info, inputs, session, two_clients
from tiers import process_fixture

from launch.local_swarm import LocalSwarm
from swarmclient.errors import PeerFailed
from swarmclient.session import InferenceSession
from swarmclient.swarm import Swarm
from swarmnet import protocol

CACHE_TOKENS = 64  # per block; one caller may reserve half: 32
SESSION_TIMEOUT = 2.0  # server 1's


@process_fixture(scope="module")
def limited(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalSwarm, Swarm, Swarm]]:
    """Server 0: small per-caller limits, held even by a caller alone (no lending: test_cache_lending.py); server 1:
    a short session timeout. Two clients: two peers."""
    with LocalSwarm(tiny_model, [], log_dir=tmp_path_factory.mktemp("limits")) as swarm:
        swarm.start_servers([(0, 6, ["--attn-cache-tokens", str(CACHE_TOKENS), "--max-sessions-per-peer", "2",
                                     "--max-queued-forwards", "3", "--max-forwards-per-peer", "2",
                                     "--no-lend-idle-cache"]),
                             (0, 6, ["--session-timeout", str(SESSION_TIMEOUT)])])
        with two_clients(swarm, tiny_model) as (first, second):
            yield swarm, first, second


@pytest.fixture
def clean(limited) -> Iterator[tuple[LocalSwarm, Swarm, Swarm]]:
    """The module's swarm; each test leaves no session or forward behind on either server."""
    yield limited
    swarm, client, _ = limited
    for server in swarm.servers:
        assert eventually(lambda s=server: (lambda i: i["sessions"] == 0 and i["forwards"] == 0)(
            info(client, s.peer_id))), f"{server.name} still holds a session or a forward"


def test_an_opening_step_without_tensors_reserves_nothing_and_honest_callers_get_the_cache(clean) -> None:
    swarm, attacker, honest = clean
    peer = swarm.servers[0].peer_id
    # the old protocol opened a session at its first step, and reserved its cache before checking the tensors
    old_opening = framed([], {"session_id": "x" * 8, "start": 0, "end": 6, "batch_size": 1, "max_length": 64})
    assert len(old_opening) == 88  # the length prefix included
    # and open messages refused for what they carry: nothing of them is kept either
    bad_opens = [framed(inputs(1), {"open": True, "session_id": "t" * 32, "start": 0, "end": 6, "batch_size": 1,
                                    "max_length": 8}),
                 opening("b" * 32, batch_size=999), opening("s" * 32, start=0, end=7)]
    streams: list[Stream] = []
    for payload in [old_opening] * 4 + bad_opens:
        stream = raw_stream(attacker, peer)
        streams.append(stream)
        assert error_code(exchange(attacker, stream, payload)) in (protocol.ErrorCode.UNKNOWN_SESSION,
                                                                 protocol.ErrorCode.INVALID)
    figures = info(honest, peer)  # while every refused stream is still open
    assert (figures["sessions"], figures["cache_tokens_left"]) == (0, CACHE_TOKENS)
    served = session(honest, peer, max_length=32)  # one caller's whole share
    honest.loop.run(served.close())
    for stream in streams:
        close(attacker, stream)


def test_a_caller_past_its_session_limit_is_busy_while_another_caller_is_served(clean) -> None:
    swarm, greedy, other = clean
    peer = swarm.servers[0].peer_id
    held = [session(greedy, peer), session(greedy, peer)]
    with pytest.raises(PeerFailed, match="busy: this caller already has 2 sessions"):
        session(greedy, peer)
    served = session(other, peer)
    figures = info(other, peer)
    assert figures["sessions"] == 3 and figures["cache_tokens_left"] == CACHE_TOKENS - 3 * 8  # the refused one took none
    assert figures["errors"].get("busy", 0) >= 1
    for opened, client in [(held[0], greedy), (held[1], greedy), (served, other)]:
        client.loop.run(opened.close())


def test_a_caller_past_its_cache_share_is_busy_while_another_caller_is_served(clean) -> None:
    swarm, greedy, other = clean
    peer = swarm.servers[0].peer_id
    held = session(greedy, peer, max_length=24)
    with pytest.raises(PeerFailed, match="busy: session needs 96 block-tokens and this caller holds 144"):
        session(greedy, peer, max_length=16)  # 24 + 16 tokens: past the 32 a caller may hold
    served = session(other, peer, max_length=32)
    assert info(other, peer)["cache_tokens_left"] == CACHE_TOKENS - 24 - 32
    greedy.loop.run(held.close())
    other.loop.run(served.close())


def test_a_busy_server_is_routed_around_like_a_full_one(clean) -> None:
    swarm, client, _ = clean
    full, free = (server.peer_id for server in swarm.servers)
    held = [session(client, full), session(client, full)]
    client.rtts.update({full: 0.0001, free: 1.0})  # the route tries the busy server first
    client.pinged_at.update(dict.fromkeys((full, free), time.monotonic()))  # fresh: no ping may overwrite them
    with InferenceSession(client, batch_size=1, max_length=8) as chain:
        output = chain.step(*inputs(4))
        assert [hop.peer_id for hop in chain.route] == [free]
        # skipped for a moment, not banned: it is healthy, and room comes back as sessions end
        assert full in client.full_until and not client.bans.is_banned(full)
    assert output.shape == (1, 4, 64)
    for opened in held:
        client.loop.run(opened.close())


def forward_header(length: int = 4) -> bytes:
    return framed([], {"start": 0, "end": 6, "batch_size": 1, "length": length, "dtype": "float32"})


def test_forwards_in_flight_are_bounded_per_caller_and_per_server(clean) -> None:
    swarm, first, second = clean
    peer = swarm.servers[0].peer_id
    # a forward holds its slot from its admitted header to its answer: headers alone hold them here
    held = [raw_stream(first, peer, protocol.RPC_FORWARD) for _ in range(2)]
    for stream in held:
        assert exchange(first, stream, forward_header()) == {"admitted": True}
    third = raw_stream(first, peer, protocol.RPC_FORWARD)
    meta = exchange(first, third, forward_header())
    assert error_code(meta) == protocol.ErrorCode.BUSY and "this caller already has 2" in str(meta)
    close(first, third)
    other = raw_stream(second, peer, protocol.RPC_FORWARD)
    assert exchange(second, other, forward_header()) == {"admitted": True}
    assert info(second, peer)["forwards"] == 3
    _, meta = second.loop.run(second.call_forward(peer, 0, 6, inputs(4)))
    assert error_code(meta) == protocol.ErrorCode.BUSY and "this server already has 3" in str(meta)
    # one held forward completes: its slot is free again for anyone
    send(first, held[0], framed(inputs(4), {}))
    (output,), meta = protocol.decode(answer_frame(first, held[0]))
    assert protocol.response_error(meta) is None and output.shape == (1, 4, 64)
    (output,), meta = second.loop.run(second.call_forward(peer, 0, 6, inputs(4)))
    assert protocol.response_error(meta) is None and output.shape == (1, 4, 64)
    for client, stream in [(first, held[0]), (first, held[1]), (second, other)]:
        close(client, stream)


def test_refused_messages_do_not_keep_an_idle_session_alive(clean) -> None:
    swarm, client, _ = clean
    peer = swarm.servers[1].peer_id  # closes a stream SESSION_TIMEOUT s after its last accepted message
    stream = raw_stream(client, peer)
    send(client, stream, opening("k" * 32) + framed(inputs(2), {"session_id": "k" * 32}))
    assert answer(client, stream)["opened"] and answer(client, stream)["cache_len"] == 2
    refusals, deadline = 0, time.monotonic() + 20 * SESSION_TIMEOUT
    while time.monotonic() < deadline:  # a refused message (another session's step) every 0.2 s
        try:
            meta = exchange(client, stream, framed(inputs(1), {"session_id": "other"}))
        except Exception:  # the server ended the stream
            break
        assert error_code(meta) == protocol.ErrorCode.UNKNOWN_SESSION
        refusals += 1
        time.sleep(0.2)
    assert time.monotonic() < deadline and refusals >= 1, "the refused messages kept the session alive"
    assert eventually(lambda: info(client, peer)["sessions"] == 0)
    close(client, stream)


def test_a_stream_of_refused_messages_without_a_session_is_ended(clean) -> None:
    swarm, client, _ = clean
    stream = raw_stream(client, swarm.servers[0].peer_id)
    send(client, stream, protocol.length_prefixed(b"\x00\x00\x00\x03abc") * 8)  # 8 undecodable messages at once
    assert [error_code(answer(client, stream)) for _ in range(8)] == [protocol.ErrorCode.INVALID] * 8
    assert ended(client, stream)
    close(client, stream)


def test_an_admitted_forward_whose_tensors_never_come_frees_its_slot_after_the_timeout(clean) -> None:
    swarm, client, _ = clean
    peer = swarm.servers[1].peer_id
    stream = raw_stream(client, peer, protocol.RPC_FORWARD)
    assert exchange(client, stream, forward_header()) == {"admitted": True}
    assert info(client, peer)["forwards"] == 1
    assert ended(client, stream, timeout=20 * SESSION_TIMEOUT)
    assert info(client, peer)["forwards"] == 0
    close(client, stream)
