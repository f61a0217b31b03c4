"""What a DHT node decodes from peers (swarmnet/dht_wire.py), without processes: legitimate values and dictionaries
round-trip as hivemind's own serializer has them; bombs and odd shapes are refused, and quickly (security audit 2,
N2c/N2d). The real nodes' side is tests/test_dht_wire.py."""
from __future__ import annotations

import time
from collections.abc import Callable

import msgpack
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarmnet.data_structures import ServerInfo, ServerState
from swarmnet.dht_storage import ANSWER_BYTES, MAX_SUBKEYS_PER_KEY, BoundedStorage
from swarmnet.dht_wire import (
    DICTIONARY_EXT,
    IS_DICTIONARY,
    MAX_ANSWER_SUBKEYS,
    MAX_DICTIONARY_BYTES,
    MAX_FIND_BYTES,
    MAX_FIND_KEYS,
    MAX_STORE_BYTES,
    MAX_STORE_RECORDS,
    MAX_SUBKEY_BYTES,
    MAX_VALUE_BYTES,
    BoundedSerializer,
    Undecodable,
    decode_dictionary,
    decode_value,
    find_answer_refusal,
    find_request_refusal,
    store_request_refusal,
)


def fastest(call: Callable[[], object], times: int = 5) -> float:
    """The least wall time of `times` calls (other work on the machine only ever adds to one)."""
    best = float("inf")
    for _ in range(times):
        began = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - began)
    return best


def refused(buf: bytes) -> str:
    """Why the bytes are refused (as a whole dictionary if they are an ext object, else as a value); and hivemind's
    serializer, ours, reads them as None."""
    decode = decode_dictionary if buf[:1] in (b"\xc7", b"\xc8", b"\xc9", b"\xd4", b"\xd5", b"\xd6", b"\xd7", b"\xd8") \
        else decode_value
    with pytest.raises(Undecodable) as caught:
        decode(buf)
    assert BoundedSerializer.loads(buf) is None
    return str(caught.value)


def ext(code: int, data: bytes) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, data))


def dictionary_of(items: int, value_bytes: int) -> DictionaryDHTValue:
    dictionary, now = DictionaryDHTValue(), get_dht_time()
    for i in range(items):
        dictionary.store(f"Qm{i:044d}", bytes([i % 256]) * value_bytes, now + 30 + i)
    return dictionary


def empty_arrays(count: int, header: bytes) -> bytes:
    """An ext 0x50 payload shaped [None, 0.0, [[], [], ...]]: `count` empty arrays, a bomb for an unbounded decoder."""
    return ext(DICTIONARY_EXT, b"\x93\xc0\xcb" + b"\0" * 8 + header + b"\x90" * count)


def test_the_largest_answers_an_honest_node_gives_round_trip_as_hivemind_decodes_them() -> None:
    # what a node's BoundedStorage answers a find of one key with, at its caps: as many records as it keeps (small
    # ones), or as many of the largest records as fit its answer budget
    for count, value_bytes in ((MAX_SUBKEYS_PER_KEY, 2048), (MAX_SUBKEYS_PER_KEY, MAX_VALUE_BYTES - 1024)):
        storage, key = BoundedStorage(), DHTID.generate(source="block")
        for subkey, (value, expiration) in dictionary_of(count, value_bytes).items():
            assert storage.store_subkey(key, subkey, value, expiration)
        answer = storage.answer(key, ANSWER_BYTES)
        assert answer is not None
        wire = MSGPackSerializer.dumps(answer.value)
        assert len(wire) <= MAX_DICTIONARY_BYTES
        ours, theirs = BoundedSerializer.loads(wire), MSGPackSerializer.loads(wire)
        assert isinstance(ours, DictionaryDHTValue) and isinstance(theirs, DictionaryDHTValue)
        assert dict(ours.items()) == dict(theirs.items()) == dict(answer.value.items())
        assert ours.latest_expiration_time == answer.value.latest_expiration_time
        assert BoundedSerializer.dumps(answer.value) == wire  # encodes as hivemind does
        assert fastest(lambda: decode_dictionary(wire)) < 0.025  # noqa: B023 (called at once)
    empty = MSGPackSerializer.dumps(DictionaryDHTValue())
    assert len(BoundedSerializer.loads(empty)) == 0  # type: ignore[arg-type]


