"""What a DHT node keeps and what it answers, both bounded, so that nobody's records can hide the servers' records.

In an open swarm any peer may store correctly self-signed records (one per key pair it makes) under a block key,
and each is up to 8 KiB (`records.MAX_VALUE_BYTES`). hivemind keeps them all and answers a find with every record
of the key, and an answer over p2pd's 4 MiB message limit is no answer at all: a reader then drops that node's
records, honest ones included (and stops asking it for a while). Every node we run (servers, `swarmbatch dht`,
clients) holds its records in a `BoundedStorage`:

* At most MAX_SUBKEYS_PER_KEY records per key. When a key is full a *new* subkey is refused; a subkey already there
  is still updated (a later expiration replaces an earlier one, as in hivemind). Servers re-announce before their
  records expire, under the subkey they already hold, so a flood of newcomers never evicts them; a record leaves
  only when it expires (at most 70 s after it was written, `MAX_RECORD_TTL`), and only then does its slot free up.
* A full node answers a find with at most ANSWER_BYTES of records, split evenly among the keys asked
  (`find_answerer`, registered behind `records.GuardedDHTNode.guard_finds`' size checks). A key whose records
  exceed its share is answered with its smallest records first, so
  every record of up to ANSWER_BYTES / MAX_SUBKEYS_PER_KEY bytes (3 KiB; an announcement is at most about 1.6 KB)
  is always in the answer to a find of that key alone, which is how discovery asks (`swarmnet.discovery`).
* Reading does not write: hivemind merges what other nodes answer into the reading node's own stored dictionary
  (its local candidate is the stored object); `get` returns a copy, so a read can neither pass the cap nor make a
  node serve records it was never asked to store.
"""
from __future__ import annotations

import asyncio
import heapq
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID, BinaryDHTValue
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.p2p import P2PContext
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, ValueWithExpiration
from hivemind.utils.timed_storage import DHTExpiration, TimedStorage

MAX_SUBKEYS_PER_KEY = 1024  # records kept per key: hundreds of servers per block, with room to spare
ANSWER_BYTES = 3 * 1024**2  # records in one find answer: p2pd refuses messages over 4 MiB; the rest is neighbours
ITEM_OVERHEAD = 16  # bytes msgpack adds to a record in an answer, besides its value and subkey


class BoundedStorage(DHTLocalStorage):
    """A DHT node's storage: at most `max_subkeys` records per key (newcomers refused when full), reads that return
    copies, and answers of at most a given size (`answer`)."""

    def __init__(self, max_subkeys: int = MAX_SUBKEYS_PER_KEY, answer_bytes: int = ANSWER_BYTES) -> None:
        super().__init__()
        self.max_subkeys, self.answer_bytes = max_subkeys, answer_bytes
        self.refused = 0  # new subkeys refused because their key was full

    @classmethod
    def taking_over(cls, storage: DHTLocalStorage) -> BoundedStorage:
        """A BoundedStorage holding what `storage` holds (what arrived while the node started), within the cap."""
        bounded = cls()
        for key, item in storage.items():
            if isinstance(item.value, DictionaryDHTValue):
                for subkey, record in item.value.items():
                    bounded.store_subkey(key, subkey, record.value, record.expiration_time)
            else:
                bounded.store(key, item.value, item.expiration_time)
        return bounded

    def store_subkey(self, key: DHTID, subkey: Any, value: BinaryDHTValue, expiration_time: DHTExpiration) -> bool:
        """hivemind's `store_subkey`, refusing a new subkey under a key that holds `max_subkeys` unexpired ones."""
        found = TimedStorage.get(self, key)  # the stored object itself (our `get` returns a copy)
        if found is not None and isinstance(found.value, DictionaryDHTValue):
            held = found.value
            if subkey not in held and len(held) >= self.max_subkeys:
                self.refused += 1
                return False
            stored = held.store(subkey, value, expiration_time)
            if stored and expiration_time > found.expiration_time:
                TimedStorage.store(self, key, held, expiration_time)  # the key lives as long as its latest record
            return stored
        if found is not None and found.expiration_time >= expiration_time:
            return False  # a regular value that outlives this record stays (hivemind's rule)
        fresh = DictionaryDHTValue()
        if not fresh.store(subkey, value, expiration_time):
            return False
        return TimedStorage.store(self, key, fresh, expiration_time)

    def get(self, key: DHTID) -> ValueWithExpiration | None:
        """The value under `key`; a dictionary is a copy, so that whoever merges into it changes nothing stored."""
        found = super().get(key)
        if found is None or not isinstance(found.value, DictionaryDHTValue):
            return found
        return ValueWithExpiration(_subset(found.value, list(found.value.data)), found.expiration_time)

    def answer(self, key: DHTID, budget: int) -> ValueWithExpiration | None:
        """What a find of `key` is answered with: its records, the smallest first, as many as fit `budget` bytes
        (all of them when they fit); None when nothing is stored or nothing fits."""
        found = TimedStorage.get(self, key)
        if found is None or not isinstance(found.value, DictionaryDHTValue):
            return found
        held = found.value
        sizes = {subkey: len(record.value) + len(MSGPackSerializer.dumps(subkey)) + ITEM_OVERHEAD
                 for subkey, record in held.items()}
        if sum(sizes.values()) <= budget:
            return found  # serialized at once by the find handler: nobody holds on to it
        chosen, total = [], 0
        for subkey in sorted(sizes, key=sizes.__getitem__):  # stable: equal sizes in the order they came
            total += sizes[subkey]
            if total > budget:
                break
            chosen.append(subkey)
        if not chosen:
            return None
        answer = _subset(held, chosen)
        return ValueWithExpiration(answer, answer.latest_expiration_time)


