"""What a DHT node accepts from its peers on the wire, bounded before anything is decoded or verified.

hivemind (1.1.12, pinned in pyproject.toml; the behaviour below was read in its `dht/protocol.py`, `dht/node.py`,
`dht/storage.py` and `utils/serializer.py`) decodes what peers send with `DHTProtocol.serializer`, which is
`MSGPackSerializer`, with no limits and BEFORE any record validator sees it:

* `DHTProtocol.call_find` decodes a FOUND_DICTIONARY answer whole (`serializer.loads(result.value)`), then validates
  its records;
* `DHTProtocol.rpc_store` decodes a store of a whole dictionary (subkey tag `IS_DICTIONARY`, b"") the same way, and,
  once a record is validated, its subkey (`serializer.loads(tag)`);
* `_SearchState.finish_search` (`dht/node.py`) decodes each validated value, stripped to what its owner signed.

`MSGPackSerializer` turns ext type 0x50 into a `DictionaryDHTValue` by calling `MSGPackSerializer.loads` again, at
any depth and with any number of items: one 1.24 MiB answer of nested empty arrays cost a reader's event loop about
a second, and a 4 MiB one (p2pd's message limit) several, before being refused.

Every DHT node we run (`GuardedDHTNode.create`, swarmnet/records.py) sets `BoundedSerializer` as its protocol's
`serializer` (an instance attribute: hivemind reads `self.serializer` in all three places above, and
`self.protocol.serializer` in node.py). It checks a buffer's length before unpacking it, accepts ext type 0x50 only
as a whole dictionary (never nested) and parses that by its known shape, item by item, under the caps below; any
other ext type is refused. It encodes exactly as hivemind does. Find answers are read by `GuardedDHTNode._find`,
which checks their shape and decodes their dictionaries with `decode_dictionary`.

`GuardedDHTNode` also answers store requests through `store_request_refusal` first, on every full node (open swarms
too): a request of more than MAX_STORE_BYTES bytes is refused unparsed, one of more than MAX_STORE_RECORDS records (a
dictionary counts its items) before any record is decoded or any signature verified, so one request costs a node
at most MAX_STORE_RECORDS RSA verifications (each about 0.03-0.05 ms for RSA-2048, 0.1 ms for RSA-3072, see
`identity.usable_key`). It answers find requests of at most MAX_FIND_KEYS keys (`find_request_refusal`: a 3.3 MB
find of 150,000 keys held a node's loop 0.9 s), and reads peers' find answers only in the shape an honest node
gives them (`find_answer_refusal`). Each writer (by its libp2p-proven peer id) may have a node check at most
STORE_RECORDS_PER_SECOND records a second (STORE_RECORDS_BURST at once, `WriterBudget`); beyond that its requests are
refused before any record is verified, so one stranger flooding an open swarm's node with small requests of badly
signed records costs it at most that many verifications a second (about 9 ms of CPU a second with RSA-2048 keys).

The caps follow from what a legitimate record can be (MAX_KEY_BYTES, MAX_SUBKEY_BYTES, MAX_VALUE_BYTES, checked
again per record by `records.size_refusal`; a signed announcement is about 1.3 KB) and from what an honest node
answers a find of one key with (`dht_storage`: at most MAX_SUBKEYS_PER_KEY records, ANSWER_BYTES of them). Decoding
the largest such answer takes a few milliseconds; validating it, at most MAX_SUBKEYS_PER_KEY signature checks of
records not seen before (about 35 ms with RSA-2048 keys, 100 ms with RSA-3072 ones).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgpack
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer

from swarmnet.dht_storage import ANSWER_BYTES, MAX_SUBKEYS_PER_KEY  # what an honest node keeps and answers with

MAX_KEY_BYTES = 64         # a DHTID is 20 bytes
MAX_SUBKEY_BYTES = 128     # a msgpack-serialized peer id is about 50
MAX_VALUE_BYTES = 8192     # a signed announcement is about 1.3 KB: its ServerInfo, a 294-byte key, a 256-byte signature
MAX_PEER_ID_CHARS = 100    # a base58 RSA peer id has 46
MAX_ANSWER_SUBKEYS = MAX_SUBKEYS_PER_KEY  # records of one key in a find answer or a stored dictionary (1024)
MAX_STORE_RECORDS = 64     # records in one store request (hivemind sends a key's records alone: a server's one)
STORE_RECORDS_PER_SECOND = 256  # records one writer may have a node check per second, on average (WriterBudget)
STORE_RECORDS_BURST = 1024  # ... and at once: a server of 80 blocks announcing at a 1 s period stays far within both
MAX_TRACKED_WRITERS = 4096  # writers whose budgets a node remembers (the longest unseen is forgotten first)
MAX_FIND_KEYS = 256        # keys in one find request (discovery asks one block key per find, hivemind's bootstrap one)
RECORD_OVERHEAD = 32       # msgpack framing of a dictionary item and its expiration time, protobuf tags of a record
MAX_DICTIONARY_BYTES = ANSWER_BYTES + 1024  # a find answer holds at most ANSWER_BYTES of records (3 MiB) per key
MAX_STORE_BYTES = MAX_STORE_RECORDS * (MAX_KEY_BYTES + MAX_SUBKEY_BYTES + MAX_VALUE_BYTES + RECORD_OVERHEAD) + 1024  # 527 KiB
MAX_FIND_BYTES = MAX_FIND_KEYS * (MAX_KEY_BYTES + 4) + 1024  # 18 KiB (a key is 20 bytes on the wire)
DICTIONARY_EXT = 0x50      # hivemind's ext type code of DictionaryDHTValue (hivemind/dht/storage.py)
EXT_MARKERS = frozenset((0xc7, 0xc8, 0xc9, 0xd4, 0xd5, 0xd6, 0xd7, 0xd8))  # first bytes of msgpack ext objects
IS_DICTIONARY = b""        # hivemind's subkey tag of a store of a whole dictionary (DHTProtocol.IS_DICTIONARY)


class Undecodable(ValueError):
    """What a peer sent is over a cap or not of the shape a DHT value has."""


class BoundedSerializer(MSGPackSerializer):
    """hivemind's serializer for DHT values with every decode bounded; encodes exactly as `MSGPackSerializer`.

    `loads` takes either a whole dictionary (ext 0x50, what whole-dictionary stores carry) or one record's value or
    subkey (at most MAX_VALUE_BYTES, no ext types at all), and reads anything else -- over a cap, malformed, another
    ext type -- as None, never raising: hivemind also decodes each validated record's value with it
    (`_SearchState.finish_search`), where an exception would leave the reader's whole lookup unfinished until it
    times out, and a record's value is whatever its signer chose (a stranger's own record, in an open swarm). None
    is no announcement to our readers (`ServerInfo.from_wire`). Find answers are decoded by `decode_dictionary`
    instead, which raises: a malformed answer is dropped whole (`GuardedDHTNode._find`).
    """

    @classmethod
    def loads(cls, buf: bytes) -> object:
        """Decode a DHT value from a peer, within the caps; None for anything else."""
        try:
            return decode_dictionary(buf) if buf[:1] and buf[0] in EXT_MARKERS else decode_value(buf)
        except Undecodable:
            return None


def decode_value(buf: bytes) -> object:
    """One record's value or subkey: at most MAX_VALUE_BYTES of msgpack with no ext type (Undecodable otherwise)."""
    if len(buf) > MAX_VALUE_BYTES:
        raise Undecodable(f"a DHT value of {len(buf)} bytes (limit {MAX_VALUE_BYTES})")
    try:
        return msgpack.unpackb(buf, raw=False, ext_hook=_no_ext, max_bin_len=MAX_VALUE_BYTES,
                               max_str_len=MAX_VALUE_BYTES, max_array_len=MAX_VALUE_BYTES,
                               max_map_len=MAX_VALUE_BYTES, max_ext_len=0)
    except Undecodable:
        raise
    except Exception as e:  # msgpack raises several unrelated types on malformed input
        raise Undecodable(f"an undecodable DHT value ({type(e).__name__}: {e})") from e


