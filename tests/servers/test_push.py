"""Server-to-server push (ClientConfig.push): the client sends each step to the first server only, each server pushes
its outputs to the next; tokens stay those of local greedy generation, a killed middle server is routed around, a
step is applied once however often it arrives, and only members push, into sessions opened for push."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from raw_streams import error_code, exchange, framed, raw_stream
from test_swarm_generation import PROMPTS, reference_tokens
from tiers import process_fixture

from launch.local_swarm import LocalSwarm
from swarmclient.config import ClientConfig
from swarmclient.generation import generate_tokens
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.session import InferenceSession, ServerSession
from swarmclient.swarm import Swarm
from swarmclient.textgen import load_tokenizer
from swarmnet import protocol
from swarmnet.data_structures import RouteHop
from swarmnet.model_spec import ModelSpec

PUSH = ClientConfig(push=True)


@process_fixture(scope="module")
def three_servers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    """The tiny model's 6 blocks on three servers, two each."""
    with LocalSwarm(tiny_model, [(0, 2), (2, 4), (4, 6)], log_dir=tmp_path_factory.mktemp("push-swarm")) as swarm:
        yield swarm


@process_fixture()
def client(tiny_model: Path, three_servers: LocalSwarm) -> Iterator[Swarm]:
    spec = ModelSpec.open(tiny_model)
    swarm = Swarm.connect(three_servers.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks, config=PUSH)
    yield swarm
    swarm.close()


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[2:3]], ids=["batch-4", "batch-1"])
def test_pushed_generation_through_three_servers_equals_transformers(tiny_model: Path, three_servers: LocalSwarm,
                                                                    prompts: list[str]) -> None:
    batch = load_tokenizer(tiny_model)(prompts, return_tensors="pt", padding=True)
    expected = reference_tokens(tiny_model, batch, 24)
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=three_servers.initial_peers,
                                                     config=PUSH) as model:
        got = model.generate(batch.input_ids, batch.attention_mask, max_new_tokens=24)
    assert torch.equal(got[:, batch.input_ids.shape[1]:], expected)


def steps(hidden_size: int, *, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int] | None]]:
    """A prefill of 4 rows x 5 tokens, two decode steps, one that keeps rows 0 and 2, and two more decode steps."""
    generator = torch.Generator().manual_seed(seed)
    plan, rows, past = [], 4, 0
    for tokens, keep in [(5, None), (1, None), (1, None), (1, [0, 2]), (1, None), (1, None)]:
        rows = len(keep) if keep else rows
        hidden = torch.randn(rows, tokens, hidden_size, generator=generator)
        mask = torch.ones(rows, past + tokens, dtype=torch.long)
        positions = torch.arange(past, past + tokens).expand(rows, tokens).contiguous()
        plan.append((hidden, mask, positions, keep))
        past += tokens
    return plan


def test_pushed_steps_with_keep_rows_give_the_relayed_outputs(tiny_model: Path, client: Swarm) -> None:
    plan = steps(ModelSpec.open(tiny_model).config.hidden_size)
    relayed_client = Swarm(client.p2p, client.node, client.loop, model_id=client.model_id, num_blocks=client.num_blocks,
                           config=ClientConfig(push=False))
    outputs = {}
    for name, swarm in (("push", client), ("relay", relayed_client)):
        with InferenceSession(swarm, batch_size=4, max_length=16) as session:
            outputs[name] = [session.step(*step) for step in plan]
            assert len(session.route) == 3
    for pushed, relayed in zip(outputs["push"], outputs["relay"], strict=True):
        assert torch.allclose(pushed, relayed, atol=1e-5, rtol=0)


def test_a_step_pushed_and_sent_again_by_the_client_is_applied_once(tiny_model: Path, three_servers: LocalSwarm,
                                                                    client: Swarm) -> None:
    # Given push sessions on the first two servers, and what their blocks compute for two steps (relayed sessions)
    plan = steps(ModelSpec.open(tiny_model).config.hidden_size, seed=1)[:2]
    first, second = (RouteHop(three_servers.servers[i].peer_id, 2 * i, 2 * i + 2) for i in range(2))

    async def run() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        relayed = [ServerSession(client, hop, batch_size=4, max_length=16) for hop in (first, second)]
        pushed = [ServerSession(client, hop, batch_size=4, max_length=16, push=True) for hop in (first, second)]
        await asyncio.gather(*(s.open() for s in relayed + pushed))
        expected, got = [], []
        try:
            for step_id, (hidden, mask, positions, _) in enumerate(plan):
                middle = await relayed[0].step(hidden, mask, positions)
                expected.append(await relayed[1].step(middle, mask, positions))
                route = [[second.peer_id, pushed[1].session_id]]
                for session in pushed:
                    session.expect(hidden.shape, step_id)
                # When the first server pushes the step to the second while the client sends it there too (a retry)
                await pushed[0].send(hidden, mask, positions, None, step_id=step_id, route=route)
                if step_id == 0:
                    await pushed[1].send(middle, mask, positions, None, step_id=step_id)
                got.append(await pushed[1].answer(step_id, hidden.shape))
                await pushed[0].answer(step_id, hidden.shape)
            # and the client sends the first step once more, after the second one
            with pytest.raises(Exception, match="out of order"):
                await pushed[1].step(*plan[0][:3], step_id=0)
        finally:
            await asyncio.gather(*(s.close() for s in relayed + pushed))
        return expected, got

    expected, got = client.loop.run(run())
    # Then the second server applied each step once: a second copy of step 0 would have made step 1's shapes wrong
    for want, have in zip(expected, got, strict=True):
        assert torch.allclose(want, have, atol=1e-5, rtol=0)