def _subset(held: DictionaryDHTValue, subkeys: list[Any]) -> DictionaryDHTValue:
    """A new dictionary value with `held`'s records under `subkeys` (unexpired ones), sharing their entries: copied
    as hivemind's TimedStorage keeps them (records, their expiration heap), not stored one by one (~6 ms for 1024)."""
    subset = DictionaryDHTValue()
    subset.data = {subkey: held.data[subkey] for subkey in subkeys}
    subset.key_to_heap = {subkey: held.key_to_heap[subkey] for subkey in subkeys}
    subset.expiration_heap = list(subset.key_to_heap.values())
    heapq.heapify(subset.expiration_heap)
    subset.latest_expiration_time = max((record.expiration_time for record in subset.data.values()),
                                        default=float("-inf"))
    return subset


def find_answerer(protocol: DHTProtocol, storage: BoundedStorage
                  ) -> Callable[[dht_pb2.FindRequest, P2PContext], Awaitable[dht_pb2.FindResponse]]:
    """A find handler answering from `storage` with at most `storage.answer_bytes` of records per answer, split evenly
    among the keys asked (`BoundedStorage.answer`); otherwise as hivemind answers them (records found, then the
    nearest neighbours known)."""

    pings: set[asyncio.Task[Any]] = set()

    async def bounded_find(request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
        if request.peer:  # the asker joins the routing table, as hivemind's own handler does
            ping = asyncio.create_task(protocol.rpc_ping(dht_pb2.PingRequest(peer=request.peer), context))
            pings.add(ping)
            ping.add_done_callback(pings.discard)
        response = dht_pb2.FindResponse(results=[], peer=protocol.node_info)
        budget = storage.answer_bytes // max(len(request.keys), 1)
        asker = DHTID.from_bytes(request.peer.node_id)
        for key in map(DHTID.from_bytes, request.keys):
            found = storage.answer(key, budget)
            if found is None:
                result = dht_pb2.FindResult(type=dht_pb2.NOT_FOUND)
            elif isinstance(found.value, DictionaryDHTValue):
                result = dht_pb2.FindResult(type=dht_pb2.FOUND_DICTIONARY, value=protocol.serializer.dumps(found.value),
                                            expiration_time=found.expiration_time)
            else:
                result = dht_pb2.FindResult(type=dht_pb2.FOUND_REGULAR, value=found.value,
                                            expiration_time=found.expiration_time)
            for node_id, peer_id in protocol.routing_table.get_nearest_neighbors(key, k=protocol.bucket_size,
                                                                                 exclude=asker):
                result.nearest_node_ids.append(node_id.to_bytes())
                result.nearest_peer_ids.append(peer_id.to_bytes())
            response.results.append(result)
        return response

    return bounded_find
