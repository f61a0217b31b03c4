"""Who may write to a private swarm's DHT (security audit 2, N1): members only; strangers' records are refused where
they arrive, so no stranger can fill a node's storage or swell its answers until readers lose every honest record.

The swarm: a private one (a DHT node and a server, both members), in real processes. The strangers: in-process
hivemind DHT nodes (`Outsider`) that store records straight into each node, as anyone reaching a port can.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from dht_outsider import Outsider, honest_peers, wire
from hivemind.utils import get_dht_time
from jobs_support import wait_for
from tiers import process_fixture

from launch.local_swarm import LocalSwarm
from swarmclient.swarm import Swarm
from swarmnet.data_structures import ServerState, block_uid
from swarmnet.membership import RECHECK_SECONDS
from swarmnet.model_spec import ModelSpec


@process_fixture(scope="module")
def private_swarm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tiny_model, [(0, 6)], log_dir=tmp_path_factory.mktemp("writers"), private=True) as swarm:
        yield swarm


@process_fixture()
def stranger(private_swarm: LocalSwarm, tmp_path: Path) -> Iterator[Outsider]:
    node = Outsider(private_swarm.initial_peers, tmp_path / "stranger.key")
    yield node
    node.close()


@process_fixture()
def member_node(private_swarm: LocalSwarm) -> Iterator[Outsider]:
    """A plain DHT node whose key is in the swarm file (as a second DHT node of the team would be)."""
    node = Outsider(private_swarm.initial_peers, private_swarm.new_member("second-dht"))
    yield node
    node.close()


def test_a_strangers_self_signed_record_is_refused_by_every_member_node(
        private_swarm: LocalSwarm, stranger: Outsider, tiny_model: Path) -> None:
    key = block_uid(ModelSpec.open(tiny_model).model_id, 0)
    expiration = get_dht_time() + 30
    # Given a record a stranger signed with its own key, under its own peer id: valid as a record
    value = stranger.sign(key, stranger.identity.peer_id, wire(ServerState.ONLINE, 0, 6), expiration)
    # When it asks each member node to store it, then each refuses
    for peer in honest_peers(private_swarm):
        assert stranger.store_at(peer, key, stranger.identity.peer_id, value, expiration) is False, peer


def test_a_members_record_is_stored_by_the_same_nodes(
        private_swarm: LocalSwarm, member_node: Outsider, tiny_model: Path) -> None:
    key = block_uid(ModelSpec.open(tiny_model).model_id, 5)
    expiration = get_dht_time() + 30
    value = member_node.sign(key, member_node.identity.peer_id, wire(ServerState.JOINING, 5, 6), expiration)
    for peer in honest_peers(private_swarm):  # the nodes see a member added to their swarm file within RECHECK_SECONDS
        wait_for(lambda: member_node.store_at(peer, key, member_node.identity.peer_id, value, expiration),  # noqa: B023
                 RECHECK_SECONDS * 3, f"{peer} to store a member's record")


def test_strangers_flooding_the_model_keys_leave_readers_every_member_server(
        private_swarm: LocalSwarm, tmp_path: Path, tiny_model: Path) -> None:
    # Given two strangers storing many records under every block key of the model at every member node
    spec = ModelSpec.open(tiny_model)
    strangers = [Outsider(private_swarm.initial_peers, tmp_path / f"stranger{i}.key") for i in range(2)]
    try:
        expiration = get_dht_time() + 60
        for who in strangers:
            for index in range(spec.num_blocks):
                key = block_uid(spec.model_id, index)
                value = who.sign(key, who.identity.peer_id, wire(ServerState.ONLINE, 0, 6) + b"\0" * 6000, expiration)
                for peer in honest_peers(private_swarm):
                    who.store_at(peer, key, who.identity.peer_id, value, expiration)
        # When a member client reads the swarm, then it finds the member server on every block, and no stranger
        client = Swarm.connect(private_swarm.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks,
                               access=private_swarm.access())
        try:
            infos = client.loop.run(client.block_infos(refresh=True), timeout=60)
        finally:
            client.close()
        server = private_swarm.servers[0].peer_id
        assert all(block.get(server) is not None and block[server].state == ServerState.ONLINE for block in infos)
        assert not any(who.identity.peer_id in block for who in strangers for block in infos)
    finally:
        for who in strangers:
            who.close()
