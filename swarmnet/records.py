"""Signed, short-lived DHT records: only a peer id's owner writes under it, and no record outlives its writer.

Servers announce `{model_id}.{i}` -> {peer id (subkey): ServerInfo}. hivemind keeps, per subkey, the record that
expires last, so without this anyone could store an OFFLINE record under an honest server's peer id, expiring in a
year, and every node would then refuse that server's own (earlier-expiring) announcements. `SignedRecordValidator`
runs on every DHT node, on every record it is asked to store and every record a peer answers a find with:

* a record must have a subkey, and the subkey must be a peer id;
* its value must be an envelope [value, public key, signature] whose public key *is* that peer id (the peer id is
  the key's multihash) and whose signature covers key, subkey, value and expiration time;
* it may expire at most `max_ttl` seconds from now (MAX_RECORD_TTL on full nodes).

Everything else is refused. A non-member's correctly self-signed record is valid here: this module makes records
unforgeable, and who belongs to the swarm is decided where records are read.

What a stranger controls costs a node little: sizes are checked before anything is parsed (MAX_KEY_BYTES,
MAX_SUBKEY_BYTES, MAX_VALUE_BYTES; an announcement is about 1 KB), msgpack unpacks under limits that fit a peer id or an
envelope and nothing bigger, only RSA-2048/3072 keys with e = 65537 are verified (`identity.usable_key`), and the cache
of verified records keeps successes only, keyed by a digest (`VerifiedRecords`): a flood of refused records leaves
nothing behind. Before any record reaches the validator, what hivemind decodes from peers (whole dictionaries in
find answers and store requests) is bounded too, and a store request of more than MAX_STORE_RECORDS records is
refused whole: see swarmnet/dht_wire.py.

hivemind drops a peer's whole answer for a key when one of its entries is invalid. A forged entry thus hides only
the answer of the node that keeps it; honest nodes refuse it on store, so their answers stay whole and readers
still get every honest record from them. That holds only if readers never refuse what honest nodes accepted: a
reader whose clock is behind would refuse a record stored at the edge of the limit and drop the storing node's whole
answer, so read-only nodes accept READ_CLOCK_TOLERANCE seconds more (see `reader_validator`).

In a private swarm a full node stores records from members only (`GuardedDHTNode.guard_stores`): a stranger who
reaches its port can neither fill its storage nor swell its answers past p2pd's 4 MiB message limit, which would drop
every honest record from them. Members are peer ids (servers and DHT nodes); client-mode nodes never store.

Two more ways one peer could hide honest records from a reader are closed by `GuardedDHTNode`, the DHT node every
swarmbatch process runs: a node answers finds from all it stores (its cache keeps nothing, see `NoCache`), and an
answer's expiration time is the latest of its records' (one claiming "never" would end a reader's search at once).
In an open swarm, where anyone's self-signed records are stored, a node keeps at most 1024 records per key and
answers within p2pd's message limit (`swarmnet.dht_storage`).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgpack
from hivemind.dht.node import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from swarmnet.data_structures import MAX_RECORD_TTL, RECORD_TTL_SLACK
from swarmnet.dht_storage import BoundedStorage, find_answerer
from swarmnet.dht_wire import (  # the caps on what peers send live with the decoder that enforces them first
    MAX_FIND_BYTES,
    MAX_KEY_BYTES,
    MAX_PEER_ID_CHARS,
    MAX_STORE_BYTES,
    MAX_STORE_RECORDS,
    MAX_SUBKEY_BYTES,
    MAX_VALUE_BYTES,
    STORE_RECORDS_PER_SECOND,
    BoundedSerializer,
    Undecodable,
    WriterBudget,
    decode_dictionary,
    find_answer_refusal,
    find_request_refusal,
    store_request_charge,
    store_request_refusal,
)
from swarmnet.identity import Identity, accepted_public_key, peer_id_of_public_key, verify

logger = logging.getLogger(__name__)

SIGNATURE_DOMAIN = "swarmbatch/dht-record/1"  # signatures by the same key over other data can never pass as records
READ_CLOCK_TOLERANCE = RECORD_TTL_SLACK  # read-only nodes accept a record this much further ahead (clock skew)
VERIFIED_CACHE_SIZE = 4096  # digests of verified records kept (32 bytes each)
MAX_LOGGED_STRANGERS = 100  # refused writers logged by name (one line each); more are refused silently


def record_payload(record: DHTRecord, value: bytes) -> bytes:
    """The bytes a record's signature covers: key, subkey, (unwrapped) value and expiration time."""
    return msgpack.packb([SIGNATURE_DOMAIN, record.key, record.subkey, value, float(record.expiration_time)],
                         use_bin_type=True)


