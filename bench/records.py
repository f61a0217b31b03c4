"""What signed DHT records cost: sign/validate per record, a full node's start-up, a 30-block announcement and read.

Starts a `swarmbatch dht` process on 127.0.0.1, then, in this process, full DHT nodes (as a server joins) and one
client node. It times, as medians over `--reps`:
  * start-up of a full node: `start_dht_node` without a key file, and with an existing `--identity` key file
    (hivemind then dials the swarm to check that no peer already uses the key);
  * one announcement of a 30-block server: `store_many` of 30 block keys with a ServerInfo under its peer id,
    as `Announcer.announce` does;
  * one client read of those 30 keys (`get_remote_module_infos`);
  * where the tree has swarmclient.records: `sign_value` and `validate` of one record (µs), in a tight loop.

It uses only functions that exist before and after records were signed, so running it with PYTHONPATH (and the
working directory, which `python -m cli` reads) set to an older checkout measures "before".
    python bench/records.py [--reps 15] [--blocks 30]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from launch.processes import ManagedProcess, cli_command
from swarmclient.data_structures import PROTOCOL_VERSION, ServerInfo, ServerState, block_uid
from swarmclient.discovery import get_remote_module_infos
from swarmclient.network import NetworkOptions, start_dht_node, stop_dht_node

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


async def time_startup(peers: list[str], options: NetworkOptions, reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        began = time.perf_counter()
        p2p, node = await start_dht_node(peers, options, client_mode=False)
        samples.append(time.perf_counter() - began)
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


def micro(reps: int = 2000) -> None:
    try:
        from hivemind.dht.validation import DHTRecord
        from hivemind.utils import MSGPackSerializer

        from swarmclient.identity import Identity
        from swarmclient.records import SignedRecordValidator
    except ImportError:
        print("sign/validate: this tree has no swarmclient.records")
        return
    with tempfile.TemporaryDirectory() as tmp:
        identity = Identity.create(Path(tmp) / "k.key")
    signer, reader = SignedRecordValidator(identity), SignedRecordValidator()
    record = DHTRecord(b"k" * 20, MSGPackSerializer.dumps(identity.peer_id), MSGPackSerializer.dumps(info(30).to_wire()),
                       get_dht_time() + 30)
    began = time.perf_counter()
    for _ in range(reps // 10):
        signed = signer.sign_value(record)
    sign_us = 1e6 * (time.perf_counter() - began) / (reps // 10)
    signed_record = DHTRecord(record.key, record.subkey, signed, record.expiration_time)
    began = time.perf_counter()
    for _ in range(reps):
        assert reader.validate(signed_record)
    validate_us = 1e6 * (time.perf_counter() - began) / reps
    print(f"sign_value: {sign_us:.0f} µs/record; validate: {validate_us:.0f} µs/record "
          f"(record {len(record.value)} B, signed {len(signed)} B)")


async def main(reps: int, blocks: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dht = ManagedProcess(cli_command("dht", "--host", "127.0.0.1"), name="dht", log_dir=Path(tmp))
        try:
            peers = [dht.wait_for_line("/ip4/", timeout=60)]
            key = Path(tmp) / "server.key"
            P2P.generate_identity(str(key))
            plain = await time_startup(peers, NetworkOptions(), reps)
            print(f"full node start-up, no key file:       {median_ms(plain)}")
            keyed = await time_startup(peers, NetworkOptions(identity_path=str(key)), reps)
            print(f"full node start-up, existing key file: {median_ms(keyed)}")
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
