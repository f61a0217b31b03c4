"""Real DHT nodes and servers announcing DNS names, IPv6 and wildcard addresses, and clients dialling them.

The wildcard tests listen on 0.0.0.0 / :: only inside two network namespaces they create (joined by a veth pair,
no route out, deleted afterwards): a node in one, a client in the other, as if on two machines.
"""
from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tiers import process_fixture

from launch.processes import ManagedProcess, cli_command
from launch.ready import SERVING_BLOCKS
from swarmclient.swarm import Swarm
from swarmnet.addresses import NetworkOptions
from swarmnet.model_spec import ModelSpec
from swarmnet.network import LoopThread, start_dht_node, stop_dht_node

# joins the DHT through argv[1] from wherever it runs, then leaves; exit 0 = joined
JOIN_SCRIPT = """
import sys
from swarmnet.network import run_async, start_dht_node, stop_dht_node
from swarmnet.addresses import NetworkOptions

async def join():
    p2p, node = await start_dht_node([sys.argv[1]], NetworkOptions(), client_mode=True)
    await stop_dht_node(p2p, node)

run_async(join())
print("joined")
"""


def join_from_here(maddr: str) -> None:
    """Join the DHT through `maddr` from this process (its own P2P node on 127.0.0.1), then leave."""
    loop = LoopThread()
    try:
        p2p, node = loop.run(start_dht_node([maddr], NetworkOptions(), client_mode=True), timeout=60)
        loop.run(stop_dht_node(p2p, node), timeout=30)
    finally:
        loop.stop()


@pytest.mark.swarm
def test_announce_host_without_a_port_picks_one_and_a_dns_name_is_dialled(tiny_model: Path, tmp_path: Path) -> None:
    # Given a DHT node and a block server that announce the name 'localhost' and were given no --port
    dht = ManagedProcess(cli_command("dht", "--announce-host", "localhost"), name="dht", log_dir=tmp_path)
    server = None
    try:
        maddr = dht.wait_for_line("/", timeout=60)
        # Then each picked a port and announces /dns4/localhost with it (no ValueError from hivemind)
        assert maddr.startswith("/dns4/localhost/tcp/") and int(maddr.split("/")[4]) > 0
        server = ManagedProcess(cli_command("serve", str(tiny_model), "--blocks", "0:6", "--announce-host", "localhost",
                                            "--num-threads", "1", "--initial-peers", maddr),
                                name="server", log_dir=tmp_path)
        line = server.wait_for_line(SERVING_BLOCKS, timeout=180)
        assert line.split(" at ", 1)[1].startswith("/dns4/localhost/tcp/")
        # And a client joins through the DHT's name and dials the server by the name it announced
        spec = ModelSpec.open(tiny_model)
        swarm = Swarm.connect([maddr], model_id=spec.model_id, num_blocks=spec.num_blocks)
        try:
            route = swarm.loop.run(swarm.route(0, spec.num_blocks), timeout=60)
            assert [hop.peer_id for hop in route] == [server.peer_id] and server.peer_id in swarm.rtts
        finally:
            swarm.close()
    finally:
        for process in (server, dht):
            if process is not None:
                process.terminate()


def ipv6_loopback_port() -> int | None:
    """A free TCP port on ::1, or None where this machine has no IPv6 loopback."""
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
            return int(sock.getsockname()[1])
    except OSError:
        return None


@pytest.mark.swarm
def test_a_dht_node_on_ipv6_loopback_from_swarmbatch_env_vars(tmp_path: Path) -> None:
    port = ipv6_loopback_port()
    if port is None:
        pytest.skip("this machine has no IPv6 loopback (::1)")
    # Given a DHT node configured by SWARMBATCH_HOST, SWARMBATCH_PORT and SWARMBATCH_ANNOUNCE_HOST alone
    env = {"SWARMBATCH_HOST": "::1", "SWARMBATCH_PORT": str(port), "SWARMBATCH_ANNOUNCE_HOST": "::1"}
    dht = ManagedProcess(cli_command("dht"), name="dht6", log_dir=tmp_path, env=env)
    try:
        maddr = dht.wait_for_line("/", timeout=60)
        # Then it listens and announces there, and a client dials it
        assert maddr.startswith(f"/ip6/::1/tcp/{port}/p2p/")
        join_from_here(maddr)
    finally:
        dht.terminate()


