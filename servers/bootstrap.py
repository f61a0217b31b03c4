"""`swarmbatch dht`: a DHT bootstrap node that servers and clients join through."""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

from swarmnet.addresses import NetworkOptions
from swarmnet.membership import Membership
from swarmnet.network import run_async, start_dht_node, stop_dht_node, visible_maddrs


def run_bootstrap_node(initial_peers: list[str], network: NetworkOptions, on_ready: Callable[[list[str]], None],
                       membership: Membership | None = None) -> None:
    """Run a DHT node until SIGTERM/SIGINT; `on_ready(maddrs)` is called once it listens.

    membership: a private swarm's; the node's own peer id (its --identity key) must be a member (NotAMember).
    """
    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        writers = None if membership is None or membership.is_open else membership.serves
        p2p, node = await start_dht_node(initial_peers, network, client_mode=False, writers=writers)
        try:
            if membership is not None:
                membership.require(p2p.peer_id.to_base58(), "DHT node", network.identity_path)
            on_ready(await visible_maddrs(p2p))
            await stop.wait()
        finally:
            await stop_dht_node(p2p, node)
    run_async(main())
