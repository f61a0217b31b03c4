"""Sessions outlive their stream (servers/handler.py: detached sessions, resume): a client whose connection to a
server is cut mid-session resumes the session there on a new stream, replaying nothing, with the same tokens; no
other caller can resume it; a session nobody resumes is freed after the server's grace. Real processes, 127.0.0.1."""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from generation_checks import greedy_tokens, reference_tokens
from hivemind.p2p import PeerID
from raw_streams import answer_frame, close, error_code, exchange, exchange_frame, framed, raw_stream, send
from server_calls import eventually, info, inputs
from test_swarm_generation import PROMPTS
from test_wan import wait_for_log
from tiers import process_fixture

from launch.local_swarm import LocalSwarm
from swarmclient.config import ClientConfig
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.swarm import Swarm
from swarmclient.textgen import load_tokenizer
from swarmnet import protocol
from swarmnet.membership import CLIENT, SwarmAccess
from swarmnet.model_spec import ModelSpec

GRACE = 4.0  # the servers' --session-grace
MAX_NEW_TOKENS = 24
CUT_AT = (4, 13)
OTHER = "other-client"  # the tokens after which the client's connection to the second server is cut


@process_fixture(scope="module")
def resumable(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    """A private swarm of two servers splitting the tiny model's 6 blocks at 3: each the only holder of its span, so
    a session that lost its stream can go on only by resuming."""
    swarm = LocalSwarm(tiny_model, [(0, 3), (3, 6)], log_dir=tmp_path_factory.mktemp("resume"), private=True,
                       server_args=["--session-grace", str(GRACE)])
    swarm.new_member(OTHER, CLIENT)  # a second client member, known to the servers from their start
    with swarm:
        yield swarm


def member(swarm: LocalSwarm, model: Path, key: Path | None = None) -> Swarm:
    """A client of the swarm: the swarm's client member, or the member of `key`."""
    spec = ModelSpec.open(model)
    access = swarm.access() if key is None else SwarmAccess.load(swarm.swarm_file, key)
    return Swarm.connect(swarm.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks, access=access)


def cut(client: Swarm, peer_id: str) -> None:
    """Cut the client's connection to a server: every stream on it is reset, as a relay resets one at its cap."""
    client.loop.run(client.p2p._client.disconnect(PeerID.from_base58(peer_id)))


@pytest.mark.parametrize("push", [True, False], ids=["push", "no-push"])
def test_a_session_whose_connection_is_cut_resumes_on_the_same_server_with_local_greedy_tokens(
        tiny_model: Path, resumable: LocalSwarm, push: bool) -> None:
    batch = load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True)
    expected = reference_tokens(tiny_model, batch, MAX_NEW_TOKENS)
    server = resumable.servers[1]
    resumed_before = server.log_path.read_text().count("resumed by")
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=resumable.initial_peers,
                                                     access=resumable.access(), config=ClientConfig(push=push)) as model:
        session = model.inference_session(batch_size=len(PROMPTS),
                                          max_length=batch.input_ids.shape[1] + MAX_NEW_TOKENS)

        def on_token(index: int, _: torch.Tensor) -> None:
            if index in CUT_AT:  # mid-session: the next step finds its stream to the second server gone
                cut(model.swarm, server.peer_id)

        with session:
            tokens = greedy_tokens(model, session, batch, MAX_NEW_TOKENS, on_token)
    # Then every cut was followed by a resume on the same server, no replay anywhere, and local greedy's tokens
    assert torch.equal(tokens, expected)
    assert (session.reattachments, session.failovers) == (len(CUT_AT), 0)
    log = server.log_path.read_text()
    assert log.count("resumed by") - resumed_before == len(CUT_AT), log[-3000:]
    # and the sessions were closed at the end, not left detached (well within the grace)
    client = member(resumable, tiny_model)
    try:
        assert all(eventually(lambda s=s: info(client, s.peer_id)["sessions"] == 0, timeout=GRACE / 2)
                   for s in resumable.servers)
    finally:
        client.close()