# ---- wildcard addresses, between two network namespaces -----------------------------------------------------------

@dataclass
class Namespaces:
    """Two network namespaces joined by a veth pair: `node` (10.213.N.1, fd99:213:N::1) and `peer` (.2, ::2)."""

    node: str
    peer: str
    node_ipv4: str
    node_ipv6: str
    log_dir: Path

    def start_in_node(self, *args: str, name: str) -> ManagedProcess:
        """A swarmbatch command inside the node's namespace."""
        return ManagedProcess(["ip", "netns", "exec", self.node, *cli_command(*args)], name=name, log_dir=self.log_dir)

    def join_from_peer(self, maddr: str) -> subprocess.CompletedProcess[str]:
        """Join the DHT through `maddr` from the other namespace (the other machine)."""
        return subprocess.run(["ip", "netns", "exec", self.peer, sys.executable, "-c", JOIN_SCRIPT, maddr],
                              capture_output=True, text=True, timeout=120)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@process_fixture()
def namespaces(tmp_path: Path) -> Iterator[Namespaces]:
    """Create the namespaces (root only: skips otherwise), and delete them, with their veth ends, afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 ('ip') to create network namespaces for a non-loopback address")
    tag = secrets.token_hex(3)
    node, peer, subnet = f"sbnode{tag}", f"sbpeer{tag}", int(tag[:2], 16)
    created: list[str] = []
    try:
        for name in (node, peer):
            ip("netns", "add", name)
            created.append(name)
        ip("link", "add", f"sbn{tag}", "netns", node, "type", "veth", "peer", "name", f"sbp{tag}", "netns", peer)
        for name, end, host in ((node, f"sbn{tag}", 1), (peer, f"sbp{tag}", 2)):
            ip("-n", name, "addr", "add", f"10.213.{subnet}.{host}/30", "dev", end)
            ip("-n", name, "addr", "add", f"fd99:213:{subnet:x}::{host}/64", "dev", end, "nodad")
            ip("-n", name, "link", "set", end, "up")
            ip("-n", name, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        for name in created:
            ip("netns", "del", name)
        pytest.skip(f"cannot create network namespaces here: {e.stderr.strip()}")
    try:
        yield Namespaces(node, peer, f"10.213.{subnet}.1", f"fd99:213:{subnet:x}::1", tmp_path)
    finally:
        for name in created:
            ip("netns", "del", name)


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_wildcard_host_announces_interface_addresses_without_loopback(namespaces: Namespaces, host: str) -> None:
    # Given a DHT node listening on every interface of its machine, with no --port
    dht = namespaces.start_in_node("dht", "--host", host, name="dht-v4" if host == "0.0.0.0" else "dht-v6")
    try:
        maddr = dht.wait_for_line("/", timeout=60)
        # Then the multiaddr it prints is its interface address, and it announces no loopback address at all
        address = namespaces.node_ipv4 if host == "0.0.0.0" else namespaces.node_ipv6
        assert maddr.startswith(f"/ip{4 if host == '0.0.0.0' else 6}/{address}/tcp/"), maddr
        announced = next(line for line in dht.log_path.read_text().splitlines() if "; announcing " in line)
        assert "127.0.0.1" not in announced and "/::1/" not in announced and maddr in announced
        # And a client on the other machine joins through it
        joined = namespaces.join_from_peer(maddr)
        assert joined.returncode == 0 and "joined" in joined.stdout, joined.stderr[-2000:]
    finally:
        dht.terminate()
