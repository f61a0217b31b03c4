"""What strangers send DHT nodes on the wire costs them little (security audit 2, N2c, N2d, N1 at its worst size):
real hivemind DHT nodes send the bad things for real, to real swarmbatch nodes.

* A stranger's DHT node answers every find with 4 MiB (a dictionary bomb, or 70,000 neighbours): a member reading
  the block records still finds the server, and its event loop is never busy with one thing for 50 ms (before:
  seconds per answer). A stranger's find request of 150,000 keys gets an empty answer at once.
* Store requests to a node of an open swarm: one of thousands of records, or one whole-dictionary bomb, is refused
  whole before any signature is checked; one at the cap costs at most MAX_STORE_RECORDS checks.
* A stranger's 3 MiB self-signed record under a model key is refused by a private swarm's DHT node and its server.
* A server announcing more blocks than one store request may carry still has every record stored.

The decoder's own cases, without processes: tests/swarmnet/test_bounded_decoding.py.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
from dht_outsider import FIND_HANDLER, Outsider, honest_peers, wire
from hivemind.dht.routing import DHTID
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time
from loop_watch import LoopWatch
from tiers import process_fixture

from launch.local_swarm import LocalSwarm
from servers.announcer import Announcer
from servers.counters import ServerCounters
from servers.memory import CacheBudget
from servers.status import ServerStatus, SpanStatus
from swarmnet import records
from swarmnet.addresses import NetworkOptions
from swarmnet.data_structures import PROTOCOL_VERSION, ServerState, block_uid
from swarmnet.dht_wire import DICTIONARY_EXT, MAX_FIND_KEYS, MAX_STORE_RECORDS, WriterBudget, store_request_charge
from swarmnet.discovery import get_remote_module_infos
from swarmnet.model_spec import ModelSpec
from swarmnet.network import LoopThread, start_dht_node, stop_dht_node, visible_maddrs
from swarmnet.records import VERIFIED, GuardedDHTNode

pytestmark = pytest.mark.alone  # it measures time against a bound: run after the parallel phase, alone

P2PD_MESSAGE_LIMIT = 4 << 20  # hivemind's persistent_conn_max_msg_size: the most one answer or request can be
LOOP_BUDGET = 0.050  # the longest the loop of a node may be busy with one answer or request


def dictionary_bomb(size: int) -> bytes:
    """A whole dictionary (ext 0x50) of `size` bytes: [None, 0.0, [[], [], ...]], an empty array per byte."""
    count = size - 20
    return msgpack.packb(msgpack.ExtType(DICTIONARY_EXT, b"\x93\xc0\xcb" + b"\0" * 8 + b"\xdd"
                                         + count.to_bytes(4, "big") + b"\x90" * count))


def badly_signed(stranger: Outsider, count: int) -> tuple[list[DHTID], list[bytes]]:
    """`count` records under the stranger's own peer id, each with its real public key (an RSA-2048, e = 65537
    key: the validator gets as far as verifying) and a garbage signature, under as many keys."""
    keys = [DHTID.generate(source=f"flood.{i}") for i in range(count)]
    values = [msgpack.packb([b"value %d" % i, stranger.identity.public_key_der, b"\x01" * 256], use_bin_type=True)
              for i in range(count)]
    return keys, values


class OpenNode:
    """A full swarmbatch DHT node of an open swarm (no swarm file), in this process on its own loop."""

    def __init__(self) -> None:
        self.loop = LoopThread("open-node")
        self.p2p, self.node = self.loop.run(start_dht_node([], NetworkOptions(), client_mode=False), timeout=60)
        self.maddrs = self.loop.run(visible_maddrs(self.p2p))
        self.peer_id = self.p2p.peer_id

    def close(self) -> None:
        try:
            self.loop.run(stop_dht_node(self.p2p, self.node), timeout=20)
        finally:
            self.loop.stop()


@process_fixture()
def open_node() -> Iterator[OpenNode]:
    node = OpenNode()
    yield node
    node.close()


@process_fixture(scope="module")
def private_swarm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tiny_model, [(0, 6)], log_dir=tmp_path_factory.mktemp("wire"), private=True) as swarm:
        yield swarm


def send_store(stranger: Outsider, peer: PeerID, request: dht_pb2.StoreRequest) -> list[bool]:
    """Send a raw store request (any tags, any bytes) and return the node's verdicts."""
    request.peer.CopyFrom(stranger.node.protocol.node_info)
    response = stranger.loop.run(stranger.node.protocol.get_stub(peer).rpc_store(request, timeout=30), timeout=40)
    return list(response.store_ok)