def test_only_the_caller_that_opened_a_session_can_resume_it(tiny_model: Path, resumable: LocalSwarm) -> None:
    owner = member(resumable, tiny_model)
    other = member(resumable, tiny_model, resumable.new_key(OTHER))
    peer = resumable.servers[0].peer_id
    try:
        # Given a session of the owner, one step applied, whose stream then ends without a close message
        session_id = uuid.uuid4().hex
        stream = raw_stream(owner, peer)
        send(owner, stream, framed([], {**owner.auth_meta(), "open": True, "resumable": True, "session_id": session_id,
                                        "start": 0, "end": 3, "batch_size": 1, "max_length": 8}))
        assert protocol.decode(answer_frame(owner, stream))[1]["opened"] is True
        first = exchange_frame(owner, stream, framed(inputs(4), {"session_id": session_id, "step_id": 0}))
        close(owner, stream)
        wait_for_log(resumable.servers[0], f"Session {session_id[:8]} of {owner.p2p.peer_id.to_base58()[-6:]} detached")

        def resume(client: Swarm, sid: str) -> dict[str, object]:
            return exchange(client, raw_stream(client, peer), framed([], {**client.auth_meta(), "resume": True,
                                                                        "session_id": sid}))
        # When another member of the swarm asks to resume it, it is told what it would be told of a session that
        # never was: nothing says the session exists
        stolen, never = resume(other, session_id), resume(other, "f" * 32)
        assert error_code(stolen) is error_code(never) is protocol.ErrorCode.UNKNOWN_SESSION
        assert str(stolen["error"]).replace(session_id, "f" * 32) == str(never["error"])
        # ... while the owner resumes it where it was: one step applied, 4 tokens cached
        stream = raw_stream(owner, peer)
        resumed = exchange(owner, stream, framed([], {**owner.auth_meta(), "resume": True, "session_id": session_id}))
        assert (resumed["resumed"], resumed["applied"], resumed["cache_len"]) == (True, 1, 4)
        # and a step it resends is answered as before, uncomputed; the next is computed on the kept cache
        assert exchange_frame(owner, stream, framed(inputs(4), {"session_id": session_id, "step_id": 0})) == first
        hidden, _, _ = inputs(1)
        step = framed([hidden, torch.ones(1, 5, dtype=torch.long), torch.tensor([[4]])],
                      {"session_id": session_id, "step_id": 1})
        assert protocol.decode(exchange_frame(owner, stream, step))[1]["cache_len"] == 5
        assert exchange(owner, stream, framed([], {"session_id": session_id, "close": True})) == {"closed": True}
    finally:
        owner.close()
        other.close()


def test_a_detached_session_keeps_its_cache_until_the_grace_ends(tiny_model: Path, resumable: LocalSwarm) -> None:
    owner = member(resumable, tiny_model)
    server = resumable.servers[0]
    try:
        assert eventually(lambda: info(owner, server.peer_id)["sessions"] == 0, timeout=GRACE + 10)
        idle = info(owner, server.peer_id)
        # Given a session whose stream ended without a close message
        session_id = uuid.uuid4().hex
        stream = raw_stream(owner, server.peer_id)
        send(owner, stream, framed([], {**owner.auth_meta(), "open": True, "resumable": True, "session_id": session_id,
                                        "start": 0, "end": 3, "batch_size": 2, "max_length": 64}))
        assert protocol.decode(answer_frame(owner, stream))[1]["opened"] is True
        close(owner, stream)
        wait_for_log(server, f"Session {session_id[:8]} of")
        began = time.monotonic()
        # Then while detached it still holds its cache, counted against its owner's share
        detached = info(owner, server.peer_id)
        assert detached["sessions"] == idle["sessions"] + 1
        assert detached["cache_tokens_left"] == idle["cache_tokens_left"] - 128
        assert detached["cache_tokens_for_caller"] == idle["cache_tokens_for_caller"] - 128
        # and once the grace is over it is freed (one line says so), its cache back, and it cannot be resumed
        assert eventually(lambda: info(owner, server.peer_id)["cache_tokens_left"] == idle["cache_tokens_left"],
                          timeout=GRACE + 10)
        assert time.monotonic() - began > GRACE - 1.5
        wait_for_log(server, f"Session {session_id[:8]} freed: its client did not resume it within {GRACE:g} s")
        late = exchange(owner, raw_stream(owner, server.peer_id),
                        framed([], {**owner.auth_meta(), "resume": True, "session_id": session_id}))
        assert error_code(late) is protocol.ErrorCode.UNKNOWN_SESSION
    finally:
        owner.close()