def test_announcements_and_subkeys_decode_as_hivemind_decodes_them() -> None:
    info = ServerInfo(state=ServerState.ONLINE, start=0, end=6, throughput=1e6, cache_tokens_left=10**6,
                      dtype="float32", quant="none", version="v", revision="r", max_batch_size=64, max_length=2048)
    for value in (info.to_wire(), "QmPeer", None, 7, [1, 2, {"a": b"b"}]):
        wire = MSGPackSerializer.dumps(value)
        assert BoundedSerializer.loads(wire) == MSGPackSerializer.loads(wire) == value


def test_a_4_mib_dictionary_bomb_is_refused_by_its_length_in_under_a_millisecond() -> None:
    bomb = empty_arrays(4 << 20, b"\xdd" + (4 << 20).to_bytes(4, "big"))
    assert refused(bomb) == f"a DHT dictionary of {len(bomb)} bytes (limit {MAX_DICTIONARY_BYTES})"
    assert fastest(lambda: refused(bomb)) < 0.001


def test_a_bomb_within_the_length_cap_is_refused_at_its_first_container_where_a_scalar_belongs() -> None:
    # the same shape, as large as the cap allows: an unbounded decoder makes ~500,000 lists of it first
    count = MAX_DICTIONARY_BYTES - 64
    bomb = empty_arrays(count, b"\xdd" + count.to_bytes(4, "big"))
    assert len(bomb) <= MAX_DICTIONARY_BYTES
    assert f"a DHT dictionary of {count} records" in refused(bomb)
    # within the record cap, the first item is an empty array where [subkey, value, expiration] belongs
    few = empty_arrays(MAX_ANSWER_SUBKEYS, b"\xdc" + MAX_ANSWER_SUBKEYS.to_bytes(2, "big"))
    assert refused(few) == "a DHT dictionary item of another shape"
    nested = ext(DICTIONARY_EXT, msgpack.packb([None, 0.0, [[["Qm"] * 10, b"v", 1.0]]]))
    assert "exceeds max_array_len" in refused(nested)
    assert fastest(lambda: refused(bomb)) < 0.05  # the unbounded decoder took seconds


def test_dictionaries_are_refused_nested_anywhere_and_other_ext_types_everywhere() -> None:
    inner = MSGPackSerializer.dumps(dictionary_of(1, 10))
    as_an_item_value = ext(DICTIONARY_EXT, msgpack.packb([None, 0.0, [["Qm", msgpack.ExtType(DICTIONARY_EXT, inner[3:]),
                                                                      1.0]]]))
    assert "undecodable DHT dictionary" in refused(as_an_item_value)
    assert "exceeds max_ext_len(0)" in refused(msgpack.packb([1, msgpack.ExtType(DICTIONARY_EXT, inner[3:])]))
    assert refused(MSGPackSerializer.dumps((1, 2))) == "a DHT value of an ext type other than a dictionary"  # a tuple
    assert refused(ext(0x51, b"\x80")) == "a DHT value of an ext type other than a dictionary"
    assert refused(inner + b"\x00").startswith("an undecodable DHT dictionary (ExtraData")


def test_values_over_a_records_cap_and_malformed_ones_are_refused_and_read_as_none() -> None:
    # hivemind decodes validated values with the serializer where an exception fails the reader's whole lookup: a
    # stranger's own valid record whose value is not msgpack, or an ext object, reads as no value there
    assert refused(MSGPackSerializer.dumps(b"x" * MAX_VALUE_BYTES)).startswith("a DHT value of")
    assert refused(b"\xc1").startswith("an undecodable DHT value")
    long_subkey = ext(DICTIONARY_EXT, msgpack.packb([None, 0.0, [["Q" * (MAX_SUBKEY_BYTES + 1), b"v", 1.0]]]))
    assert "exceeds max_str_len" in refused(long_subkey)
    for item in (["Qm", "not bytes", 1.0], ["Qm", b"v", "never"], ["Qm", b"v", True], [None, b"v", 1.0]):
        assert refused(ext(DICTIONARY_EXT, msgpack.packb([None, 0.0, [item]]))) == "a DHT dictionary item of other types"


