"""What signed DHT records cost: sign/validate per record, a full node's start-up, a 30-block announcement and read.

Starts a `swarmbatch dht` process on 127.0.0.1, then, in this process, full DHT nodes (as a server joins) and one
client node. It times, as medians over `--reps`:
  * start-up of a full node, interleaved: plain hivemind (p2pd makes up its key, as start_dht_node did before),
    `start_dht_node` without a key file, and with an existing `--identity` key file (hivemind then dials the
    swarm to check that no peer already uses the key);
  * one announcement of a 30-block server: `store_many` of 30 block keys with a ServerInfo under its peer id,
    as `Announcer.announce` does;
  * one client read of those 30 keys (`get_remote_module_infos`);
  * where the tree has swarmnet.records: `sign_value` and `validate` of one record (µs), in a tight loop.

It uses only functions that exist before and after records were signed, so running it with PYTHONPATH set to an
older checkout (the processes it starts, `python -P -m cli`, find our modules there) measures "before".
    python bench/records.py [--reps 15] [--blocks 30]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from launch.processes import ManagedProcess, cli_command
from swarmnet.addresses import NetworkOptions
from swarmnet.data_structures import PROTOCOL_VERSION, ServerInfo, ServerState, block_uid
from swarmnet.discovery import get_remote_module_infos
from swarmnet.network import start_dht_node, stop_dht_node

MODEL_ID = "bench-model"


def info(blocks: int) -> ServerInfo:
    return ServerInfo(state=ServerState.ONLINE, start=0, end=blocks, throughput=10.0, cache_tokens_left=16384,
                      dtype="float32", quant="none", version=PROTOCOL_VERSION, revision="r", max_batch_size=64,
                      max_length=2048)


def median_ms(samples: list[float]) -> str:
    return f"{1000 * statistics.median(samples):.1f} ms (p25 {1000 * _quantile(samples, 0.25):.1f}, " \
           f"p75 {1000 * _quantile(samples, 0.75):.1f})"


def _quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def plain_hivemind_node(peers: list[str]) -> tuple[P2P, DHTNode]:
    """A full node as start_dht_node made it before records were signed: p2pd makes up its own key."""
    p2p = await P2P.create(initial_peers=peers, **NetworkOptions().p2p_kwargs())
    return p2p, await DHTNode.create(p2p=p2p, initial_peers=peers, wait_timeout=3)


async def time_startups(peers: list[str], key: Path, reps: int) -> dict[str, list[float]]:
    """Start-up times of full nodes, the kinds interleaved so that the machine's load drifts evenly over them."""
    kinds: dict[str, Callable[[], Awaitable[tuple[P2P, DHTNode]]]] = {
        "plain hivemind (p2pd's own key)": lambda: plain_hivemind_node(peers),
        "start_dht_node, no --identity": lambda: start_dht_node(peers, NetworkOptions(), client_mode=False),
        "start_dht_node, existing key file": lambda: start_dht_node(
            peers, NetworkOptions(identity_path=str(key)), client_mode=False),
    }
    samples: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(reps):
        for name, start in kinds.items():
            began = time.perf_counter()
            p2p, node = await start()
            samples[name].append(time.perf_counter() - began)
            await stop_dht_node(p2p, node)
    return samples


async def time_announce_and_read(peers: list[str], blocks: int, reps: int) -> tuple[list[float], list[float]]:
    server_p2p, server = await start_dht_node(peers, NetworkOptions(), client_mode=False)
    client_p2p, client = await start_dht_node(peers, NetworkOptions(), client_mode=True)
    keys, wire, peer_id = [block_uid(MODEL_ID, i) for i in range(blocks)], info(blocks).to_wire(), server.peer_id
    stores, reads = [], []
    try:
        for _ in range(reps):
            began = time.perf_counter()
            results = await server.store_many(keys, [wire] * blocks, get_dht_time() + 30,
                                              subkeys=[peer_id.to_base58()] * blocks)
            stores.append(time.perf_counter() - began)
            assert all(results.values()), "an announcement failed"
            began = time.perf_counter()
            infos = await get_remote_module_infos(client, MODEL_ID, blocks)
            reads.append(time.perf_counter() - began)
            assert all(peer_id.to_base58() in servers for servers in infos), "the client missed the announcement"
    finally:
        await stop_dht_node(client_p2p, client)
        await stop_dht_node(server_p2p, server)
    return stores, reads


def micro(reps: int = 200) -> None:
    try:
        from hivemind.dht.validation import DHTRecord
        from hivemind.utils import MSGPackSerializer

        from swarmnet.identity import Identity
        from swarmnet.records import SignedRecordValidator
    except ImportError:
        print("sign/validate: this tree has no swarmnet.records")
        return
    with tempfile.TemporaryDirectory() as tmp:
        identity = Identity.create(Path(tmp) / "k.key")
    signer, reader = SignedRecordValidator(identity), SignedRecordValidator()
    value, subkey = MSGPackSerializer.dumps(info(30).to_wire()), MSGPackSerializer.dumps(identity.peer_id)
    records = [DHTRecord(i.to_bytes(20, "big"), subkey, value, get_dht_time() + 30) for i in range(reps)]
    began = time.perf_counter()
    signed = [DHTRecord(r.key, r.subkey, signer.sign_value(r), r.expiration_time) for r in records]
    sign_us = 1e6 * (time.perf_counter() - began) / reps
    timings = []
    for _ in range(2):  # first: every record verified; then: each found in the cache of verified records
        began = time.perf_counter()
        assert all(reader.validate(r) for r in signed)
        timings.append(1e6 * (time.perf_counter() - began) / reps)
    print(f"sign_value: {sign_us:.0f} µs/record; validate: {timings[0]:.0f} µs/record first seen, "
          f"{timings[1]:.1f} µs/record seen again (record {len(value)} B, signed {len(signed[0].value)} B)")


async def main(reps: int, blocks: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dht = ManagedProcess(cli_command("dht", "--host", "127.0.0.1"), name="dht", log_dir=Path(tmp))
        try:
            peers = [dht.wait_for_line("/ip4/", timeout=60)]
            key = Path(tmp) / "server.key"
            P2P.generate_identity(str(key))
            for name, samples in (await time_startups(peers, key, reps)).items():
                print(f"full node start-up, {name}: {median_ms(samples)}")
            stores, reads = await time_announce_and_read(peers, blocks, reps)
            print(f"announce {blocks} blocks (store_many): {median_ms(stores)}")
            print(f"client read of {blocks} blocks:         {median_ms(reads)}")
        finally:
            dht.terminate()
    micro()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--blocks", type=int, default=30)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, tree {Path.cwd()}")
    asyncio.run(main(args.reps, args.blocks))
