"""BoundedStorage without processes: the subkey cap (newcomers refused, members kept), answers within their budget
(smallest records first), and reads that never write. Records are plain bytes here: what the storage bounds is
their number and size, whatever a validator made of them before."""
from __future__ import annotations

import hivemind.utils.timed_storage
import pytest
from factories import ManualClock
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import MSGPackSerializer

from swarmnet.dht_storage import ANSWER_BYTES, ITEM_OVERHEAD, MAX_SUBKEYS_PER_KEY, BoundedStorage

KEY = DHTID.generate(source="llama.0")
OTHER_KEY = DHTID.generate(source="llama.1")
P2PD_MESSAGE_LIMIT = 4 * 1024**2
HONEST = b"h" * 1000  # about an announcement's size
BIGGEST = b"s" * 8192  # the largest record a node accepts (records.MAX_VALUE_BYTES)


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    """hivemind's storage clock, moved by hand."""
    clock = ManualClock(1000.0)
    monkeypatch.setattr(hivemind.utils.timed_storage, "get_dht_time", clock)
    return clock


def subkeys(storage: BoundedStorage, key: DHTID = KEY) -> set[str]:
    found = storage.get(key)
    return set() if found is None else {subkey for subkey, _ in found.value.items()}


def test_a_full_key_refuses_newcomers_but_updates_the_subkeys_it_holds(clock: ManualClock) -> None:
    storage = BoundedStorage(max_subkeys=3)
    # Given a key holding three records, the first a server's
    assert storage.store_subkey(KEY, "server", HONEST, clock.now + 60)
    for stranger in ("s1", "s2"):
        assert storage.store_subkey(KEY, stranger, BIGGEST, clock.now + 60)
    # When a fourth subkey arrives, then it is refused, and nothing held is displaced
    assert not storage.store_subkey(KEY, "s3", BIGGEST, clock.now + 70)
    assert subkeys(storage) == {"server", "s1", "s2"} and storage.refused == 1
    # But the server's re-announcement, under the subkey it holds, is stored (later expiration wins, as in hivemind)
    clock.now += 30
    assert storage.store_subkey(KEY, "server", HONEST + b"!", clock.now + 60)
    assert not storage.store_subkey(KEY, "server", HONEST, clock.now + 10)
    assert storage.get(KEY).value.get("server").value == HONEST + b"!"
    # And the cap is per key: another key takes new subkeys
    assert storage.store_subkey(OTHER_KEY, "s3", BIGGEST, clock.now + 60)


def test_a_slot_frees_up_only_when_its_record_expires(clock: ManualClock) -> None:
    storage = BoundedStorage(max_subkeys=2)
    assert storage.store_subkey(KEY, "server", HONEST, clock.now + 60)
    assert storage.store_subkey(KEY, "s1", BIGGEST, clock.now + 20)
    assert not storage.store_subkey(KEY, "s2", BIGGEST, clock.now + 60)
    clock.now += 21  # s1 expired: its slot is free; the server's record lives on
    assert storage.store_subkey(KEY, "s2", BIGGEST, clock.now + 60)
    assert subkeys(storage) == {"server", "s2"}


def test_a_whole_dictionary_stored_at_once_is_capped_record_by_record(clock: ManualClock) -> None:
    # (hivemind's store of a whole dictionary calls store_subkey for each of its records)
    storage = BoundedStorage(max_subkeys=4)
    stored = [storage.store(KEY, BIGGEST, clock.now + 60, subkey=f"s{i}") for i in range(10)]
    assert stored == [True] * 4 + [False] * 6 and len(subkeys(storage)) == 4


def test_a_regular_value_that_outlives_a_record_keeps_its_key_as_in_hivemind(clock: ManualClock) -> None:
    for storage in (BoundedStorage(), DHTLocalStorage()):
        assert storage.store(KEY, b"regular", clock.now + 60)
        assert not storage.store_subkey(KEY, "server", HONEST, clock.now + 30)
        assert storage.store_subkey(KEY, "server", HONEST, clock.now + 90)
        assert isinstance(storage.get(KEY).value, DictionaryDHTValue)