def open_envelope(value: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(value, public key DER, signature) of a signed value; None when `value` is not an envelope.

    Unpacked under limits: three byte strings, none longer than the value itself, and no other container.
    """
    try:
        fields = msgpack.unpackb(value, raw=False, use_list=True, max_array_len=3, max_bin_len=MAX_VALUE_BYTES,
                                 max_str_len=0, max_map_len=0, max_ext_len=0)
    except Exception:  # msgpack raises several unrelated types on malformed input
        return None
    if not (isinstance(fields, list) and len(fields) == 3 and all(isinstance(f, bytes) for f in fields)):
        return None
    return fields[0], fields[1], fields[2]


def subkey_peer_id(subkey: bytes) -> str | None:
    """The peer id a subkey names (hivemind msgpack-serializes subkeys); None for no subkey or another type."""
    try:
        value: Any = msgpack.unpackb(subkey, raw=False, max_str_len=MAX_PEER_ID_CHARS, max_bin_len=0,
                                     max_array_len=0, max_map_len=0, max_ext_len=0)
    except Exception:  # over a limit, or not msgpack
        return None
    return value if isinstance(value, str) and value else None


class VerifiedRecords:
    """Digests of the records whose signatures were verified, the latest VERIFIED_CACHE_SIZE (successes only).

    A reader gets the same records from every node that stores them, and again at every read, so each is verified
    once. Refusals are never kept: what a stranger sends leaves nothing behind.
    """

    def __init__(self, size: int = VERIFIED_CACHE_SIZE) -> None:
        self.size = size
        self.digests: OrderedDict[bytes, None] = OrderedDict()
        self.verifications = 0  # signatures checked (cache misses that got as far as the key)

    def __contains__(self, digest: bytes) -> bool:
        if digest in self.digests:
            self.digests.move_to_end(digest)
            return True
        return False

    def add(self, digest: bytes) -> None:
        """Remember a verified record, forgetting the least recently used past `size`."""
        self.digests[digest] = None
        if len(self.digests) > self.size:
            self.digests.popitem(last=False)


VERIFIED = VerifiedRecords()  # one per process: every validator of it shares what was verified


def record_digest(record: DHTRecord) -> bytes:
    """SHA-256 of everything a record's validity depends on."""
    return hashlib.sha256(msgpack.packb([record.key, record.subkey, record.value, float(record.expiration_time)],
                                        use_bin_type=True)).digest()


def owner_signature_refusal(record: DHTRecord, peer_id: str) -> str | None:
    """Why the record is not signed by `peer_id`'s key, or None when it is (verified once per record: VERIFIED)."""
    digest = record_digest(record)
    if digest in VERIFIED:
        return None
    refusal = _signature_refusal(record, peer_id)
    if refusal is None:
        VERIFIED.add(digest)
    return refusal


def _signature_refusal(record: DHTRecord, peer_id: str) -> str | None:
    envelope = open_envelope(record.value)
    if envelope is None:
        return f"unsigned record under {peer_id}"
    value, public_key, signature = envelope
    if peer_id_of_public_key(public_key) != peer_id:
        return f"record under {peer_id} signed by another key"
    if not accepted_public_key(public_key):  # before any RSA arithmetic: the key's owner picks its cost
        return f"record under {peer_id} signed by a key other than RSA-2048/3072 with e = 65537"
    VERIFIED.verifications += 1
    if not verify(public_key, record_payload(record, value), signature):
        return f"bad signature under {peer_id}"
    return None


class SignedRecordValidator(RecordValidatorBase):
    """Signs this node's own records (subkey = its peer id) and refuses every record its subkey's owner did not sign.

    `identity` is the key of this node's libp2p peer id; without one (a client) it signs nothing and only checks.
    """

    def __init__(self, identity: Identity | None = None, *, max_ttl: float = MAX_RECORD_TTL) -> None:
        self.identity, self.max_ttl = identity, max_ttl
        self._own_subkey = None if identity is None else MSGPackSerializer.dumps(identity.peer_id)
        self._public_key = None if identity is None else identity.public_key_der

    def sign_value(self, record: DHTRecord) -> bytes:
        """Wrap our own records (subkey = our peer id) in a signed envelope; others pass unchanged (and are refused)."""
        if self.identity is None or record.subkey != self._own_subkey:
            return record.value
        signature = self.identity.sign(record_payload(record, record.value))
        return msgpack.packb([record.value, self._public_key, signature], use_bin_type=True)

    def validate(self, record: DHTRecord) -> bool:
        """Whether the record is signed by its subkey's owner and expires within `max_ttl`."""
        refusal = self.refusal(record)
        if refusal is not None:
            logger.debug("Refused a DHT record: %s", refusal)
        return refusal is None

    def refusal(self, record: DHTRecord) -> str | None:
        """Why the record is refused, or None when it is valid. Sizes first: nothing oversized is parsed."""
        oversized = size_refusal(record)
        if oversized is not None:
            return oversized
        peer_id = subkey_peer_id(record.subkey)
        if peer_id is None:
            return "no peer id subkey"
        if record.expiration_time > get_dht_time() + self.max_ttl:
            return f"expires {record.expiration_time - get_dht_time():.0f} s from now (limit {self.max_ttl:.0f} s)"
        return owner_signature_refusal(record, peer_id)

    def strip_value(self, record: DHTRecord) -> bytes:
        """The value inside the envelope (called only on records that passed `validate`)."""
        envelope = open_envelope(record.value)
        return record.value if envelope is None else envelope[0]


def size_refusal(record: DHTRecord) -> str | None:
    """Why a record is too big to look at (its key, subkey or value), or None."""
    for part, data, limit in (("key", record.key, MAX_KEY_BYTES), ("subkey", record.subkey, MAX_SUBKEY_BYTES),
                              ("value", record.value, MAX_VALUE_BYTES)):
        if len(data) > limit:
            return f"a {part} of {len(data)} bytes (limit {limit})"
    return None


def reader_validator() -> SignedRecordValidator:
    """The validator of a read-only (client-mode) node: checks only, and tolerates READ_CLOCK_TOLERANCE of skew.

    A client never stores records for others, so accepting a little more never lets a long-lived record in; and
    refusing one that a full node accepted would drop that node's whole answer for the key, honest entries included.
    """
    return SignedRecordValidator(max_ttl=MAX_RECORD_TTL + READ_CLOCK_TOLERANCE)


class NoCache(DHTLocalStorage):
    """A DHT node's cache that keeps nothing: answers to finds come from the node's storage, which holds every record.

    hivemind answers a find from its cache instead of its storage whenever the cached value expires later, and any
    peer may push values into another node's cache. One valid record (anyone's own, signed) expiring a minute ahead,
    pushed there, would replace every announcement that node stores for the key in its answers, on every node it is
    pushed to. Readers here look for the latest of every record anyway (sufficient_expiration_time=inf), so a cache
    saves them no lookup.
    """

    def store(self, key: DHTID, value: bytes, expiration_time: float, subkey: Any = None) -> bool:
        """Refuse (nothing is cached)."""
        return False

    def store_subkey(self, key: DHTID, subkey: Any, value: bytes, expiration_time: float) -> bool:
        """Refuse (nothing is cached)."""
        return False


class UnparsedRequest:
    """A request's bytes, unparsed: the input type `guard_stores` registers its handler with, so that it can measure a
    request before protobuf parses it. hivemind 1.1.12's unary handler wrapper (`P2P._add_protobuf_unary_handler`)
    makes its handler's argument with `input_protobuf_type.FromString(bytes)`; here that keeps the bytes."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    @classmethod
    def FromString(cls, data: bytes) -> UnparsedRequest:  # noqa: N802 (protobuf's name)
        """Keep `data` as it came."""
        return cls(data)


class GuardedDHTNode(DHTNode):
    """hivemind's DHTNode, with no cache, bounded decoding, guarded stores, and the expiration time of every answer
    recomputed from its records.

    A reader looking for the latest of every record (sufficient_expiration_time=inf) stops searching at the first
    answer claiming to expire no earlier than that; an answer's own expiration time is the answering peer's word,
    checked by no validator. Recomputed from the (validated) records it carries, it is never later than
    `max_ttl` from now, so a reader always asks every node near the key. An answer without records is no answer.
    """

    @classmethod
    async def create(cls, *args: Any, initial_peers: Sequence[str] = (), writers: Callable[[str], bool] | None = None,
                     ensure_bootstrap_success: bool = True, wait_timeout: float = 3, **kwargs: Any
                     ) -> GuardedDHTNode:
        """`DHTNode.create`, guarded before it meets any peer: caching nothing (`NoCache`: readers want the latest
        records, not the nearest copy), decoding peers' values within bounds (`BoundedSerializer`), and, on a full
        node, answering store requests through `guard_stores` (with `writers`, a private swarm's members only) and
        find requests through `guard_finds`, from a `BoundedStorage` and within its answer budget
        (`dht_storage.find_answerer`). Peers' find answers are read by `_find` (a bounded `call_find`).

        hivemind would bootstrap inside `DHTNode.create`, before any of that is in place; the node is created alone
        and joins `initial_peers` afterwards (`_join`, hivemind's own three stages).
        """
        node = await super().create(*args, initial_peers=None, wait_timeout=wait_timeout, cache_locally=False,
                                    cache_nearest=0, cache_on_store=False, **kwargs)
        assert isinstance(node, GuardedDHTNode)
        protocol = node.protocol
        protocol.cache = NoCache()
        storage = protocol.storage = BoundedStorage.taking_over(protocol.storage)
        protocol.serializer = BoundedSerializer  # an instance attribute: only this node's protocol decodes this way
        if not protocol.client_mode:
            await node.guard_stores(protocol.p2p, writers)
            await node.guard_finds(protocol.p2p, find_answerer(protocol, storage))
        if initial_peers:
            await node._join(initial_peers, validate=ensure_bootstrap_success, timeout=wait_timeout)
        return node

    async def _join(self, initial_peers: Sequence[str], *, validate: bool, timeout: float) -> None:
        """hivemind 1.1.12's bootstrap from `DHTNode.create` (strict=True): ping the initial peers (raise if none
        answers, when `validate`), then look up this node's own id to fill the routing table, within `timeout`."""
        began = get_dht_time()
        peers = {PeerID.from_base58(Multiaddr(item)["p2p"]) for item in initial_peers}
        pings = {asyncio.create_task(self.protocol.call_ping(peer, validate=validate, strict=True)) for peer in peers}
        answered, pending = await asyncio.wait(pings, return_when=asyncio.FIRST_COMPLETED)
        if pending:
            in_time, late = await asyncio.wait(pending, timeout=timeout - get_dht_time() + began)
            for ping in late:
                ping.cancel()
            answered |= in_time
        if all(ping.result() is None for ping in answered):  # result() raises what a strict ping raised
            message = f"none of them answered a ping within {timeout:g} s"
            if validate:
                raise RuntimeError(message)
            logger.warning("DHT bootstrap: %s", message)
        for ping in answered:
            ping.result()
        await asyncio.wait([asyncio.create_task(self.find_nearest_nodes([self.node_id])),
                            asyncio.create_task(asyncio.sleep(timeout - get_dht_time() + began))],
                           return_when=asyncio.FIRST_COMPLETED)

    @property
    def identity(self) -> Identity | None:
        """The key this node signs its records with (its peer id's), if it is a full node."""
        validator = self.protocol.record_validator
        return validator.identity if isinstance(validator, SignedRecordValidator) else None

    async def guard_stores(self, p2p: P2P, writers: Callable[[str], bool] | None) -> None:
        """Answer store requests only within `dht_wire`'s caps and each writer's record budget (`WriterBudget`) and,
        with `writers`, only from peers it admits (a private swarm's members); others are refused whole, before any
        record is decoded or any signature verified.
        A request over MAX_STORE_BYTES is refused unparsed. Replaces the store handler hivemind registered on `p2p`.
        """
        protocol = self.protocol
        name = DHTProtocol._get_handle_name(None, DHTProtocol.rpc_store.__name__)
        logged: set[str] = set()
        budget = WriterBudget()  # record checks per writer and second

        def refuse(writer: str, why: str, count: int = 0) -> dht_pb2.StoreResponse:
            if writer not in logged and len(logged) < MAX_LOGGED_STRANGERS:  # a line per writer, bounded
                logged.add(writer)
                logger.info("Refused DHT records from %s: %s", writer[-8:], why)
            # a verdict per record where they were counted and are few; else none (hivemind reads that as refused)
            return dht_pb2.StoreResponse(store_ok=[False] * count if count <= MAX_STORE_RECORDS else [],
                                         peer=protocol.node_info)

        async def store_within_limits(raw: UnparsedRequest, context: P2PContext) -> dht_pb2.StoreResponse:
            writer, size = context.remote_id.to_base58(), len(raw.data)
            request = dht_pb2.StoreRequest.FromString(raw.data) if size <= MAX_STORE_BYTES else None
            if writers is not None and not writers(writer):
                return refuse(writer, "not a member of this swarm", 0 if request is None else len(request.keys))
            if request is None:
                return refuse(writer, f"a store request of {size} bytes (limit {MAX_STORE_BYTES})")
            refusal = store_request_refusal(request)
            if refusal is not None:
                return refuse(writer, refusal, len(request.keys))
            if not budget.take(writer, store_request_charge(request)):
                return refuse(writer, f"over {STORE_RECORDS_PER_SECOND} records a second", len(request.keys))
            return await protocol.rpc_store(request, context)

        await p2p.remove_protobuf_handler(name)
        await p2p.add_protobuf_handler(name, store_within_limits, UnparsedRequest)  # type: ignore[arg-type]

    async def guard_finds(self, p2p: P2P, answer: Callable[[dht_pb2.FindRequest, P2PContext],
                                                           Awaitable[dht_pb2.FindResponse]]) -> None:
        """Answer find requests of at most MAX_FIND_KEYS keys (measured before parsing: MAX_FIND_BYTES) with `answer`
        (`dht_storage.find_answerer`); others get an empty answer, which hivemind's reader counts as none. Replaces
        the find handler hivemind registered on `p2p`."""
        protocol = self.protocol
        name = DHTProtocol._get_handle_name(None, DHTProtocol.rpc_find.__name__)

        async def find_within_limits(raw: UnparsedRequest, context: P2PContext) -> dht_pb2.FindResponse:
            if len(raw.data) > MAX_FIND_BYTES:
                return dht_pb2.FindResponse(peer=protocol.node_info)
            request = dht_pb2.FindRequest.FromString(raw.data)
            if find_request_refusal(request) is not None:
                return dht_pb2.FindResponse(peer=protocol.node_info)
            return await answer(request, context)

        await p2p.remove_protobuf_handler(name)
        await p2p.add_protobuf_handler(name, find_within_limits, UnparsedRequest)  # type: ignore[arg-type]

    async def _call_find_with_blacklist(self, peer_id: PeerID, keys: Any) -> Any:
        """hivemind 1.1.12's (skip blacklisted peers, drop blacklisted neighbours), over `_find` instead of
        `DHTProtocol.call_find`, and with each dictionary answer's expiration recomputed from its records."""
        if peer_id in self.blacklist:
            return None
        response = await self._find(peer_id, keys)
        if not response:
            self.blacklist.register_failure(peer_id)
            return None
        self.blacklist.register_success(peer_id)
        return {key: (expiring_when_its_records_do(found), self._filter_blacklisted(nearest))
                for key, (found, nearest) in response.items()}

    async def _find(self, peer: PeerID, keys: Any) -> dict[DHTID, tuple[ValueWithExpiration[Any] | None,
                                                                        dict[DHTID, PeerID]]] | None:
        """hivemind 1.1.12's `DHTProtocol.call_find`, with the peer's answer checked for shape before any of it is
        decoded (`find_answer_refusal`: a result per key, at most a bucket of neighbours each), dictionaries decoded
        by `decode_dictionary`, and a bad answer counted as none (the peer leaves the routing table), as hivemind
        does when decoding one raises. For each key: its value (None if not found or refused), its neighbours."""
        protocol, keys = self.protocol, list(keys)
        request = dht_pb2.FindRequest(keys=[key.to_bytes() for key in keys], peer=protocol.node_info)
        try:
            async with protocol.rpc_semaphore:
                response = await protocol.get_stub(peer).rpc_find(request, timeout=protocol.wait_timeout)
            refusal = find_answer_refusal(len(keys), response, protocol.bucket_size)
            if refusal is not None:
                raise Undecodable(refusal)
            if response.peer and response.peer.node_id:
                asyncio.create_task(protocol.update_routing_table(DHTID.from_bytes(response.peer.node_id), peer,
                                                                  responded=True))
            output: dict[DHTID, tuple[ValueWithExpiration[Any] | None, dict[DHTID, PeerID]]] = {}
            for key, result in zip(keys, response.results, strict=True):
                nearest = dict(zip(map(DHTID.from_bytes, result.nearest_node_ids), map(PeerID, result.nearest_peer_ids),
                                   strict=True))
                output[key] = self._found(key.to_bytes(), result), nearest
            return output
        except Exception as e:
            logger.debug("No answer from %s to a find: %s", peer, e)
            asyncio.create_task(protocol.update_routing_table(protocol.routing_table.get(peer_id=peer), peer,
                                                              responded=False))
            return None

    def _found(self, key: bytes, result: dht_pb2.FindResult) -> ValueWithExpiration[Any] | None:
        """One result's value if it holds a valid one (hivemind's `call_find`, per result)."""
        protocol = self.protocol
        if result.type == dht_pb2.FOUND_REGULAR:
            if not protocol._validate_record(key, protocol.IS_REGULAR_VALUE, result.value, result.expiration_time):
                return None
            return ValueWithExpiration(result.value, result.expiration_time)
        if result.type == dht_pb2.FOUND_DICTIONARY:
            dictionary = decode_dictionary(result.value)  # Undecodable drops the whole answer, as hivemind does
            if not protocol._validate_dictionary(key, dictionary):
                return None
            return ValueWithExpiration(dictionary, result.expiration_time)
        return None  # NOT_FOUND


def expiring_when_its_records_do(found: Any) -> Any:
    """A dictionary answer stamped with its latest record's expiration (None if it holds none); others as they are.

    Regular values need no restamp: their one record's expiration is the one the validator checked.
    """
    if found is None or not isinstance(found.value, DictionaryDHTValue):
        return found
    expirations = [item.expiration_time for _, item in found.value.items()]
    return ValueWithExpiration(found.value, max(expirations)) if expirations else None
