"""SignedRecordValidator without processes: what it signs, what it accepts, and every kind of record it refuses."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import msgpack
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time

from swarmnet.data_structures import ANNOUNCE_PERIOD_LIMIT, MAX_RECORD_TTL, RECORD_TTL_SLACK
from swarmnet.identity import Identity, peer_id_of_public_key
from swarmnet.records import (
    MAX_SUBKEY_BYTES,
    MAX_VALUE_BYTES,
    VERIFIED,
    NoCache,
    SignedRecordValidator,
    expiring_when_its_records_do,
    reader_validator,
    record_payload,
)

KEY = b"\x01" * 20  # a DHTID's bytes; the validator treats keys as opaque
VALUE = MSGPackSerializer.dumps({"state": "online", "start": 0, "end": 3})


def record(subkey: object, *, value: bytes = VALUE, ttl: float = 30.0) -> DHTRecord:
    return DHTRecord(KEY, MSGPackSerializer.dumps(subkey), value, get_dht_time() + ttl)


def signed(validator: SignedRecordValidator, unsigned: DHTRecord) -> DHTRecord:
    return dataclasses.replace(unsigned, value=validator.sign_value(unsigned))


def test_the_record_limit_is_two_announce_periods_and_the_slack() -> None:
    assert MAX_RECORD_TTL == 2 * ANNOUNCE_PERIOD_LIMIT + RECORD_TTL_SLACK == 70


def test_own_records_are_signed_valid_everywhere_and_stripped_to_the_value(keys: dict[str, Identity]) -> None:
    server = keys["server"]
    mine = signed(SignedRecordValidator(server), record(server.peer_id))
    assert mine.value != VALUE
    for checker in (SignedRecordValidator(), SignedRecordValidator(server), reader_validator()):
        assert checker.validate(mine)
        assert checker.strip_value(mine) == VALUE


def test_an_unsigned_record_is_refused(keys: dict[str, Identity]) -> None:
    server = keys["server"]
    assert SignedRecordValidator().refusal(record(server.peer_id)) == f"unsigned record under {server.peer_id}"


def test_records_without_a_peer_id_subkey_are_refused(keys: dict[str, Identity]) -> None:
    server = keys["server"]
    signer = SignedRecordValidator(server)
    # no subkey: a regular value under the block key would make every node refuse all subkeys of that key
    regular = DHTRecord(KEY, DHTProtocol.IS_REGULAR_VALUE, VALUE, get_dht_time() + 30)
    for bad in (regular, record(7), record(""), record(b"raw"), DHTRecord(KEY, b"\xc1", VALUE, get_dht_time() + 30)):
        assert signer.refusal(signed(signer, bad)) == "no peer id subkey"


def test_a_record_under_another_peers_id_is_refused(keys: dict[str, Identity]) -> None:
    server, outsider = keys["server"], keys["outsider"]
    forger = SignedRecordValidator(outsider)
    # sign_value leaves a record under someone else's peer id unsigned ...
    assert forger.sign_value(record(server.peer_id)) == VALUE
    # ... and one the outsider signs itself, under the server's peer id, is refused for its key
    unsigned = record(server.peer_id, value=MSGPackSerializer.dumps({"state": "offline"}))
    signature = outsider.sign(record_payload(unsigned, unsigned.value))
    forged = dataclasses.replace(unsigned, value=msgpack.packb([unsigned.value, outsider.public_key_der, signature],
                                                               use_bin_type=True))
    assert SignedRecordValidator().refusal(forged) == f"record under {server.peer_id} signed by another key"


def test_a_signature_binds_key_subkey_value_and_expiration(keys: dict[str, Identity]) -> None:
    server = keys["server"]
    mine = signed(SignedRecordValidator(server), record(server.peer_id))
    inner, public_key, signature = msgpack.unpackb(mine.value, raw=False)
    offline = msgpack.packb([MSGPackSerializer.dumps({"state": "offline"}), public_key, signature], use_bin_type=True)
    tampered = [dataclasses.replace(mine, key=b"\x02" * 20), dataclasses.replace(mine, value=offline),
                dataclasses.replace(mine, expiration_time=mine.expiration_time + 1)]
    for bad in tampered:
        assert SignedRecordValidator().refusal(bad) == f"bad signature under {server.peer_id}"
    # a signature by the same key over the same fields without the record domain (e.g. another kind of signed data)
    bare = msgpack.packb([mine.key, mine.subkey, inner, mine.expiration_time], use_bin_type=True)
    reused = dataclasses.replace(mine, value=msgpack.packb([inner, public_key, server.sign(bare)], use_bin_type=True))
    assert not SignedRecordValidator().validate(reused)


def test_a_correctly_signed_record_expiring_too_late_is_refused(keys: dict[str, Identity]) -> None:
    server = keys["server"]
    signer = SignedRecordValidator(server)
    within = signed(signer, record(server.peer_id, ttl=MAX_RECORD_TTL - 1))
    assert SignedRecordValidator().validate(within)
    for ttl in (MAX_RECORD_TTL + 2, 86400.0, 365 * 86400.0):
        late = signed(signer, record(server.peer_id, ttl=ttl))
        assert "limit 70 s" in (SignedRecordValidator().refusal(late) or "")


def test_readers_tolerate_clock_skew_that_full_nodes_do_not(keys: dict[str, Identity]) -> None:
    server = keys["server"]
    # stored by a full node whose clock is 5 s ahead of this reader's: at its edge of the limit, 5 s past ours
    ahead = signed(SignedRecordValidator(server), record(server.peer_id, ttl=MAX_RECORD_TTL + 5))
    assert not SignedRecordValidator().validate(ahead)
    assert reader_validator().validate(ahead)
    assert not reader_validator().validate(signed(SignedRecordValidator(server), record(server.peer_id, ttl=86400)))


def test_garbage_values_are_refused_without_raising(keys: dict[str, Identity]) -> None:
    server = keys["server"]
    for junk in (b"", b"\xc1", b"\x93\x01\x02\x03", msgpack.packb([b"v", b"k"]), msgpack.packb(["v", "k", "s"]),
                 msgpack.packb([b"v", b"not a key", b"sig"])):
        assert not SignedRecordValidator().validate(record(server.peer_id, value=junk))


def test_an_answer_expires_when_its_latest_record_does_whatever_it_claims() -> None:
    records = DictionaryDHTValue()
    now = get_dht_time()
    records.store("a", b"x", now + 10)
    records.store("b", b"y", now + 20)
    restamped = expiring_when_its_records_do(ValueWithExpiration(records, float("inf")))
    assert restamped is not None and restamped.expiration_time == now + 20 and restamped.value is records
    assert expiring_when_its_records_do(ValueWithExpiration(DictionaryDHTValue(), float("inf"))) is None
    assert expiring_when_its_records_do(None) is None
    regular = ValueWithExpiration(b"v", now + 5)
    assert expiring_when_its_records_do(regular) is regular


def test_the_cache_keeps_nothing() -> None:
    cache, key = NoCache(), DHTID.generate(source="k")
    assert not cache.store(key, b"v", get_dht_time() + 30)
    assert not cache.store_subkey(key, "peer", b"v", get_dht_time() + 30)
    assert cache.get(key) is None and key not in cache


def test_a_record_is_verified_once_however_often_it_is_read(keys: dict[str, Identity]) -> None:
    server = keys["server"]
    mine = signed(SignedRecordValidator(server), record(server.peer_id))
    before = VERIFIED.verifications
    assert all(SignedRecordValidator().validate(mine) for _ in range(5))
    assert VERIFIED.verifications - before == 1


# ---- what a stranger controls costs little (security audit 2, N2) --------------------------------------------------
def test_an_oversized_subkey_or_value_is_refused_by_its_length_before_any_parsing(keys: dict[str, Identity]) -> None:
    # a 4 MiB subkey of nested empty arrays took 2.26 s and 269 MiB to unpack before sizes were checked
    bomb = DHTRecord(KEY, b"\x91" * (4 << 20) + b"\x90", VALUE, get_dht_time() + 30)
    assert SignedRecordValidator().refusal(bomb) == f"a subkey of {(4 << 20) + 1} bytes (limit {MAX_SUBKEY_BYTES})"
    seconds = []
    for _ in range(5):  # the least of five: other work on the machine only ever adds to one
        began = time.perf_counter()
        assert not SignedRecordValidator().validate(bomb)
        seconds.append(time.perf_counter() - began)
    assert min(seconds) < 0.010, seconds
    server = keys["server"]
    huge = signed(SignedRecordValidator(server), record(server.peer_id, value=b"\x00" * MAX_VALUE_BYTES))
    assert SignedRecordValidator().refusal(huge) == f"a value of {len(huge.value)} bytes (limit {MAX_VALUE_BYTES})"


def test_a_subkey_within_the_size_limit_but_not_a_peer_id_string_is_refused_unexpanded() -> None:
    nested = DHTRecord(KEY, b"\x91" * 100 + b"\x90", VALUE, get_dht_time() + 30)  # 100 nested arrays
    long_string = DHTRecord(KEY, MSGPackSerializer.dumps("x" * 120), VALUE, get_dht_time() + 30)
    for bad in (nested, long_string):
        assert SignedRecordValidator().refusal(bad) == "no peer id subkey"


def test_a_correct_signature_by_a_key_with_another_exponent_is_refused_without_verifying_it(tmp_path: Path) -> None:
    # a key's owner picks its exponent, and a huge one made each check ~70x dearer: such keys are never verified
    odd = Identity(rsa.generate_private_key(public_exponent=3, key_size=2048), tmp_path / "unused.key")
    theirs = signed(SignedRecordValidator(odd), record(odd.peer_id))
    before = VERIFIED.verifications
    refusal = SignedRecordValidator().refusal(theirs)
    assert refusal is not None and "other than RSA-2048/3072 with e = 65537" in refusal
    assert VERIFIED.verifications == before


def test_a_huge_exponent_key_is_refused_without_verifying_its_signature() -> None:
    modulus = rsa.generate_private_key(public_exponent=65537, key_size=3072).public_key().public_numbers().n
    der = rsa.RSAPublicNumbers((1 << 3071) + 1, modulus).public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    peer_id = peer_id_of_public_key(der)
    unsigned = record(peer_id)
    forged = dataclasses.replace(unsigned, value=msgpack.packb([VALUE, der, b"\x01" * 384], use_bin_type=True))
    before = VERIFIED.verifications
    refusal = SignedRecordValidator().refusal(forged)
    assert refusal is not None and "other than RSA-2048/3072 with e = 65537" in refusal
    assert VERIFIED.verifications == before


def test_refused_records_leave_nothing_in_the_cache_of_verified_ones(keys: dict[str, Identity]) -> None:
    server, outsider = keys["server"], keys["outsider"]
    mine = signed(SignedRecordValidator(server), record(server.peer_id))
    cached = len(VERIFIED.digests)
    for i in range(1000):
        # signed by another key than the subkey's (refused before verifying), and re-dated (a bad signature)
        forged = signed(SignedRecordValidator(outsider), record(outsider.peer_id, value=VALUE + bytes([i % 256])))
        assert not SignedRecordValidator().validate(dataclasses.replace(forged, subkey=MSGPackSerializer.dumps(
            server.peer_id)))
        assert not SignedRecordValidator().validate(dataclasses.replace(mine, expiration_time=mine.expiration_time - i - 1))
    assert len(VERIFIED.digests) == cached