def _no_ext(code: int, data: bytes) -> Any:
    """Only an empty ext object gets past max_ext_len=0 to here."""
    raise Undecodable(f"ext type {code} inside a DHT value")


def decode_dictionary(buf: bytes) -> DictionaryDHTValue:
    """A whole DictionaryDHTValue from a peer (its items, as hivemind's `DictionaryDHTValue.unpackb` stores them);
    Undecodable when over a cap or of another shape."""
    dictionary = DictionaryDHTValue()
    with dictionary.freeze():  # as hivemind: items are kept as sent, expired or not; the validator judges them
        for subkey, value, expiration in _dictionary_items(buf):
            dictionary.store(subkey, value, expiration)
    return dictionary


def _dictionary_items(buf: bytes) -> list[tuple[str | bytes | int, bytes, float]]:
    """The items of a whole dictionary, parsed by its shape: ext 0x50 holding [maxsize, latest expiration, items],
    each item [subkey, value bytes, expiration] (hivemind's `DictionaryDHTValue.packb`). Items hold scalars only;
    the sender's maxsize and latest expiration are not kept (the latter is recomputed from the items)."""
    if len(buf) > MAX_DICTIONARY_BYTES:
        raise Undecodable(f"a DHT dictionary of {len(buf)} bytes (limit {MAX_DICTIONARY_BYTES})")
    try:
        ext = msgpack.unpackb(buf, ext_hook=msgpack.ExtType, max_ext_len=MAX_DICTIONARY_BYTES, max_bin_len=0,
                              max_str_len=0, max_array_len=0, max_map_len=0)
    except Exception as e:
        raise Undecodable(f"an undecodable DHT dictionary ({type(e).__name__}: {e})") from e
    if not isinstance(ext, msgpack.ExtType) or ext.code != DICTIONARY_EXT:
        raise Undecodable("a DHT value of an ext type other than a dictionary")
    # containers only where the shape has them (read_array_header ignores max_array_len): every unpack() is a scalar
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(ext.data), 1), max_bin_len=MAX_VALUE_BYTES,
                                max_str_len=MAX_SUBKEY_BYTES, max_array_len=0, max_map_len=0, max_ext_len=0)
    unpacker.feed(ext.data)
    try:
        if unpacker.read_array_header() != 3:
            raise Undecodable("a DHT dictionary of another shape")
        unpacker.unpack()  # the sender's maxsize (inf) and latest expiration: scalars, not kept
        unpacker.unpack()
        count = unpacker.read_array_header()
        if count > MAX_ANSWER_SUBKEYS:
            raise Undecodable(f"a DHT dictionary of {count} records (limit {MAX_ANSWER_SUBKEYS})")
        items = []
        for _ in range(count):
            if unpacker.read_array_header() != 3:
                raise Undecodable("a DHT dictionary item of another shape")
            items.append((unpacker.unpack(), unpacker.unpack(), unpacker.unpack()))
        if unpacker.tell() != len(ext.data):
            raise Undecodable("a DHT dictionary with trailing bytes")
    except Undecodable:
        raise
    except Exception as e:  # OutOfData, a container where a scalar belongs, ...
        raise Undecodable(f"an undecodable DHT dictionary ({type(e).__name__}: {e})") from e
    typed = []
    for subkey, value, expiration in items:
        if not (isinstance(subkey, (str, bytes, int)) and isinstance(value, bytes)
                and isinstance(expiration, (int, float)) and not isinstance(expiration, bool)):
            raise Undecodable("a DHT dictionary item of other types")
        typed.append((subkey, value, float(expiration)))
    return typed