def test_killing_the_middle_server_mid_generation_with_push_changes_no_token(tiny_model: Path, local_swarm) -> None:
    # Given four servers: the first and last blocks on one each, the middle blocks on two
    swarm = local_swarm(tiny_model, [(0, 2), (2, 4), (4, 6), (2, 4)])
    by_peer = {server.peer_id: server for server in swarm.servers}
    batch = load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True)
    expected = reference_tokens(tiny_model, batch, 32)
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers,
                                                     config=PUSH) as model:
        session = model.inference_session(batch_size=4, max_length=batch.input_ids.shape[1] + 32)
        stamps: list[float] = []
        killed: list[str] = []

        def on_token(index: int, _: torch.Tensor) -> None:
            stamps.append(time.perf_counter())
            if len(stamps) == 12:  # When the middle server of the route is killed -9 mid-generation
                killed.append(session.route[1].peer_id)
                by_peer[killed[0]].kill()

        with session:
            got = generate_tokens(model.head, session.step, batch.input_ids, batch.attention_mask, max_new_tokens=32,
                                  params=model.sampling_params(4, False, 1.0, 1.0, 0), eos_token_ids=model.eos_token_ids,
                                  pad_token_id=model.pad_token_id, on_token=on_token)
            route_after = session.route
    # Then the tokens are the same, through the other middle server, after a short stall
    assert killed and torch.equal(got, expected)
    assert session.failovers >= 1 and killed[0] not in [hop.peer_id for hop in route_after]
    stall = stamps[12] - stamps[11]
    print(f"\nfailover stall after kill -9 of the middle server (push): {stall:.2f} s")
    assert stall < 5.0


# ---- who may push ------------------------------------------------------------------------------------------------------
@process_fixture(scope="module")
def private_pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tiny_model, [(0, 3), (3, 6)], log_dir=tmp_path_factory.mktemp("push-private"), private=True) as swarm:
        yield swarm


def test_only_members_push_and_only_into_sessions_opened_for_push(tiny_model: Path, private_pair: LocalSwarm) -> None:
    spec = ModelSpec.open(tiny_model)
    member = Swarm.connect(private_pair.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks,
                           access=private_pair.access(), config=PUSH)
    outsider = Swarm.connect(private_pair.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks)
    target = RouteHop(private_pair.servers[1].peer_id, 3, 6)
    try:
        pushable = member.loop.run(ServerSession(member, target, batch_size=1, max_length=8, push=True).open())
        relayed = ServerSession(member, target, batch_size=1, max_length=8)
        member.loop.run(relayed.open())
        member.loop.run(relayed.step(torch.zeros(1, 1, spec.config.hidden_size), torch.ones(1, 1, dtype=torch.long),
                                     torch.zeros(1, 1, dtype=torch.long)))
        # An outsider that learned a push session's id is refused before anything else
        stream = raw_stream(outsider, target.peer_id, protocol.RPC_PUSH)
        meta = exchange(outsider, stream, framed([], {"attach": True, "session_id": pushable.session_id}))
        assert error_code(meta) is protocol.ErrorCode.UNAUTHORIZED
        # A member's client may not push at all, not even into its own sessions: only server members push (roles;
        # in an open swarm, where everyone serves, an attach to a session not opened for push is UNKNOWN_SESSION:
        # test_an_attach_to_a_session_not_opened_for_push_or_to_none_is_unknown)
        for session_id in (pushable.session_id, relayed.session_id, uuid.uuid4().hex):
            stream = raw_stream(member, target.peer_id, protocol.RPC_PUSH)
            meta = exchange(member, stream, framed([], {**member.auth_meta(), "attach": True, "session_id": session_id}))
            assert error_code(meta) is protocol.ErrorCode.UNAUTHORIZED and "from the server members" in str(meta)
        # and a session not opened for push refuses a step that asks it to push on
        stream = raw_stream(member, target.peer_id)
        opened = exchange(member, stream, framed([], {**member.auth_meta(), "open": True, "session_id": uuid.uuid4().hex,
                                                      "start": 3, "end": 6, "batch_size": 1, "max_length": 8}))
        assert opened.get("opened") is True
        hidden_size = spec.config.hidden_size
        meta = exchange(member, stream, framed([torch.zeros(1, 1, hidden_size), torch.ones(1, 1, dtype=torch.long),
                                                torch.zeros(1, 1, dtype=torch.long)],
                                               {"session_id": opened["session_id"], "step_id": 0,
                                                "route": [[private_pair.servers[0].peer_id, pushable.session_id]]}))
        assert error_code(meta) is protocol.ErrorCode.INVALID and "push" in str(meta)
        # A server pushes a member's hidden states to members only: a route naming an outsider is refused
        stream = raw_stream(member, private_pair.servers[0].peer_id)
        opened = exchange(member, stream, framed([], {**member.auth_meta(), "open": True, "push": True,
                                                      "session_id": uuid.uuid4().hex, "start": 0, "end": 3,
                                                      "batch_size": 1, "max_length": 8}))
        meta = exchange(member, stream, framed([torch.zeros(1, 1, hidden_size), torch.ones(1, 1, dtype=torch.long),
                                                torch.zeros(1, 1, dtype=torch.long)],
                                               {"session_id": opened["session_id"], "step_id": 0,
                                                "route": [[outsider.p2p.peer_id.to_base58(), pushable.session_id]]}))
        assert error_code(meta) is protocol.ErrorCode.UNAUTHORIZED and "members" in str(meta)
        member.loop.run(pushable.close())
        member.loop.run(relayed.close())
    finally:
        outsider.close()
        member.close()