# ---- N2c: a find answer is bounded before it is decoded -------------------------------------------------------------
ANSWER_ROOM = P2PD_MESSAGE_LIMIT - (64 << 10)  # what one result may fill, leaving room for the rest of the answer


def with_a_dictionary_bomb(result: dht_pb2.FindResult, stranger: Outsider) -> None:
    result.type, result.value = dht_pb2.FOUND_DICTIONARY, dictionary_bomb(ANSWER_ROOM)
    result.expiration_time = get_dht_time() + 30


def with_a_neighbour_flood(result: dht_pb2.FindResult, stranger: Outsider) -> None:
    count = ANSWER_ROOM // 58  # ~70,000: a 20-byte node id and a 34-byte peer id each, with their framing
    result.nearest_node_ids.extend(DHTID.generate(source=f"nobody.{i}").to_bytes() for i in range(count))
    result.nearest_peer_ids.extend([stranger.p2p.peer_id.to_bytes()] * count)


@pytest.mark.parametrize("bad", [with_a_dictionary_bomb, with_a_neighbour_flood], ids=["dictionary-bomb", "neighbours"])
def test_a_strangers_4_mib_find_answers_neither_stall_a_members_loop_nor_hide_the_server(
        private_swarm: LocalSwarm, tiny_model: Path, tmp_path: Path,
        bad: Callable[[dht_pb2.FindResult, Outsider], None]) -> None:
    spec = ModelSpec.open(tiny_model)
    server = private_swarm.servers[0].peer_id
    # Given a stranger in the DHT whose node answers every find with 4 MiB: a dictionary bomb (ext 0x50 of empty
    # arrays) or 70,000 neighbours in the first result
    stranger = Outsider(private_swarm.initial_peers, tmp_path / "stranger.key")
    answered: list[int] = []

    async def bombing(request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
        response = await stranger.node.protocol.rpc_find(request, context)  # aligned with the keys, true neighbours
        bad(response.results[0], stranger)
        answered.append(response.ByteSize())
        return response

    async def replace(p2p: P2P) -> None:
        await p2p.remove_protobuf_handler(FIND_HANDLER)
        await p2p.add_protobuf_handler(FIND_HANDLER, bombing, dht_pb2.FindRequest)

    loop = LoopThread("member")
    try:
        stranger.loop.run(replace(stranger.p2p), timeout=10)
        # When a member joins the DHT and reads every block's records, its loop watched from before it joins
        with LoopWatch(loop.loop) as watch:
            p2p, node = loop.run(start_dht_node(private_swarm.initial_peers, NetworkOptions(), client_mode=True),
                                 timeout=60)
            try:
                infos = loop.run(get_remote_module_infos(node, spec.model_id, spec.num_blocks), timeout=60)
            finally:
                loop.run(stop_dht_node(p2p, node), timeout=20)
        # Then it was sent the 4 MiB, still finds the server on every block, and no answer held its loop 50 ms
        assert answered and min(answered) > 0.95 * P2PD_MESSAGE_LIMIT, answered
        assert all(server in block and block[server].state is ServerState.ONLINE for block in infos), infos
        assert watch.longest_cpu < LOOP_BUDGET, sorted(watch.cpu)[-5:]
    finally:
        loop.stop()
        stranger.close()


def test_a_find_request_of_150000_keys_gets_an_empty_answer_at_once(open_node: OpenNode, tmp_path: Path) -> None:
    stranger = Outsider(open_node.maddrs, tmp_path / "stranger.key")
    try:
        # Given a find request of 150,000 keys (3.3 MB: answering it held a node's loop 0.9 s)
        keys = [DHTID.generate(source=f"wanted.{i}").to_bytes() for i in range(150_000)]
        request = dht_pb2.FindRequest(keys=keys, peer=stranger.node.protocol.node_info)
        stub = stranger.node.protocol.get_stub(open_node.peer_id)
        # When the stranger sends it, then it gets no results, and the node's loop was never busy 50 ms
        with LoopWatch(open_node.loop.loop) as watch:
            response = stranger.loop.run(stub.rpc_find(request, timeout=30), timeout=40)
        assert len(response.results) == 0
        assert watch.longest_cpu < LOOP_BUDGET, sorted(watch.cpu)[-5:]
        # And a find of a reader's size is answered
        few = dht_pb2.FindRequest(keys=keys[:MAX_FIND_KEYS], peer=stranger.node.protocol.node_info)
        assert len(stranger.loop.run(stub.rpc_find(few, timeout=30), timeout=40).results) == MAX_FIND_KEYS
    finally:
        stranger.close()


def test_a_strangers_valid_record_whose_value_does_not_decode_leaves_readers_lookups_whole(
        open_node: OpenNode, tmp_path: Path) -> None:
    stranger = Outsider(open_node.maddrs, tmp_path / "stranger.key")
    loop = LoopThread("reader")
    try:
        expiration, me = get_dht_time() + 30, open_node.peer_id.to_base58()
        announcement = MSGPackSerializer.loads(wire(ServerState.ONLINE, 0, 3))
        # Given under each of 3 block keys the node's own record and a stranger's, correctly signed by the stranger,
        # whose value is not msgpack, an ext type hivemind knows (0x51), or a dictionary's ext type over nothing
        for index, inner in enumerate((b"\xc1", b"\xd4\x51\x00", b"\xd4\x50\x00")):
            key = block_uid("odd", index)
            assert open_node.loop.run(open_node.node.store(key, announcement, expiration, subkey=me), timeout=30)
            value = stranger.sign(key, stranger.identity.peer_id, inner, expiration)
            assert stranger.store_at(me, key, stranger.identity.peer_id, value, expiration)
        # When a reader looks the blocks up (before: the undecodable value raised inside hivemind's search, and the
        # lookup never finished)
        p2p, node = loop.run(start_dht_node(open_node.maddrs, NetworkOptions(), client_mode=True), timeout=60)
        try:
            infos = loop.run(get_remote_module_infos(node, "odd", 3), timeout=20)
        finally:
            loop.run(stop_dht_node(p2p, node), timeout=20)
        # Then it finds the node's record on every block, and nothing of the stranger's
        assert [set(block) for block in infos] == [{me}] * 3, infos
    finally:
        loop.stop()
        stranger.close()


# ---- N2d: a store request is bounded before any record is verified --------------------------------------------------
def test_an_open_nodes_store_requests_cost_at_most_their_capped_signature_checks(open_node: OpenNode,
                                                                                   tmp_path: Path) -> None:
    stranger = Outsider(open_node.maddrs, tmp_path / "stranger.key")
    try:
        # Given records whose key is a valid RSA-2048 key and whose signatures are garbage, as many as 4 MiB carries
        keys, values = badly_signed(stranger, 5800)
        expiration, me = get_dht_time() + 30, stranger.identity.peer_id

        def store(count: int) -> list[bool] | None:
            ok = stranger.loop.run(stranger.node.protocol.call_store(
                open_node.peer_id, keys[:count], values[:count], expiration, subkeys=[me] * count), timeout=60)
            return None if ok is None else list(ok)

        for count, verdicts, checks in ((5800, [], 0), (MAX_STORE_RECORDS, [False] * MAX_STORE_RECORDS,
                                                          MAX_STORE_RECORDS)):
            before = VERIFIED.verifications
            # When the stranger asks the node to store them in one request
            with LoopWatch(open_node.loop.loop) as watch:
                got = store(count)
            # Then thousands are refused whole before any signature check; the cap's worth are each checked once
            assert got == verdicts, (count, got if got is None else got[:3])
            assert VERIFIED.verifications - before == checks, count
            assert watch.longest_cpu < LOOP_BUDGET, (count, sorted(watch.cpu)[-5:])
        # And a whole-dictionary store of a 3 MiB bomb (tag b"", which hivemind decodes before any validator) is
        # refused unparsed: no verdict per record
        request = dht_pb2.StoreRequest(keys=[keys[0].to_bytes()], subkeys=[b""], values=[dictionary_bomb(3 << 20)],
                                       expiration_time=[expiration], in_cache=[False])
        with LoopWatch(open_node.loop.loop) as watch:
            assert send_store(stranger, open_node.peer_id, request) == []
        assert watch.longest_cpu < LOOP_BUDGET, sorted(watch.cpu)[-5:]
        assert open_node.node.protocol.storage.get(keys[0]) is None
    finally:
        stranger.close()


SMALL_RATE, SMALL_BURST = 8, 128  # a budget small enough that this machine cannot outrun the flood with its own pace


@process_fixture()
def budgeted_open_node(monkeypatch: pytest.MonkeyPatch) -> Iterator[OpenNode]:
    """An open node whose writers' record budget is SMALL_RATE a second, SMALL_BURST at once."""
    monkeypatch.setattr(records, "WriterBudget", lambda: WriterBudget(rate=SMALL_RATE, burst=SMALL_BURST))
    node = OpenNode()
    yield node
    node.close()


def test_a_stranger_flooding_an_open_node_with_small_store_requests_gets_only_its_budget_of_checks(
        budgeted_open_node: OpenNode, tmp_path: Path) -> None:
    node = budgeted_open_node
    stranger = Outsider(node.maddrs, tmp_path / "stranger.key")
    other = Outsider(node.maddrs, tmp_path / "other.key")
    try:
        expiration = get_dht_time() + 30

        def store(sender: Outsider) -> list[bool]:  # 64 records under the sender's own key, badly signed
            keys, values, me = *badly_signed(sender, MAX_STORE_RECORDS), sender.identity.peer_id
            got = sender.loop.run(sender.node.protocol.call_store(
                node.peer_id, keys, values, expiration, subkeys=[me] * len(keys)), timeout=60)
            assert got is not None
            return list(got)

        # When one stranger sends 20 requests of 64 badly signed records back to back
        before, began = VERIFIED.verifications, time.monotonic()
        answers = [store(stranger) for _ in range(20)]
        checked, seconds = VERIFIED.verifications - before, time.monotonic() - began
        # Then all are refused, and only its budget's worth was verified: the rest were refused unchecked
        assert all(answer == [False] * MAX_STORE_RECORDS for answer in answers)
        assert checked <= SMALL_BURST + SMALL_RATE * seconds + MAX_STORE_RECORDS, (checked, seconds)
        assert checked < 20 * MAX_STORE_RECORDS // 2, (checked, seconds)
        # And another writer still has its records checked, from a budget of its own
        before = VERIFIED.verifications
        assert store(other) == [False] * MAX_STORE_RECORDS
        assert VERIFIED.verifications - before == MAX_STORE_RECORDS
    finally:
        stranger.close()
        other.close()


def test_a_writers_budget_refills_at_its_rate_up_to_its_burst_and_forgets_the_longest_unseen() -> None:
    now = [0.0]
    budget = WriterBudget(rate=10, burst=100, clock=lambda: now[0])
    assert budget.take("a", 64) and not budget.take("a", 64) and budget.take("b", 64)  # each writer its own burst
    now[0] = 3.0  # 36 left + 30 refilled
    assert not budget.take("a", 67) and budget.take("a", 66) and not budget.take("a", 1)
    now[0] = 1000.0
    assert budget.take("a", 100) and not budget.take("a", 1)  # refilled to the burst, never beyond
    assert store_request_charge(dht_pb2.StoreRequest(keys=[b"k"] * 3, subkeys=[b"s"] * 3)) == 3
    assert store_request_charge(dht_pb2.StoreRequest(keys=[b"k"], subkeys=[b""])) == MAX_STORE_RECORDS


# ---- N1 at its worst size: a private swarm refuses a stranger's multi-MiB record ------------------------------------
def test_a_strangers_3_mib_self_signed_record_is_refused_by_the_dht_node_and_the_server(
        private_swarm: LocalSwarm, tiny_model: Path, tmp_path: Path) -> None:
    key = block_uid(ModelSpec.open(tiny_model).model_id, 0)
    stranger = Outsider(private_swarm.initial_peers, tmp_path / "stranger.key")
    try:
        expiration = get_dht_time() + 30
        # Given a 3 MiB record the stranger signed with its own key, under its own peer id and a model's block key
        value = stranger.sign(key, stranger.identity.peer_id, wire(ServerState.ONLINE, 0, 6) + b"\0" * (3 << 20),
                              expiration)
        assert len(value) > 3 << 20
        # When it asks the swarm's DHT node and its server to store it
        peers = honest_peers(private_swarm)
        assert len(peers) == 2
        for peer in peers:
            verdicts = stranger.loop.run(stranger.node.protocol.call_store(
                PeerID.from_base58(peer), keys=[DHTID.generate(source=key)], values=[value],
                expiration_time=expiration, subkeys=[stranger.identity.peer_id]), timeout=60)
            # Then each refuses it unparsed (no verdict per record), and answers a find for the key without it
            assert verdicts is not None and list(verdicts) == [], (peer, verdicts)
            found = stranger.loop.run(stranger.node.protocol.call_find(PeerID.from_base58(peer),
                                                                       [DHTID.generate(source=key)]), timeout=30)
            assert found is not None, peer
            value_found = found[DHTID.generate(source=key)][0]
            assert value_found is None or stranger.identity.peer_id not in dict(value_found.value.items()), peer
    finally:
        stranger.close()


# ---- a server's own announcements fit the cap -----------------------------------------------------------------------
def test_a_server_of_more_blocks_than_a_store_request_carries_has_each_blocks_record_stored(open_node: OpenNode
                                                                                            ) -> None:
    blocks = 2 * MAX_STORE_RECORDS + 5
    loop = LoopThread("announcing-server")
    try:
        # Given a full node that announces a span of more blocks than one store request may carry
        p2p, node = loop.run(start_dht_node(open_node.maddrs, NetworkOptions(), client_mode=False), timeout=60)
        assert isinstance(node, GuardedDHTNode)
        try:
            budget = CacheBudget(1000, blocks, owner_share=0.5)
            status = ServerStatus(
                state=ServerState.ONLINE, model_id="big", peer_id=p2p.peer_id.to_base58(), dtype="float32",
                quant="none", version=PROTOCOL_VERSION, revision="r", max_batch_size=8, max_length=64,
                max_sessions_per_peer=3, stats=ServerCounters(),
                span=SpanStatus(start=0, end=blocks, throughput=10.0, sessions=0, forwards=0, cache=budget.use()))
            announcer = Announcer(node, status=lambda: status, update_period=30)
            # When it announces, then the other node stores its record under every block
            assert loop.run(announcer.announce(), timeout=60)
            stored = [open_node.node.protocol.storage.get(DHTID.generate(source=block_uid("big", i)))
                      for i in range(blocks)]
            assert all(item is not None and status.peer_id in dict(item.value.items()) for item in stored)
        finally:
            loop.run(stop_dht_node(p2p, node), timeout=20)
    finally:
        loop.stop()