def find_request_refusal(request: dht_pb2.FindRequest) -> str | None:
    """Why a find request is not answered (an empty answer, which hivemind's reader counts as no answer), or None."""
    if len(request.keys) > MAX_FIND_KEYS:
        return f"a find request of {len(request.keys)} keys (limit {MAX_FIND_KEYS})"
    return None


def find_answer_refusal(keys: int, response: dht_pb2.FindResponse, nearest: int) -> str | None:
    """Why a peer's answer to a find of `keys` keys is dropped before any of it is decoded, or None: a result per key,
    and per result at most `nearest` neighbours (the bucket size an honest node answers with; hivemind's reader
    makes a DHTID and a PeerID of each, about 12 us apiece, so 4 MiB of them held its loop ~0.8 s)."""
    if len(response.results) != keys:
        return f"an answer of {len(response.results)} results to a find of {keys} keys"
    for result in response.results:
        if len(result.nearest_node_ids) > nearest or len(result.nearest_peer_ids) != len(result.nearest_node_ids):
            return f"an answer of {len(result.nearest_node_ids)} neighbours of a key (limit {nearest})"
    return None


def store_request_refusal(request: dht_pb2.StoreRequest) -> str | None:
    """Why a store request is refused whole before any of its records is looked at, or None.

    Counted first (a repeated field's length costs nothing), then measured (protobuf's own size of the message),
    then its dictionaries are opened (bounded, see `BoundedSerializer`) to count their records.
    """
    count = len(request.keys)
    if not count == len(request.subkeys) == len(request.values) == len(request.expiration_time) == len(
            request.in_cache):
        return "a store request whose fields are not aligned"
    if count > MAX_STORE_RECORDS:
        return f"a store request of {count} records (limit {MAX_STORE_RECORDS})"
    size = request.ByteSize()
    if size > MAX_STORE_BYTES:
        return f"a store request of {size} bytes (limit {MAX_STORE_BYTES})"
    records = 0
    for tag, value in zip(request.subkeys, request.values, strict=True):
        if tag != IS_DICTIONARY:
            records += 1
            continue
        try:
            records += len(_dictionary_items(value))
        except Undecodable as e:
            return str(e)
    if records > MAX_STORE_RECORDS:
        return f"a store request of {records} records (limit {MAX_STORE_RECORDS})"
    return None


class WriterBudget:
    """A token bucket of record checks per writer: `take(writer, records)` is False once a writer's requests outrun
    `rate` records a second beyond a `burst`. It remembers MAX_TRACKED_WRITERS writers (a forgotten one starts again
    with a full burst: a new peer id costs its sender a libp2p connection and handshake)."""

    def __init__(self, rate: float = STORE_RECORDS_PER_SECOND, burst: float = STORE_RECORDS_BURST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # writer -> (tokens, when counted)

    def take(self, writer: str, records: int) -> bool:
        now = self.clock()
        tokens, counted = self._buckets.pop(writer, (self.burst, now))
        tokens = min(self.burst, tokens + (now - counted) * self.rate)
        allowed = tokens >= records
        self._buckets[writer] = (tokens - records if allowed else tokens, now)
        while len(self._buckets) > MAX_TRACKED_WRITERS:
            self._buckets.popitem(last=False)
        return allowed


def store_request_charge(request: dht_pb2.StoreRequest) -> int:
    """What a store request (already within `store_request_refusal`'s caps) costs its writer's budget: a record per
    key, or the most a request may carry when it stores whole dictionaries (their items were counted, not kept)."""
    return MAX_STORE_RECORDS if IS_DICTIONARY in request.subkeys else len(request.keys)
