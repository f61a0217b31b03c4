"""Who may write to a private swarm's DHT (security audit 2, N1): members only; strangers' records are refused where
they arrive, so no stranger can fill a node's storage or swell its answers until readers lose every honest record.

In an open swarm (no swarm file) anyone's self-signed records are stored, and what keeps them from hiding the servers
is bounds: at most 1024 records per key, newcomers refused when full, answers within p2pd's message limit, one key
per lookup (`swarmnet/dht_storage.py`).

The swarms: a private one (a DHT node and a server, both members) and an open one (a DHT node and two servers), in
real processes. The strangers: in-process hivemind DHT nodes (`Outsider`) that store records straight into each
node, as anyone reaching a port can.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from dht_outsider import Outsider, biggest_junk, honest_peers, signed_by, wire
from generation_checks import reference_tokens
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from jobs_support import wait_for
from tiers import process_fixture

from launch.local_swarm import LocalSwarm
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.swarm import Swarm
from swarmclient.textgen import load_tokenizer
from swarmnet.addresses import NetworkOptions
from swarmnet.data_structures import MAX_RECORD_TTL, ServerState, block_uid
from swarmnet.dht_storage import MAX_SUBKEYS_PER_KEY, BoundedStorage
from swarmnet.discovery import BlockServers
from swarmnet.identity import Identity
from swarmnet.membership import RECHECK_SECONDS, SwarmAccess
from swarmnet.model_spec import ModelSpec
from swarmnet.network import LoopThread, start_dht_node, stop_dht_node

pytestmark = pytest.mark.alone  # it measures time against a bound: run after the parallel phase, alone

PROMPTS = ["The swarm answers", "Nobody hides"]
NEW_TOKENS = 6
# self-signed keys flooding an open swarm, each with a max-size record under every block key: hivemind packs 2 of 6
# keys in a find, and 2 x 254 records of 8 KiB pass p2pd's 4 MiB message limit (unbounded answers hid every server)
STRANGERS = 300


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
        infos = read_blocks(private_swarm, spec, private_swarm.access())
        server = private_swarm.servers[0].peer_id
        assert all(block.get(server) is not None and block[server].state == ServerState.ONLINE for block in infos)
        assert not any(who.identity.peer_id in block for who in strangers for block in infos)
        # And a generation through it gives transformers' greedy tokens
        assert_generates_greedy(tiny_model, private_swarm.initial_peers, private_swarm.access())
    finally:
        for who in strangers:
            who.close()


# ---- an open swarm: anyone's self-signed records are stored, and still none hides a server ----------------------
@process_fixture(scope="module")
def open_swarm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tiny_model, [(0, 3), (3, 6)], log_dir=tmp_path_factory.mktemp("open")) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def stranger_keys(tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    root = tmp_path_factory.mktemp("strangers")
    return [Identity.create(root / f"{number}.key") for number in range(STRANGERS)]


def test_three_hundred_strangers_max_size_records_under_every_block_key_hide_no_server_of_an_open_swarm(
        open_swarm: LocalSwarm, stranger_keys: list[Identity], tmp_path: Path, tiny_model: Path) -> None:
    # Given 300 strangers' valid self-signed records of the largest size a node stores (8 KiB), under every
    # block key of the model, stored at every honest node, as anyone on the network can
    spec = ModelSpec.open(tiny_model)
    keys = [block_uid(spec.model_id, index) for index in range(spec.num_blocks)]
    expiration, junk = get_dht_time() + MAX_RECORD_TTL - 5, biggest_junk()
    floods = [[(key, who.peer_id, signed_by(who, key, who.peer_id, junk, expiration), expiration) for key in keys]
              for who in stranger_keys]
    # (through 3 writers: a node checks at most STORE_RECORDS_BURST records of one writer at once, dht_wire.py)
    writers = [Outsider(open_swarm.initial_peers, tmp_path / f"writer{n}.key") for n in range(3)]
    try:
        for peer in honest_peers(open_swarm):
            stored = [ok for n, records in enumerate(floods) for ok in writers[n % 3].store_many_at(peer, records)]
            assert all(stored) and len(stored) == STRANGERS * spec.num_blocks, peer  # an open swarm stores them
    finally:
        for writer in writers:
            writer.close()
    # When a client reads the swarm, then it finds both servers on each of their blocks
    infos = read_blocks(open_swarm, spec, None)
    for server, blocks in zip(open_swarm.servers, [range(0, 3), range(3, 6)], strict=True):
        for index in blocks:
            assert infos[index].get(server.peer_id) is not None, f"block {index}: {sorted(infos[index])}"
            assert infos[index][server.peer_id].state == ServerState.ONLINE
    # And a generation through them gives transformers' greedy tokens
    assert_generates_greedy(tiny_model, open_swarm.initial_peers, None)


def read_blocks(swarm: LocalSwarm, spec: ModelSpec, access: SwarmAccess | None) -> list[BlockServers]:
    """What a fresh client reads: per block, the servers announcing it."""
    client = Swarm.connect(swarm.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks, access=access)
    try:
        return client.loop.run(client.block_infos(refresh=True), timeout=60)
    finally:
        client.close()


def assert_generates_greedy(model_dir: Path, initial_peers: list[str], access: SwarmAccess | None) -> None:
    batch = load_tokenizer(model_dir)(PROMPTS, return_tensors="pt", padding=True)
    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=initial_peers, access=access) as model:
        tokens = model.generate(batch.input_ids, batch.attention_mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(tokens[:, batch.input_ids.shape[1]:], reference_tokens(model_dir, batch, NEW_TOKENS))


def test_a_node_whose_key_is_full_keeps_the_servers_it_holds_refuses_newcomers_and_answers_within_budget(
        open_swarm: LocalSwarm, stranger_keys: list[Identity], tmp_path: Path) -> None:
    # Given a full DHT node of the open swarm, started as `swarmbatch dht` and servers start theirs, keeping 8 records
    # per key and answering with 24 KiB of them (1024 and 3 MiB in production: filling those takes 1024 keys)
    loop = LoopThread("capped")
    p2p, node = loop.run(start_dht_node(open_swarm.initial_peers, NetworkOptions(), client_mode=False), timeout=60)
    storage = node.protocol.storage
    assert isinstance(storage, BoundedStorage) and storage.max_subkeys == MAX_SUBKEYS_PER_KEY
    storage.max_subkeys, storage.answer_bytes = 8, 3 * 8192
    at, key = p2p.peer_id.to_base58(), block_uid("capped-model", 0)  # a key nobody else writes to
    server = Outsider(open_swarm.initial_peers, tmp_path / "server.key")  # announces as a server would
    try:
        def announce(who: Identity, value: bytes, expiration: float) -> bool:
            return server.store_at(at, key, who.peer_id, signed_by(who, key, who.peer_id, value, expiration),
                                   expiration)
        soon = get_dht_time() + 30
        assert announce(server.identity, wire(ServerState.ONLINE, 0, 6), soon)
        # When strangers store their largest records under the key, then the node keeps 7 of them and refuses others
        stored = [announce(who, biggest_junk(), soon) for who in stranger_keys[:10]]
        assert stored == [True] * 7 + [False] * 3
        # And the server's re-announcement under the subkey it holds is still stored; a newcomer's is not
        assert announce(server.identity, wire(ServerState.ONLINE, 0, 6), soon + 5)
        assert not announce(stranger_keys[10], wire(ServerState.ONLINE, 0, 6), soon + 5)
        # And a reader's find of the key gets the server's record first, and only as many others as fit 24 KiB
        client = Swarm.connect(open_swarm.initial_peers, model_id="capped-model", num_blocks=1)
        try:
            found = client.loop.run(client.node.protocol.call_find(PeerID.from_base58(at), [DHTID.generate(key)]),
                                    timeout=30)
        finally:
            client.close()
        assert found is not None
        answer = found[DHTID.generate(key)][0].value
        held = {subkey for subkey, _ in answer.items()}
        assert server.identity.peer_id in held and len(held) == 3, held  # the server's ~0.8 KB, two of 8 KiB
    finally:
        server.close()
        loop.run(stop_dht_node(p2p, node), timeout=30)
        loop.stop()
