"""A stranger on the network, for tests that send DHT records for real: `Outsider`, a plain hivemind DHT node with its
own key and no validator (it keeps whatever it is told to and answers finds with it), and what the tests send."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer

from launch.local_swarm import LocalSwarm
from swarmnet.data_structures import PROTOCOL_VERSION, ServerInfo, ServerState
from swarmnet.identity import Identity
from swarmnet.network import LoopThread
from swarmnet.records import MAX_VALUE_BYTES, record_payload

FIND_HANDLER = "DHTProtocol.rpc_find"  # hivemind's handler name for finds
ENVELOPE_OVERHEAD = 560  # bytes a signed envelope adds to its value: an RSA-2048 key (294), a signature (256), headers


class Outsider:
    """Someone on the network but outside the swarm: a hivemind DHT node with its own key and no validator."""

    def __init__(self, initial_peers: list[str], key_path: Path) -> None:
        self.identity = Identity.load_or_create(key_path)
        self.loop = LoopThread("outsider")
        self.p2p, self.node = self.loop.run(self._start(initial_peers), timeout=60)

    async def _start(self, initial_peers: list[str]) -> tuple[P2P, DHTNode]:
        p2p = await P2P.create(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                               identity_path=str(self.identity.path), check_if_identity_free=False)
        return p2p, await DHTNode.create(p2p=p2p, initial_peers=initial_peers)

    def store_at(self, peer_id: str, key: str, subkey: Any, value: bytes, expiration_time: float,
                 in_cache: bool = False) -> bool:
        """Ask one node to store one record (value: the bytes on the wire); whether it accepted."""
        result = self.loop.run(self.node.protocol.call_store(
            PeerID.from_base58(peer_id), keys=[DHTID.generate(source=key)], values=[value],
            expiration_time=[expiration_time], subkeys=[subkey], in_cache=in_cache), timeout=30)
        assert result is not None, f"{peer_id} did not answer the store"
        return bool(result[0])

    def keep(self, key: str, subkey: str, value: bytes, expiration_time: float) -> None:
        """Keep a record in the outsider's own storage: it answers finds with it."""
        assert self.node.protocol.storage.store(DHTID.generate(source=key), value, expiration_time, subkey=subkey)

    def store_many_at(self, peer_id: str, records: list[tuple[str, str, bytes, float]]) -> list[bool]:
        """Ask one node to store several records (key, subkey, value on the wire, expiration) in one request."""
        keys, subkeys, values, expirations = zip(*records, strict=True)
        result = self.loop.run(self.node.protocol.call_store(
            PeerID.from_base58(peer_id), keys=[DHTID.generate(source=key) for key in keys], values=list(values),
            expiration_time=list(expirations), subkeys=list(subkeys)), timeout=60)
        assert result is not None, f"{peer_id} did not answer the store"
        return [bool(ok) for ok in result]

    def sign(self, key: str, subkey: str, value: bytes, expiration_time: float) -> bytes:
        """`value` in an envelope signed with the outsider's own key, whatever the subkey."""
        return signed_by(self.identity, key, subkey, value, expiration_time)

    def answer_finds_with_an_endless_empty_record(self) -> None:
        """From now on, answer every find with an empty dictionary that expires never (and true neighbours).

        hivemind ends a search for the latest record as soon as one answer expires no earlier than `inf`.
        """
        async def endless(request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
            response = await self.node.protocol.rpc_find(request, context)
            for result in response.results:
                result.type, result.expiration_time = dht_pb2.FOUND_DICTIONARY, float("inf")
                result.value = MSGPackSerializer.dumps(DictionaryDHTValue())
            return response

        async def replace() -> None:
            await self.p2p.remove_protobuf_handler(FIND_HANDLER)
            await self.p2p.add_protobuf_handler(FIND_HANDLER, endless, dht_pb2.FindRequest)
        self.loop.run(replace(), timeout=10)

    def close(self) -> None:
        async def stop() -> None:
            await self.node.shutdown()
            await self.p2p.shutdown()
        try:
            self.loop.run(stop(), timeout=10)
        finally:
            self.loop.stop()


def signed_by(identity: Identity, key: str, subkey: str, value: bytes, expiration_time: float) -> bytes:
    """`value` in an envelope signed with `identity`'s key, whatever the subkey (valid when the subkey is its peer id)."""
    record = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey), value, expiration_time)
    signature = identity.sign(record_payload(record, value))
    return msgpack.packb([value, identity.public_key_der, signature], use_bin_type=True)


def biggest_junk() -> bytes:
    """A valid msgpack value (not an announcement) whose signed envelope is exactly MAX_VALUE_BYTES: the most a
    stranger can make honest nodes store per record."""
    return MSGPackSerializer.dumps(b"\0" * (MAX_VALUE_BYTES - ENVELOPE_OVERHEAD - 3))


def honest_peers(swarm: LocalSwarm) -> list[str]:
    """Peer ids of the DHT node and the servers."""
    return [swarm.initial_peers[0].rsplit("/p2p/", 1)[1], *(server.peer_id for server in swarm.servers)]


def wire(state: ServerState, start: int, end: int) -> bytes:
    info = ServerInfo(state=state, start=start, end=end, throughput=1e6, cache_tokens_left=10**6, dtype="float32",
                      quant="none", version=PROTOCOL_VERSION, revision="r", max_batch_size=64, max_length=2048)
    return MSGPackSerializer.dumps(info.to_wire())


