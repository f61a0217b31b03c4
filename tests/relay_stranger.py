"""A stranger trying to use a swarm's relay, run inside a lab node (tests/test_relay.py):

    relay_stranger.py listen RELAY KEY       listens nowhere but through RELAY (a reservation, like a server behind
                                             NAT), answers `stranger.echo`; prints "ready <peer id>"
    relay_stranger.py dial RELAY PEER SECS   dials PEER (reachable only through RELAY) for SECS seconds; prints
                                             one JSON line {"attempts", "answered", "errors"}

Both are plain hivemind p2pd nodes with the relay flags a member would use: what a stranger can do, nothing more.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter

from hivemind.p2p import P2P, PeerID

from swarmnet.network import RelayP2P
from swarmnet.relays import RelayRole, relay_kwargs

ECHO = "stranger.echo"


async def listen(relay: str, key: str) -> None:
    """Hold a reservation on `relay` (when it lets us) and answer echoes forever."""
    p2p = await RelayP2P.create(initial_peers=[relay], no_listen=True, identity_path=key, nat_port_map=False,
                                auto_nat=False, check_if_identity_free=False,
                                **relay_kwargs(RelayRole.behind_nat, [relay]))

    async def echo(_info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.read(64))
        await writer.drain()
        writer.close()

    await p2p.add_binary_stream_handler(ECHO, echo)
    print("ready", p2p.peer_id.to_base58(), flush=True)
    await asyncio.Event().wait()


async def dial(relay: str, peer: str, seconds: float) -> None:
    """Try to reach `peer` through `relay` again and again; report how often it answered."""
    # it joins through the relay, whose DHT tells it the only address `peer` has: the circuit through the relay
    p2p = await P2P.create(initial_peers=[relay], host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False,
                           auto_nat=False, use_relay=True)
    target = PeerID.from_base58(peer)
    attempts, answered, errors = 0, 0, Counter[str]()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        attempts += 1
        try:
            await asyncio.wait_for(_echo_once(p2p, target), 3)
            answered += 1
        except Exception as e:  # each refusal is counted by kind
            errors[f"{type(e).__name__}: {str(e)[:150]}"] += 1
        await asyncio.sleep(0.1)
    print(json.dumps({"attempts": attempts, "answered": answered, "errors": dict(errors)}), flush=True)
    await p2p.shutdown()


async def _echo_once(p2p: P2P, target: PeerID) -> None:
    _, reader, writer = await p2p.call_binary_stream_handler(target, ECHO)
    writer.write(b"ping")
    await writer.drain()
    if await reader.read(64) != b"ping":
        raise ConnectionError("no echo")
    writer.close()
    await p2p._client.disconnect(target)


if __name__ == "__main__":
    if sys.argv[1] == "listen":
        asyncio.run(listen(sys.argv[2], sys.argv[3]))
    else:
        asyncio.run(dial(sys.argv[2], sys.argv[3], float(sys.argv[4])))
