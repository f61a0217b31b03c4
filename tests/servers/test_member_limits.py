"""Members stay within their share (issue 28: N6, N7, N15): per-caller limits count per member, not per the ephemeral
peer ids its credentials are made for; lent cache is taken back once another member waits; a forward is capped by a
token budget and a frame by its header; streams per peer are capped; a member removed from the swarm file loses its
open sessions at their next step.

Real handlers of the tiny model in this process, over socket pairs (tests/servers/in_process.py), behind the real
membership gate of a real swarm file; the callers' messages are raw frames, sent as a misbehaving member would.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from in_process import Caller, Streams, Wires, nothing_within, peer, read, run, send

import servers.handler
from servers.access import MemberGate
from servers.block_loading import load_span
from servers.handler import BlockHandler
from servers.memory import CacheBudget
from servers.span import BlockSpan
from servers.validation import Limits
from swarmnet import protocol
from swarmnet.identity import Identity
from swarmnet.membership import MemberCredential, Membership, SwarmFile
from swarmnet.model_spec import ModelSpec
from swarmnet.protocol import ErrorCode

SERVER = "server"
CACHE_TOKENS = 64  # per block; a caller's share: 32; lent to a caller alone: 48


@pytest.fixture(scope="module")
def span(tiny_model: Path) -> BlockSpan:
    return load_span(ModelSpec.open(tiny_model), 0, 6)


@pytest.fixture
def swarm_file(tmp_path: Path, keys: dict[str, Identity]) -> Path:
    """Two members: alice (the "member" key) and bob (the "server" key, here a client's member key)."""
    swarm = SwarmFile(tmp_path / "swarm.json", {keys["member"].peer_id: "alice", keys["server"].peer_id: "bob"})
    swarm.save()
    return swarm.path


def private_server(wires: Wires, span: BlockSpan, swarm_file: Path, *, lend: bool = False,
                   limits: Limits | None = None, cache_tokens: int = CACHE_TOKENS, **options: Any) -> BlockHandler:
    """A handler of the span's 6 blocks as peer SERVER, admitting the swarm file's members (re-read at every look)."""
    membership = Membership.from_file(swarm_file, recheck=0.0)
    handler = BlockHandler(span, limits or Limits(0, 6, span.spec.hidden_size, 8, 256),
                           CacheBudget(cache_tokens, 6, owner_share=0.5, lend=lend),
                           status=lambda: None,  # type: ignore[arg-type,return-value]
                           authorize=MemberGate(membership).check, membership=membership, **options)
    wires.handlers[peer(SERVER)] = handler
    return handler


def credential(key: Identity, caller: str) -> dict[str, bytes]:
    """A first message's credential of `key` for the client process `caller` (a peer id of its own)."""
    return {"credential": MemberCredential.issue(key, peer(caller), int(time.time()) + 3600).to_bytes()}


def inputs(span: BlockSpan, past: int, tokens: int, rows: int = 1) -> list[torch.Tensor]:
    """A step's tensors (hidden, mask, positions)."""
    hidden = torch.randn(rows, tokens, span.spec.hidden_size, generator=torch.Generator().manual_seed(past))
    return [hidden, torch.ones(rows, past + tokens, dtype=torch.long),
            torch.arange(past, past + tokens).expand(rows, tokens)]


async def open_session(wires: Wires, caller: str, key: Identity, max_length: int) -> tuple[Streams, dict[str, Any]]:
    """A session of one row over the 6 blocks, opened by `caller` with `key`'s credential: (stream, its answer)."""
    stream = await wires.open(peer(caller), peer(SERVER), protocol.RPC_INFERENCE)
    session_id = uuid.uuid4().hex
    await send(stream, [], {"open": True, "session_id": session_id, "start": 0, "end": 6, "batch_size": 1,
                            "max_length": max_length, **credential(key, caller)})
    answer = await read(stream)
    assert answer is not None
    return stream, {**answer[1], "session_id": session_id}


def code_of(meta: dict[str, Any]) -> ErrorCode | None:
    error = protocol.response_error(meta)
    return None if error is None else error[0]


# ---- N6: a caller is a member ------------------------------------------------------------------------------------
def test_two_credentials_of_one_member_key_on_two_peer_ids_reserve_one_share_together(
        span: BlockSpan, swarm_file: Path, keys: dict[str, Identity]) -> None:
    async def test(wires: Wires) -> None:
        handler = private_server(wires, span, swarm_file)
        # Given alice's first client process holding her whole share (32 tokens per block)
        _, first = await open_session(wires, "alice-1", keys["member"], 32)
        assert first.get("opened") is True
        # When her second process, another peer id with a credential of the same key, asks for more
        _, second = await open_session(wires, "alice-2", keys["member"], 8)
        # Then it is refused as over her share (before: a second share, and bob found 24 tokens of the 64)
        assert code_of(second) is ErrorCode.BUSY and "holds 192 of the 192 one caller may reserve" in str(second)
        assert handler.budget.used_by(keys["member"].peer_id) == 32 * 6 and len(handler.sessions) == 1
        # and another member gets his whole share
        _, bobs = await open_session(wires, "bob-1", keys["server"], 32)
        assert bobs.get("opened") is True
        assert handler.budget.owners() == {keys["member"].peer_id, keys["server"].peer_id}
    run(test)


async def forward_header(wires: Wires, caller: str, key: Identity, *, rows: int = 1, length: int = 4
                         ) -> tuple[Streams, dict[str, Any]]:
    """A forward's header sent by `caller` (its tensors not sent): (stream, the answer)."""
    stream = await wires.open(peer(caller), peer(SERVER), protocol.RPC_FORWARD)
    await send(stream, [], {"start": 0, "end": 6, "batch_size": rows, "length": length, "dtype": "float32",
                            **credential(key, caller)})
    answer = await read(stream)
    assert answer is not None
    return stream, answer[1]


def test_four_stalled_forward_headers_of_one_member_leave_a_slot_for_another_members_forward(
        span: BlockSpan, swarm_file: Path, keys: dict[str, Identity]) -> None:
    async def test(wires: Wires) -> None:
        handler = private_server(wires, span, swarm_file)  # 4 forwards in all, 2 per caller (the defaults)
        # Given alice sending four forward headers from two peer ids, and never their tensors
        answers = [(await forward_header(wires, f"alice-{i % 2}", keys["member"]))[1] for i in range(4)]
        # Then only two are admitted: her share of the forward slots (before: all four, every slot of the server)
        assert [a.get("admitted") is True for a in answers] == [True, True, False, False]
        assert [code_of(a) for a in answers[2:]] == [ErrorCode.BUSY] * 2 and handler.forwards.in_use == 2
        # and bob's forward is admitted and computed
        stream, admitted = await forward_header(wires, "bob", keys["server"])
        assert admitted == {"admitted": True}
        await send(stream, inputs(span, 0, 4), {})
        answer = await read(stream)
        assert answer is not None and answer[0][0].shape == (1, 4, span.spec.hidden_size)
    run(test)


def test_an_admitted_forward_whose_tensors_do_not_come_at_the_minimum_rate_frees_its_slot(
        span: BlockSpan, swarm_file: Path, keys: dict[str, Identity], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(servers.handler, "FORWARD_GRACE", 0.5)  # 10 s, shortened for the test

    async def test(wires: Wires) -> None:
        handler = private_server(wires, span, swarm_file)  # session timeout: 300 s
        stream, admitted = await forward_header(wires, "alice", keys["member"])
        assert admitted == {"admitted": True} and handler.forwards.in_use == 1
        # a tiny forward's tensors get the grace and their bytes at 256 KiB/s: under a second (before: the session
        # timeout, 300 s)
        began = time.perf_counter()
        while handler.forwards.in_use and time.perf_counter() - began < 5:
            await asyncio.sleep(0.05)
        assert handler.forwards.in_use == 0 and time.perf_counter() - began < 2
        assert await read(stream, timeout=5) is None  # and the stream is ended
    run(test)


# ---- N6: lent cache is given back ------------------------------------------------------------------------------
def test_a_borrowers_sessions_over_its_share_are_ended_busy_once_another_member_waits(
        span: BlockSpan, swarm_file: Path, keys: dict[str, Identity]) -> None:
    async def test(wires: Wires) -> None:
        handler = private_server(wires, span, swarm_file, lend=True, lent_cache_grace=0.3)
        # Given alice alone on the server, lent 48 tokens of 64: two sessions of 24, both stepping
        older, opened = await open_session(wires, "alice-1", keys["member"], 24)
        newer, opened_too = await open_session(wires, "alice-2", keys["member"], 24)
        assert opened.get("opened") and opened_too.get("opened")
        for stream, meta in ((older, opened), (newer, opened_too)):
            await send(stream, inputs(span, 0, 4), {"session_id": meta["session_id"]})
            assert (await read(stream) or ([], {}))[1].get("cache_len") == 4
        # When bob asks for his share (32) and finds 16 free
        _, refused = await open_session(wires, "bob", keys["server"], 32)
        assert code_of(refused) is ErrorCode.CACHE_FULL
        # Then within the grace alice's newest session is ended as busy (her client replays it elsewhere), and
        # her older one, within her share, goes on
        began = time.perf_counter()
        ended = await read(newer, timeout=5)
        assert ended is not None and code_of(ended[1]) is ErrorCode.BUSY and "another caller" in str(ended[1])
        assert await read(newer, timeout=5) is None
        print(f"\nthe lent session was ended {time.perf_counter() - began:.2f} s after the refusal (grace 0.3 s)")
        await send(older, inputs(span, 4, 1), {"session_id": opened["session_id"]})
        assert (await read(older) or ([], {}))[1].get("cache_len") == 5
        # and bob, retrying, gets his share (before: alice kept 48 tokens for as long as she stepped)
        _, retried = await open_session(wires, "bob", keys["server"], 32)
        assert retried.get("opened") is True
        assert handler.budget.used_by(keys["member"].peer_id) == 24 * 6
    run(test)


# ---- N7: a forward's token budget, a frame's header ---------------------------------------------------------------
def test_a_forward_header_of_64_rows_of_8192_tokens_is_refused_before_any_tensor_is_read(
        span: BlockSpan, swarm_file: Path, keys: dict[str, Identity]) -> None:
    async def test(wires: Wires) -> None:
        # a server whose sessions may have 64 rows and 8192 tokens (SmolLM2's context)
        handler = private_server(wires, span, swarm_file, limits=Limits(0, 6, span.spec.hidden_size, 64, 8192))
        # a forward of 64 x 8192 tokens: a frame of 134 MiB here (1.13 GiB for SmolLM2) and a 4 GiB mask
        stream, answer = await forward_header(wires, "alice", keys["member"], rows=64, length=8192)
        assert code_of(answer) is ErrorCode.INVALID and "--max-forward-tokens" in str(answer), answer
        assert await read(stream) is None and handler.forwards.in_use == 0
        # one at the budget (16,384 tokens) is admitted
        stream, answer = await forward_header(wires, "alice", keys["member"], rows=64, length=256)
        assert answer == {"admitted": True}
    run(test)


def test_a_frame_whose_header_is_over_the_cap_is_refused_having_read_twelve_bytes_of_it(
        span: BlockSpan, swarm_file: Path, keys: dict[str, Identity]) -> None:
    async def test(wires: Wires) -> None:
        private_server(wires, span, swarm_file, limits=Limits(0, 6, span.spec.hidden_size, 8, 2048),
                       cache_tokens=16384)
        # Given a session whose steps may be 2.2 MiB (4 rows x 2048 tokens)
        stream = await wires.open(peer("alice"), peer(SERVER), protocol.RPC_INFERENCE)
        await send(stream, [], {"open": True, "session_id": "h" * 32, "start": 0, "end": 6, "batch_size": 4,
                                "max_length": 2048, **credential(keys["member"], "alice")})
        assert (await read(stream) or ([], {}))[1].get("opened") is True
        # When a step of 2 MiB declares a header of 1 MiB (a million empty arrays: seconds to unpack) and only its
        # first 64 KiB are sent
        began = time.perf_counter()
        frame_length, header_length = 2 << 20, 1 << 20
        stream[1].write(frame_length.to_bytes(8, "big") + header_length.to_bytes(4, "big") + b"\x90" * (1 << 16))
        await stream[1].drain()
        # Then it is refused at once, by the header's length, without waiting for the rest (before: the server read
        # on, waiting for the other 1.9 MiB), and the stream is ended (it cannot be resynchronized)
        answer = await read(stream, timeout=5)
        assert answer is not None, "no answer: the server waited for the whole frame"
        assert code_of(answer[1]) is ErrorCode.INVALID and "frame header of 1048576 bytes" in str(answer[1])
        print(f"\nrefused {(time.perf_counter() - began) * 1000:.1f} ms after 12 + 65536 bytes were sent")
        assert await read(stream) is None
    run(test)


# ---- N15: streams per peer, removed members ---------------------------------------------------------------------
def test_streams_one_peer_id_holds_open_are_capped_and_other_peers_are_served(
        span: BlockSpan, swarm_file: Path, keys: dict[str, Identity]) -> None:
    async def test(wires: Wires) -> None:
        handler = private_server(wires, span, swarm_file, max_streams_per_peer=3)
        # Given a peer holding three streams open without a word
        held = [await wires.open(peer("idle"), peer(SERVER), protocol.RPC_INFERENCE) for _ in range(3)]
        await asyncio.sleep(0.1)
        assert handler.streams_by_peer[peer("idle")] == 3
        # When it opens a fourth, Then it is answered busy at once and ended
        extra = await wires.open(peer("idle"), peer(SERVER), protocol.RPC_INFO)
        answer = await read(extra, timeout=5)
        assert answer is not None and code_of(answer[1]) is ErrorCode.BUSY and "3 streams" in str(answer[1])
        extra[1].close()
        # and another peer is served
        info = await wires.open(peer("alice"), peer(SERVER), protocol.RPC_FORWARD)
        await send(info, [], {"start": 0, "end": 6, "batch_size": 1, "length": 4, "dtype": "float32",
                              **credential(keys["member"], "alice")})
        assert (await read(info) or ([], {}))[1] == {"admitted": True}
        # and once one of the idle peer's streams ends, it may open another
        held[0][1].close()
        await asyncio.sleep(0.1)
        again = await wires.open(peer("idle"), peer(SERVER), protocol.RPC_INFERENCE)
        assert await nothing_within(again, 0.3)  # served: waiting for its first message
        assert handler.streams_by_peer[peer("idle")] == 3
    run(test)


def test_a_removed_members_open_session_is_refused_and_ended_at_its_next_step(
        span: BlockSpan, swarm_file: Path, keys: dict[str, Identity]) -> None:
    async def test(wires: Wires) -> None:
        handler = private_server(wires, span, swarm_file)
        # Given alice's and bob's sessions, each one step in
        alices, alice = await open_session(wires, "alice", keys["member"], 16)
        bobs, bob = await open_session(wires, "bob", keys["server"], 16)
        for stream, meta in ((alices, alice), (bobs, bob)):
            await send(stream, inputs(span, 0, 4), {"session_id": meta["session_id"]})
            assert (await read(stream) or ([], {}))[1].get("cache_len") == 4
        # When alice is removed from the swarm file
        members = SwarmFile.load(swarm_file)
        members.remove("alice")
        members.save()
        # Then her next step is refused as unauthorized, her stream ended and her session freed
        await send(alices, inputs(span, 4, 1), {"session_id": alice["session_id"]})
        answer = await read(alices)
        assert answer is not None and code_of(answer[1]) is ErrorCode.UNAUTHORIZED
        assert "no longer a member" in str(answer[1])
        assert await read(alices) is None
        assert set(handler.sessions) == {bob["session_id"]} and handler.budget.owners() == {keys["server"].peer_id}
        # while bob's session steps on
        await send(bobs, inputs(span, 4, 1), {"session_id": bob["session_id"]})
        assert (await read(bobs) or ([], {}))[1].get("cache_len") == 5
    run(test)


def test_a_removed_members_push_session_is_ended_at_the_next_step_pushed_into_it(
        span: BlockSpan, swarm_file: Path, keys: dict[str, Identity]) -> None:
    async def test(wires: Wires) -> None:
        # Given a member server "up" (the outsider key, listed here) pushing into the private server's sessions
        members = SwarmFile.load(swarm_file)
        up_id = keys["outsider"].peer_id
        members.add(up_id, "up")
        members.save()
        down = private_server(wires, span, swarm_file)
        up = BlockHandler(span, Limits(0, 6, span.spec.hidden_size, 8, 256), CacheBudget(CACHE_TOKENS, 6),
                          status=lambda: None)  # type: ignore[arg-type,return-value]
        up.pusher.p2p = Caller(wires, up_id)  # type: ignore[assignment]
        up.pusher.identity = keys["outsider"]  # signs its pushes' proofs, as a server does with its peer key
        wires.handlers[up_id] = up
        # and alice's push sessions: blocks 0:3 on up, 3:6 on the private server, whose first step is pushed
        downstream = await wires.open(peer("alice"), peer(SERVER), protocol.RPC_INFERENCE)
        await send(downstream, [], {"open": True, "push": True, "session_id": "d" * 32, "start": 3, "end": 6,
                                    "batch_size": 1, "max_length": 16, **credential(keys["member"], "alice")})
        assert (await read(downstream) or ([], {}))[1].get("opened") is True
        upstream = await wires.open(peer("alice"), up_id, protocol.RPC_INFERENCE)
        await send(upstream, [], {"open": True, "push": True, "session_id": "u" * 32, "start": 0, "end": 3,
                                  "batch_size": 1, "max_length": 16})
        assert (await read(upstream) or ([], {}))[1].get("opened") is True
        route = [[peer(SERVER), "d" * 32]]
        await send(upstream, inputs(span, 0, 4), {"session_id": "u" * 32, "step_id": 0, "route": route})
        assert (await read(upstream) or ([], {}))[1].get("step_id") == 0
        assert (await read(downstream) or ([], {}))[1].get("cache_len") == 4  # pushed, computed, answered
        # When alice is removed from the swarm file, and her next step is pushed into her session
        members.remove("alice")
        members.save()
        await send(upstream, inputs(span, 4, 1), {"session_id": "u" * 32, "step_id": 1, "route": route})
        # Then the private server ends her session's stream as unauthorized and refuses the push
        answer = await read(downstream)
        assert answer is not None and code_of(answer[1]) is ErrorCode.UNAUTHORIZED, answer
        assert await read(downstream) is None
        assert down.sessions == {} and down.stats.steps == 1
        # and up tells alice that the push failed (her client would send the step there itself, and be refused)
        answers = [await read(upstream), await read(upstream)]
        failed = [a[1]["push_failed"] for a in answers if a is not None and "push_failed" in a[1]]
        assert failed and failed[0]["peer"] == peer(SERVER) and "closed" in failed[0]["reason"]
    run(test)
