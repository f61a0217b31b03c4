"""Forged and long-lived DHT records, sent for real to a real swarm by an outsider's hivemind node.

The swarm: a DHT node and two servers (processes, re-announcing every ANNOUNCE_PERIOD). The outsider: a plain
hivemind DHTNode in this process, with its own key and no validator, so it keeps whatever it is told to and answers
finds with it. It stores records straight into each honest node (`call_store`), as any peer on the network can.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dht_outsider import Outsider, honest_peers, wire
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from tiers import process_fixture

from launch.local_swarm import LocalSwarm
from swarmclient.swarm import Swarm
from swarmnet.data_structures import MAX_RECORD_TTL, ServerState, block_uid
from swarmnet.discovery import BlockServers
from swarmnet.identity import Identity
from swarmnet.model_spec import ModelSpec

ANNOUNCE_PERIOD = 2.0
YEAR = 365 * 86400.0


@process_fixture(scope="module")
def swarm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tiny_model, [(0, 3), (3, 6)], log_dir=tmp_path_factory.mktemp("forgery"),
                    server_args=["--announce-period", str(ANNOUNCE_PERIOD)]) as local:
        yield local


@process_fixture()
def outsider(swarm: LocalSwarm, tmp_path: Path) -> Iterator[Outsider]:
    node = Outsider(swarm.initial_peers, tmp_path / "outsider.key")
    yield node
    node.close()


def read_blocks(swarm: LocalSwarm, tiny_model: Path) -> list[BlockServers]:
    """What a fresh client reads: per block, the servers announcing it."""
    client = Swarm.connect(swarm.initial_peers, model_id=ModelSpec.open(tiny_model).model_id, num_blocks=6)
    try:
        return client.loop.run(client.block_infos(refresh=True), timeout=60)
    finally:
        client.close()


def assert_both_servers_online(swarm: LocalSwarm, tiny_model: Path) -> None:
    infos = read_blocks(swarm, tiny_model)
    for index, server in [(i, swarm.servers[0]) for i in range(3)] + [(i, swarm.servers[1]) for i in range(3, 6)]:
        assert infos[index][server.peer_id].state == ServerState.ONLINE, f"block {index}: {infos[index]}"


def test_a_forged_offline_record_a_year_ahead_is_refused_dropped_and_the_server_stays_online(
        swarm: LocalSwarm, outsider: Outsider, tiny_model: Path) -> None:
    model_id, victim = ModelSpec.open(tiny_model).model_id, swarm.servers[0].peer_id
    forged = wire(ServerState.OFFLINE, 0, 3)
    for index in range(3):
        key, expires = block_uid(model_id, index), get_dht_time() + YEAR
        # Every honest node refuses to store it, unsigned or signed with the outsider's own key
        for peer in honest_peers(swarm):
            assert not outsider.store_at(peer, key, victim, forged, expires)
            assert not outsider.store_at(peer, key, victim, outsider.sign(key, victim, forged, expires), expires)
        # The outsider keeps it and answers finds with it
        outsider.keep(key, victim, forged, expires)
    # After more than the honest records' lifetime (2 periods), only announcements made since then remain
    time.sleep(2.5 * ANNOUNCE_PERIOD)
    assert_both_servers_online(swarm, tiny_model)


def test_a_reader_drops_only_the_answer_of_the_node_keeping_a_forged_record(
        swarm: LocalSwarm, outsider: Outsider, tiny_model: Path) -> None:
    model_id, victim = ModelSpec.open(tiny_model).model_id, swarm.servers[0].peer_id
    key = block_uid(model_id, 0)
    outsider.keep(key, victim, wire(ServerState.OFFLINE, 0, 3), get_dht_time() + YEAR)
    client = Swarm.connect(swarm.initial_peers, model_id=model_id, num_blocks=6)
    try:
        async def find(peer: str) -> Any:
            answer = await client.node.protocol.call_find(PeerID.from_base58(peer), [DHTID.generate(source=key)])
            assert answer is not None, f"{peer} did not answer"
            return answer[DHTID.generate(source=key)][0]
        assert client.loop.run(find(outsider.p2p.peer_id.to_base58()), timeout=30) is None
        honest = client.loop.run(find(honest_peers(swarm)[0]), timeout=30)
        assert victim in honest.value
    finally:
        client.close()


def test_honest_nodes_refuse_records_that_are_not_their_writers_or_live_too_long(
        swarm: LocalSwarm, outsider: Outsider, tiny_model: Path) -> None:
    model_id, victim = ModelSpec.open(tiny_model).model_id, swarm.servers[0].peer_id
    key, own = block_uid(model_id, 0), outsider.p2p.peer_id.to_base58()
    other = Identity.create(outsider.identity.path.with_name("other.key")).peer_id
    value, soon, day = wire(ServerState.ONLINE, 0, 3), get_dht_time() + 30, get_dht_time() + 86400
    for peer in honest_peers(swarm):
        # a correctly signed record of the outsider's own, expiring a day ahead
        assert not outsider.store_at(peer, key, own, outsider.sign(key, own, value, day), day), peer
        # signed by the outsider under another peer's id (one that is not even in the swarm)
        assert not outsider.store_at(peer, key, other, outsider.sign(key, other, value, soon), soon), peer
        # no subkey: a regular value under the block key would shadow every announcement for it
        assert not outsider.store_at(peer, key, None, outsider.sign(key, victim, value, day), day), peer
        # the control: its own correctly signed short-lived record is valid (who is a member is the readers' call)
        assert outsider.store_at(peer, key, own, outsider.sign(key, own, value, soon), soon), peer
    assert_both_servers_online(swarm, tiny_model)


def test_a_valid_record_pushed_into_honest_caches_does_not_hide_the_stored_announcements(
        swarm: LocalSwarm, outsider: Outsider, tiny_model: Path) -> None:
    model_id, own = ModelSpec.open(tiny_model).model_id, outsider.p2p.peer_id.to_base58()
    expires = get_dht_time() + MAX_RECORD_TTL - 5  # later than any honest record: a cache answer would win
    for index in range(6):
        key = block_uid(model_id, index)
        signed = outsider.sign(key, own, wire(ServerState.ONLINE, index, index + 1), expires)
        for peer in honest_peers(swarm):
            outsider.store_at(peer, key, own, signed, expires, in_cache=True)
    assert_both_servers_online(swarm, tiny_model)


def test_an_answer_that_never_expires_does_not_end_a_readers_search(
        swarm: LocalSwarm, outsider: Outsider, tiny_model: Path) -> None:
    outsider.answer_finds_with_an_endless_empty_record()
    # a client that first meets the outsider (here: joins through it) still reads on to the honest nodes
    maddrs = [str(m) for m in outsider.loop.run(outsider.p2p.get_visible_maddrs(), timeout=10)]
    client = Swarm.connect(maddrs, model_id=ModelSpec.open(tiny_model).model_id, num_blocks=6)
    try:
        infos = client.loop.run(client.block_infos(refresh=True), timeout=60)
    finally:
        client.close()
    assert swarm.servers[0].peer_id in infos[0] and swarm.servers[1].peer_id in infos[5], infos