def test_a_read_returns_a_copy_so_merging_answers_into_it_stores_nothing(clock: ManualClock) -> None:
    storage = BoundedStorage(max_subkeys=2)
    storage.store_subkey(KEY, "server", HONEST, clock.now + 60)
    # hivemind merges what other nodes answer into the dictionary its local read returned
    read = storage.get(KEY).value
    for stranger in ("s1", "s2", "s3"):
        read.store(stranger, BIGGEST, clock.now + 60)
    assert subkeys(storage) == {"server"}


def test_a_full_key_of_the_largest_records_is_answered_within_p2pds_limit_with_every_small_record(
        clock: ManualClock) -> None:
    storage = BoundedStorage()
    # Given a key full of records: a few servers' announcements among strangers' largest records, in any order
    honest = {f"server{i}" for i in range(5)}
    for i in range(MAX_SUBKEYS_PER_KEY - len(honest)):
        assert storage.store_subkey(KEY, f"stranger{i:04}", BIGGEST, clock.now + 60)
        if i % 250 == 0:
            assert storage.store_subkey(KEY, f"server{i // 250}", HONEST, clock.now + 60)
    assert len(subkeys(storage)) == MAX_SUBKEYS_PER_KEY
    # When a find asks for that key alone, then the answer fits p2pd's message limit and holds every server
    answer = storage.answer(KEY, ANSWER_BYTES)
    packed = MSGPackSerializer.dumps(answer.value)
    assert len(packed) <= ANSWER_BYTES < P2PD_MESSAGE_LIMIT
    held = {subkey for subkey, _ in answer.value.items()}
    assert honest <= held
    # (as many strangers' records as fit beside them: each costs its value, its packed subkey and the overhead)
    one_server = len(HONEST) + len(MSGPackSerializer.dumps("server0")) + ITEM_OVERHEAD
    one_stranger = len(BIGGEST) + len(MSGPackSerializer.dumps("stranger0000")) + ITEM_OVERHEAD
    assert len(held - honest) == (ANSWER_BYTES - len(honest) * one_server) // one_stranger
    # And a find of six keys at once shares the budget: each gets a sixth, still the smallest records first
    sixth = storage.answer(KEY, ANSWER_BYTES // 6)
    assert honest <= {subkey for subkey, _ in sixth.value.items()}
    assert len(MSGPackSerializer.dumps(sixth.value)) <= ANSWER_BYTES // 6


def test_the_cap_and_budget_always_answer_every_record_up_to_3_kib() -> None:
    # 1024 records of 3 KiB less their overhead (subkey, msgpack) fill one key's answer exactly
    assert ANSWER_BYTES // MAX_SUBKEYS_PER_KEY == 3 * 1024


def test_an_answer_that_fits_is_the_whole_key_and_nothing_fits_no_budget(clock: ManualClock) -> None:
    storage = BoundedStorage()
    for name in ("a", "b", "c"):
        storage.store_subkey(KEY, name, HONEST, clock.now + 60)
    whole = storage.answer(KEY, ANSWER_BYTES)
    assert {subkey for subkey, _ in whole.value.items()} == {"a", "b", "c"}
    assert whole.expiration_time == clock.now + 60
    assert storage.answer(KEY, 10) is None and storage.answer(OTHER_KEY, ANSWER_BYTES) is None


def test_taking_over_a_nodes_first_storage_keeps_its_records_within_the_cap(clock: ManualClock) -> None:
    first = DHTLocalStorage()
    for i in range(5):
        first.store_subkey(KEY, f"s{i}", HONEST, clock.now + 60)
    first.store(OTHER_KEY, b"regular", clock.now + 60)
    bounded = BoundedStorage.taking_over(first)
    assert bounded.max_subkeys == MAX_SUBKEYS_PER_KEY
    assert subkeys(bounded) == {f"s{i}" for i in range(5)} and bounded.get(OTHER_KEY).value == b"regular"
