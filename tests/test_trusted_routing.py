"""Routing through real servers trusts what the client measured over what records claim, skips full servers, and
spreads a client's sessions over the machines holding the blocks."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch

from servers.throughput import TEST_OVERSTATE_ENV
from swarmclient.config import ClientConfig
from swarmclient.model import DistributedModelForCausalLM
from swarmnet.discovery import online_spans


def test_routing_trusts_measured_steps_and_skips_a_server_without_cache_room(tiny_model: Path, local_swarm) -> None:
    # Given three servers of all 6 blocks, all overstating their speed (a test-only knob): 'boaster' by 100000 times,
    # 'modest' by 1000 times, and 'full' by 10**8 times, but with room for only 4 cached tokens per block (wide
    # margins: each server measures its speed at start, while the others start too, on a machine that may be busy
    # with other tests; a measure taken in a stall may be many times too slow)
    swarm = local_swarm(tiny_model, [])
    specs = {"boaster": ("100000", []), "modest": ("1000", []), "full": ("100000000", ["--attn-cache-tokens", "4"])}
    started = {name: swarm.start_server(0, 6, wait=False, extra_args=args, env={TEST_OVERSTATE_ENV: factor})
               for name, (factor, args) in specs.items()}
    for server in started.values():
        server.wait_for_line("Serving blocks", timeout=180)
    peer = {name: server.peer_id for name, server in started.items()}
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers) as model:
        client = model.swarm
        # (the servers share this machine: their round trips differ by noise only, which can outweigh the tiny
        # model's compute; this test is about throughput, so it gives them one round trip)
        rtts = [client.loop.run(client.ping(peer[name])) for name in ("boaster", "modest")]
        client.rtts.update({peer["boaster"]: max(rtts), peer["modest"]: max(rtts)})
        # When a generation runs (batch 1, 12 tokens long: more than 'full' has room for)
        model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=8)
        infos = {name: client.loop.run(client.call_info(peer_id)) for name, peer_id in peer.items()}
        # Then 'full' was never dialled, banned or refused anything: its record said it had no room
        assert infos["full"]["errors"] == {} and infos["full"]["steps"] == 0
        assert not client.bans.is_banned(peer["full"]) and peer["full"] not in client.rtts
        # And the boaster, believed at first, served it; its claim is now held to the steps the client timed
        assert infos["boaster"]["steps"] > 0 and infos["modest"]["steps"] == 0
        assert client.claimed[peer["boaster"]] == infos["boaster"]["throughput"]   # kept from the ping's info answer
        spans = online_spans(client.loop.run(client.block_infos(refresh=True)))
        trusted = client.trusted_throughputs(spans)[peer["boaster"]]
        assert trusted == client.observed[peer["boaster"]] < infos["boaster"]["throughput"] / 50
        # So the next session goes to the server whose claim is still believable
        route = client.loop.run(client.route(0, 6, session_tokens=12))
        assert [hop.peer_id for hop in route] == [peer["modest"]]
        # And when no server announces room for a session, the full ones are still tried rather than none
        assert client.loop.run(client.route(0, 6, session_tokens=10**9))


# routes opened after round trips set by hand: no ping before a session opens overwrites them (a busy machine's own
# round trips could outweigh the compute these tests compare)
HAND_SET_RTTS = ClientConfig(load_max_age=3600.0)


def test_a_clients_sessions_spread_over_the_machines_holding_the_blocks(tiny_model: Path, local_swarm) -> None:
    # Given two holders of each half of the model, each server on a machine of its own (as servers announce them:
    # --machine) and announcing one speed (a test figure, so that compute outweighs the round trips' noise here)
    swarm = local_swarm(tiny_model, [])
    names = ["A", "B", "C", "D"]
    servers = swarm.start_servers([(start, end, ["--machine", name, "--throughput", "100"])
                                   for name, (start, end) in zip(names, [(0, 3), (3, 6)] * 2, strict=True)])
    machine = {server.peer_id: name for server, name in zip(servers, names, strict=True)}
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers,
                                                     config=HAND_SET_RTTS) as model:
        client = model.swarm
        client.loop.run(client.route(0, 6))  # pings every server: their info answers give what they claim
        client.rtts.update(dict.fromkeys(machine, max(client.rtts[peer] for peer in machine)))
        client.links.update({(one, other): 0.001 for one in machine for other in machine if one != other})
        # When a worker's four lanes open their sessions at once
        lanes = [model.inference_session(batch_size=2, max_length=16) for _ in range(4)]

        async def each(action: str) -> None:
            await asyncio.gather(*(getattr(lane, action)() for lane in lanes))
        client.loop.run(each("open"))
        try:
            # Then every machine serves two of them (all four took the first holders before)
            held = {machine[peer]: count for peer, count in client.held_sessions().items()}
            assert held == dict.fromkeys(names, 2), [[machine[hop.peer_id] for hop in lane.route] for lane in lanes]
            assert all(len(lane.route) == 2 for lane in lanes)
        finally:
            client.loop.run(each("close"))
        # and closed sessions are no load any more
        assert not client.held_sessions()


def test_a_second_client_routes_around_the_sessions_another_client_holds(tiny_model: Path, local_swarm) -> None:
    # Given two servers of the whole model on two machines, announcing one speed, and a first client (another
    # worker) holding a session on one of them
    swarm = local_swarm(tiny_model, [])
    servers = swarm.start_servers([(0, 6, ["--machine", name, "--throughput", "100"]) for name in ("A", "B")])
    peers = {server.peer_id for server in servers}
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers) as first, \
            DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers,
                                                        config=HAND_SET_RTTS) as second:
        taken = first.inference_session(batch_size=1, max_length=16)
        first.swarm.loop.run(taken.open())
        busy = taken.route[0].peer_id
        free = (peers - {busy}).pop()
        try:
            # When the second client pings both servers (as it routes) and then finds the busy one nearer
            client = second.swarm
            client.loop.run(client.route(0, 6))
            assert client.others == {busy: 1, free: 0}  # the servers' own counts, none of them this client's
            client.rtts.update({busy: 0.001, free: 0.002})
            # Then its session goes to the other machine (it took the nearer, busy one before)
            lane = second.inference_session(batch_size=1, max_length=16)
            client.loop.run(lane.open())
            try:
                assert [hop.peer_id for hop in lane.route] == [free]
            finally:
                client.loop.run(lane.close())
        finally:
            first.swarm.loop.run(taken.close())
        # And once the first client's session has ended, a fresh ping says so: the nearer server is taken again
        client.pinged_at.clear()
        client.loop.run(client.route(0, 6))
        client.rtts.update({busy: 0.001, free: 0.002})
        assert client.others == {busy: 0, free: 0}
        assert [hop.peer_id for hop in client.loop.run(client.route(0, 6))] == [busy]


def test_a_long_lived_client_sees_the_sessions_opened_since_its_last_ping(tiny_model: Path, local_swarm) -> None:
    # Given two servers of the whole model on two machines, the first announcing the faster speed (test figures: a
    # step of 6 blocks 0.6 s against 1.0 s, and 1.2 s once shared, so that round trips on a busy machine cannot
    # decide), and a worker that pinged both (no other caller's session anywhere) and would take the faster
    swarm = local_swarm(tiny_model, [])
    fast, slow = (server.peer_id for server in swarm.start_servers(
        [(0, 6, ["--machine", name, "--throughput", speed]) for name, speed in (("A", "10"), ("B", "6"))]))
    config = ClientConfig(load_max_age=0.5)
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers,
                                                     config=config) as worker, \
            DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers) as other:
        client = worker.swarm
        assert [hop.peer_id for hop in client.loop.run(client.route(0, 6))] == [fast]
        assert client.others == {fast: 0, slow: 0}
        # When another client opens a session on the faster server, and more than load_max_age (but far less than
        # rtt_max_age) passes
        taken = other.inference_session(batch_size=1, max_length=16)
        other.swarm.loop.run(taken.open())
        try:
            assert [hop.peer_id for hop in taken.route] == [fast]
            time.sleep(0.6)
            # Then the worker's next route pings the faster server again before using it, and takes the other
            assert [hop.peer_id for hop in client.loop.run(client.route(0, 6))] == [slow]
            assert client.others == {fast: 1, slow: 0}
        finally:
            other.swarm.loop.run(taken.close())
        # And once that session has ended, the next route after load_max_age sees it gone and takes the faster again
        time.sleep(0.6)
        assert [hop.peer_id for hop in client.loop.run(client.route(0, 6))] == [fast]
        assert client.others == {fast: 0, slow: 0}
        # while a route within load_max_age of those pings pings nobody
        pinged = dict(client.pinged_at)
        client.loop.run(client.route(0, 6))
        assert client.pinged_at == pinged
