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

hivemind drops a peer's whole answer for a key when one of its entries is invalid. A forged entry thus hides only
the answer of the node that keeps it; honest nodes refuse it on store, so their answers stay whole and readers
still get every honest record from them. That holds only if readers never refuse what honest nodes accepted: a
reader whose clock is behind would refuse a record stored at the edge of the limit and drop the storing node's whole
answer, so read-only nodes accept READ_CLOCK_TOLERANCE seconds more (see `reader_validator`).

Two more ways one peer could hide honest records from a reader are closed by `GuardedDHTNode`, the DHT node every
swarmbatch process runs: a node answers finds from all it stores (its cache keeps nothing, see `NoCache`), and an
answer's expiration time is the latest of its records' (one claiming "never" would end a reader's search at once).
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import msgpack
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time

from swarmnet.data_structures import MAX_RECORD_TTL, RECORD_TTL_SLACK
from swarmnet.identity import Identity, peer_id_of_public_key, verify

logger = logging.getLogger(__name__)

SIGNATURE_DOMAIN = "swarmbatch/dht-record/1"  # signatures by the same key over other data can never pass as records
READ_CLOCK_TOLERANCE = RECORD_TTL_SLACK  # read-only nodes accept a record this much further ahead (clock skew)


def record_payload(record: DHTRecord, value: bytes) -> bytes:
    """The bytes a record's signature covers: key, subkey, (unwrapped) value and expiration time."""
    return msgpack.packb([SIGNATURE_DOMAIN, record.key, record.subkey, value, float(record.expiration_time)],
                         use_bin_type=True)


def open_envelope(value: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(value, public key DER, signature) of a signed value; None when `value` is not an envelope."""
    try:
        fields = msgpack.unpackb(value, raw=False, use_list=True)
    except Exception:  # msgpack raises several unrelated types on malformed input
        return None
    if not (isinstance(fields, list) and len(fields) == 3 and all(isinstance(f, bytes) for f in fields)):
        return None
    return fields[0], fields[1], fields[2]


def subkey_peer_id(subkey: bytes) -> str | None:
    """The peer id a subkey names (hivemind msgpack-serializes subkeys); None for no subkey or another type."""
    try:
        value: Any = msgpack.unpackb(subkey, raw=False)
    except Exception:
        return None
    return value if isinstance(value, str) and value else None


@functools.lru_cache(maxsize=4096)
def owner_signature_refusal(record: DHTRecord, peer_id: str) -> str | None:
    """Why the record is not signed by `peer_id`'s key, or None when it is.

    Cached: the answer depends on the record's bytes only, and a reader gets the same records from every node that
    stores them (and again at every read), so each is verified once.
    """
    envelope = open_envelope(record.value)
    if envelope is None:
        return f"unsigned record under {peer_id}"
    value, public_key, signature = envelope
    if peer_id_of_public_key(public_key) != peer_id:
        return f"record under {peer_id} signed by another key"
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
        """Why the record is refused, or None when it is valid."""
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


class GuardedDHTNode(DHTNode):
    """hivemind's DHTNode, with no cache and with the expiration time of every answer recomputed from its records.

    A reader looking for the latest of every record (sufficient_expiration_time=inf) stops searching at the first
    answer claiming to expire no earlier than that; an answer's own expiration time is the answering peer's word,
    checked by no validator. Recomputed from the (validated) records it carries, it is never later than
    `max_ttl` from now, so a reader always asks every node near the key. An answer without records is no answer.
    """

    @classmethod
    async def create(cls, *args: Any, **kwargs: Any) -> GuardedDHTNode:
        """`DHTNode.create`, caching nothing (`NoCache`): readers want the latest records, not the nearest copy."""
        node = await super().create(*args, cache_locally=False, cache_nearest=0, cache_on_store=False, **kwargs)
        node.protocol.cache = NoCache()
        assert isinstance(node, GuardedDHTNode)
        return node

    async def _call_find_with_blacklist(self, peer_id: PeerID, keys: Any) -> Any:
        response = await super()._call_find_with_blacklist(peer_id, keys)
        if not response:
            return response
        return {key: (expiring_when_its_records_do(found), nearest) for key, (found, nearest) in response.items()}


def expiring_when_its_records_do(found: Any) -> Any:
    """A dictionary answer stamped with its latest record's expiration (None if it holds none); others as they are.

    Regular values need no restamp: their one record's expiration is the one the validator checked.
    """
    if found is None or not isinstance(found.value, DictionaryDHTValue):
        return found
    expirations = [item.expiration_time for _, item in found.value.items()]
    return ValueWithExpiration(found.value, max(expirations)) if expirations else None