def test_an_attach_to_a_session_not_opened_for_push_or_to_none_is_unknown(tiny_model: Path, three_servers: LocalSwarm,
                                                                           client: Swarm) -> None:
    spec = ModelSpec.open(tiny_model)
    target = RouteHop(three_servers.servers[1].peer_id, 2, 4)
    relayed = ServerSession(client, target, batch_size=1, max_length=8)
    client.loop.run(relayed.open())
    try:
        client.loop.run(relayed.step(torch.zeros(1, 1, spec.config.hidden_size), torch.ones(1, 1, dtype=torch.long),
                                     torch.zeros(1, 1, dtype=torch.long)))
        for session_id in (relayed.session_id, uuid.uuid4().hex):
            stream = raw_stream(client, target.peer_id, protocol.RPC_PUSH)
            meta = exchange(client, stream, framed([], {"attach": True, "session_id": session_id}))
            assert error_code(meta) is protocol.ErrorCode.UNKNOWN_SESSION, meta
    finally:
        client.loop.run(relayed.close())


def test_servers_report_their_round_trips_to_the_servers_after_them(three_servers: LocalSwarm, client: Swarm) -> None:
    # Given servers on blocks 0:2, 2:4, 4:6: each (but the last) pings the holders of the block after its span
    first, second, third = (server.peer_id for server in three_servers.servers)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # a server measures every 10 s, the first time as it comes online
        for peer in (first, second, third):
            client.loop.run(client.ping(peer))
        if (first, second) in client.links and (second, third) in client.links:
            break
        time.sleep(1)
    # Then the client learned both links from the servers' info answers, and nothing about the last server's
    assert 0 < client.links[(first, second)] < 5 and 0 < client.links[(second, third)] < 5
    assert not [link for link in client.links if link[0] == third]
    # and routes with push on them
    route = client.loop.run(client.route(0, 6))
    assert [hop.peer_id for hop in route] == [first, second, third]


def test_round_trips_older_than_their_max_age_are_measured_again_with_the_links_reported(three_servers: LocalSwarm,
                                                                                         client: Swarm) -> None:
    # Given a client that measured its round trips to the servers and learned the links they report
    first, second, _ = (server.peer_id for server in three_servers.servers)
    client.loop.run(client.route(0, 6))
    measured = dict(client.pinged_at)
    # and whose figures for the first server are now wrong (the network changed), and a minute old
    client.rtts[first], client.links[(first, second)] = 9.0, 9.0
    client.pinged_at[first] -= client.config.rtt_max_age + 1
    # When it routes again, Then it pinged that server again, and only that one (the others are fresh)
    client.loop.run(client.route(0, 6))
    assert client.rtts[first] < 5 and client.pinged_at[first] > measured[first]
    assert {peer: at for peer, at in client.pinged_at.items() if peer != first} == {
        peer: at for peer, at in measured.items() if peer != first}
    # and the link the server reports replaced the stale one (or, before its first round, none is left)
    assert client.links.get((first, second), 0.0) < 5