def store_request(subkeys: list[bytes], values: list[bytes]) -> dht_pb2.StoreRequest:
    count = len(values)
    return dht_pb2.StoreRequest(keys=[DHTID.generate(source=str(i)).to_bytes() for i in range(count)], subkeys=subkeys,
                                values=values, expiration_time=[get_dht_time() + 30] * count, in_cache=[False] * count)


def test_a_store_request_is_refused_whole_beyond_its_record_and_byte_caps() -> None:
    subkey = MSGPackSerializer.dumps("Qm" + "x" * 44)
    assert store_request_refusal(store_request([subkey] * MAX_STORE_RECORDS, [b"v" * 1300] * MAX_STORE_RECORDS)) is None
    many = store_request([subkey] * (MAX_STORE_RECORDS + 1), [b"v"] * (MAX_STORE_RECORDS + 1))
    assert store_request_refusal(many) == f"a store request of {MAX_STORE_RECORDS + 1} records (limit {MAX_STORE_RECORDS})"
    large = store_request([subkey], [b"v" * (3 << 20)])
    assert store_request_refusal(large) == f"a store request of {large.ByteSize()} bytes (limit {MAX_STORE_BYTES})"
    # a whole dictionary counts its records: two of 40 are 80
    dictionaries = store_request([IS_DICTIONARY] * 2, [MSGPackSerializer.dumps(dictionary_of(40, 100))] * 2)
    assert store_request_refusal(dictionaries) == f"a store request of 80 records (limit {MAX_STORE_RECORDS})"
    bomb = store_request([IS_DICTIONARY], [empty_arrays(60, b"\xdc" + (60).to_bytes(2, "big"))])
    assert store_request_refusal(bomb) == "a DHT dictionary item of another shape"
    misaligned = store_request([subkey], [b"v"])
    misaligned.in_cache.append(True)
    assert store_request_refusal(misaligned) == "a store request whose fields are not aligned"


def test_counting_a_4_mib_request_of_tiny_records_costs_under_a_millisecond() -> None:
    tiny = store_request([b"\xc0"] * 200_000, [b""] * 200_000)
    assert tiny.ByteSize() > 4_000_000
    assert store_request_refusal(tiny) == f"a store request of 200000 records (limit {MAX_STORE_RECORDS})"
    assert fastest(lambda: store_request_refusal(tiny)) < 0.001


def find_answer(results: int, neighbours: int) -> dht_pb2.FindResponse:
    result = dht_pb2.FindResult(type=dht_pb2.NOT_FOUND, nearest_node_ids=[b"n" * 20] * neighbours,
                                nearest_peer_ids=[b"p" * 34] * neighbours)
    return dht_pb2.FindResponse(results=[result] * results)


def test_a_find_answer_is_read_only_in_the_shape_an_honest_node_gives_it() -> None:
    assert find_answer_refusal(3, find_answer(3, 20), nearest=20) is None
    assert find_answer_refusal(3, find_answer(2, 20), nearest=20) == "an answer of 2 results to a find of 3 keys"
    assert find_answer_refusal(1, find_answer(1, 70_000), nearest=20) == "an answer of 70000 neighbours of a key (limit 20)"
    uneven = find_answer(1, 5)
    uneven.results[0].nearest_peer_ids.append(b"p" * 34)
    assert find_answer_refusal(1, uneven, nearest=20) == "an answer of 5 neighbours of a key (limit 20)"


def test_a_find_request_is_answered_up_to_its_key_cap() -> None:
    keys = [DHTID.generate(source=str(i)).to_bytes() for i in range(MAX_FIND_KEYS + 1)]
    assert find_request_refusal(dht_pb2.FindRequest(keys=keys[:MAX_FIND_KEYS])) is None
    assert find_request_refusal(dht_pb2.FindRequest(keys=keys)) == f"a find request of {len(keys)} keys (limit {MAX_FIND_KEYS})"
    assert dht_pb2.FindRequest(keys=keys[:MAX_FIND_KEYS], peer=dht_pb2.NodeInfo(node_id=keys[0])).ByteSize() <= MAX_FIND_BYTES
