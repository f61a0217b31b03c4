"""Servers behind NAT (swarmnet/relays.py), in network namespaces (tests/netlab): a member server behind a MASQUERADE
NAT with no inbound path serves through the DHT node's relay; a member client reaches it there and generates local
greedy's tokens; a stranger gets nothing from the relay. Skipped where namespaces cannot be built (not root)."""
from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from netlab.lab import PUBLIC_SUBNET, LabError, NetLab, Node
from test_swarm_generation import PROMPTS
from test_wan import expected_ids, generate_in, wait_for_log
from tiers import process_fixture

from launch.processes import ManagedProcess, cli_command
from launch.ready import SERVING_BLOCKS
from swarmnet.identity import Identity
from swarmnet.membership import SwarmFile

pytestmark = pytest.mark.alone  # dials through NAT in the WAN lab, with timeouts: run after the parallel phase, alone

STRANGER = Path(__file__).with_name("relay_stranger.py")
REPO = str(Path(__file__).resolve().parents[1])


@dataclass
class NatSwarm:
    """DHT node + relay on node 0 (public), a server behind NAT behind router node 1, node 2 for clients."""

    lab: NetLab
    inside: Node            # the server's machine, behind node 1's NAT
    peers: list[str]        # the DHT node's multiaddr
    dht: ManagedProcess
    server: ManagedProcess
    server_port: int
    server_peer_id: str
    member_args: list[str]  # --swarm-file and a member key, for a client
    stranger_key: Path


def start_nat_swarm(model_dir: Path, tmp: Path, *, private: bool = True, nodes: int = 3, blocks: str = "0:6"
                    ) -> NatSwarm:
    """Build the lab and start the DHT node (--relay) and the server (--use-relay, port 4100, `blocks`); raises
    LabError. Nodes past the third are left for the test."""
    keys = {name: Identity.create(tmp / f"{name}.key") for name in ("dht", "server", "public", "client", "stranger")}
    swarm = SwarmFile.create(tmp / "swarm.json")
    for name in ("dht", "server", "public", "client"):
        swarm.add(keys[name].peer_id, name)
    swarm.save()
    lab = NetLab(nodes, subnet=PUBLIC_SUBNET, log_dir=tmp / "lab")
    try:
        lab.build()
        inside = lab.behind_nat(lab.nodes[1])
        membership = (lambda name: ["--swarm-file", str(swarm.path), "--identity", str(keys[name].path)]) \
            if private else (lambda name: ["--identity", str(keys[name].path)])
        dht = lab.run(lab.nodes[0], cli_command("dht", "--host", lab.nodes[0].ip, "--port", "4001", "--relay",
                                                *membership("dht")), name="dht-relay")
        peers = [dht.wait_for_line("/", timeout=60)]
        server = lab.run(inside, cli_command("serve", str(model_dir), "--blocks", blocks, "--host", inside.ip,
                                             "--port", "4100", "--use-relay", "--num-threads", "1",
                                             *membership("server"), "--initial-peers", *peers),
                         name="server-behind-nat", env={"OMP_NUM_THREADS": "1"})
        ready = server.wait_for_line(SERVING_BLOCKS, timeout=180)
    except BaseException:
        lab.close()
        raise
    member_args = ["--swarm-file", str(swarm.path), "--identity", str(keys["client"].path)] if private else []
    assert keys["server"].peer_id in ready
    return NatSwarm(lab, inside, peers, dht, server, 4100, keys["server"].peer_id, member_args, keys["stranger"].path)


@process_fixture(scope="module")
def nat_swarm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatSwarm]:
    from netlab.lab import unavailable

    reason = unavailable()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    try:
        swarm = start_nat_swarm(tiny_model, tmp_path_factory.mktemp("nat"))
    except LabError as e:
        pytest.skip(f"cannot build network namespaces here: {e}")
    yield swarm
    swarm.lab.close()


def tcp_connect(lab: NetLab, node: Node, ip: str, port: int) -> str:
    """'connected' or the error's name, for a TCP connect from `node` to ip:port (2 s)."""
    code = (f"import socket\ntry:\n socket.create_connection(({ip!r}, {port}), timeout=2); print('connected')\n"
            "except OSError as e:\n print(type(e).__name__)")
    return lab.exec(node, [sys.executable, "-c", code], timeout=30).stdout.strip()


def test_the_server_behind_nat_cannot_be_dialed_from_outside(nat_swarm: NatSwarm) -> None:
    lab, client = nat_swarm.lab, nat_swarm.lab.nodes[2]
    # the server listens (its own router reaches it on the private network) ...
    assert tcp_connect(lab, lab.nodes[1], nat_swarm.inside.ip, nat_swarm.server_port) == "connected"
    # ... but from outside its private address has no route, and its router forwards nothing in
    assert tcp_connect(lab, client, nat_swarm.inside.ip, nat_swarm.server_port) != "connected"
    assert tcp_connect(lab, client, lab.nodes[1].ip, nat_swarm.server_port) != "connected"


def test_a_member_client_generates_local_greedy_tokens_through_the_relay(tiny_model: Path,
                                                                         nat_swarm: NatSwarm) -> None:
    # Given the server holds a reservation on the relay (the DHT node logs it by name)
    wait_for_log(nat_swarm.dht, "holds a reservation")
    # When a member client on another node generates (it can reach the server only through the relay)
    tokens = generate_in(nat_swarm.lab, 2, tiny_model, nat_swarm.peers, PROMPTS, 12, *nat_swarm.member_args)
    # Then the tokens are local greedy generation's
    assert tokens == expected_ids(tiny_model, PROMPTS, 12)


SESSIONS = """
import json, logging, sys
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.textgen import load_tokenizer
from swarmnet.membership import SwarmAccess
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
model_dir, swarm_file, key, sessions, tokens, *peers = sys.argv[1:]
batch = load_tokenizer(model_dir)(json.loads(sys.stdin.read()), return_tensors="pt", padding=True)
with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=peers,
                                                 access=SwarmAccess.load(swarm_file, key)) as model:
    for _ in range(int(sessions)):
        out = model.generate(batch.input_ids, batch.attention_mask, max_new_tokens=int(tokens))
        print(json.dumps(out[:, batch.input_ids.shape[1]:].tolist()), flush=True)
    print(json.dumps(sorted(model.swarm.relayed)), flush=True)
"""


def test_sessions_beyond_what_one_relayed_connection_carries_reconnect_with_the_same_tokens(
        tiny_model: Path, nat_swarm: NatSwarm) -> None:
    from generation_checks import reference_tokens

    from swarmclient.textgen import load_tokenizer

    # Given one client process running 6 sessions in turn, each about 40 KiB each way over the relay (4 rows x 44
    # positions x hidden 64 x 4 bytes): together past the 128 KiB the relay lets one connection carry
    swarm_file, key = nat_swarm.member_args[1], nat_swarm.member_args[3]
    done = nat_swarm.lab.exec(nat_swarm.lab.nodes[2], [sys.executable, "-c", SESSIONS, str(tiny_model), swarm_file,
                                                       key, "6", "32", *nat_swarm.peers],
                              timeout=300, env={"PYTHONPATH": REPO}, input=json.dumps(PROMPTS))
    assert done.returncode == 0, done.stderr[-2000:]
    *outputs, relayed = [json.loads(line) for line in done.stdout.strip().splitlines()]
    # Then the client knew the server was behind the relay, reconnected when the relay reset the connection (not
    # banning the only server), and every session generated local greedy's tokens
    assert relayed == [nat_swarm.server_peer_id]
    assert "resets a connection after 128 KiB each way or 2 minutes; reconnecting" in done.stderr
    expected = reference_tokens(tiny_model, load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True),
                                32).tolist()
    assert outputs == [expected] * 6


LONG_SESSION_TOKENS = 120  # 4 rows: about 560 KiB of steps to the server, 130 KiB of answers back


def test_one_session_beyond_what_one_relayed_connection_carries_resumes_instead_of_replaying(
        tiny_model: Path, nat_swarm: NatSwarm) -> None:
    from generation_checks import reference_tokens

    from swarmclient.textgen import load_tokenizer

    # Given one session of 4 rows and 120 new tokens through the relay: its steps alone (hidden states and the
    # growing attention mask) are several times the 128 KiB one relayed connection carries each way
    log = nat_swarm.server.log_path
    before = log.read_text()
    swarm_file, key = nat_swarm.member_args[1], nat_swarm.member_args[3]
    done = nat_swarm.lab.exec(nat_swarm.lab.nodes[2], [sys.executable, "-c", SESSIONS, str(tiny_model), swarm_file,
                                                       key, "1", str(LONG_SESSION_TOKENS), *nat_swarm.peers],
                              timeout=300, env={"PYTHONPATH": REPO}, input=json.dumps(PROMPTS))
    assert done.returncode == 0, done.stderr[-2000:]
    output, _ = [json.loads(line) for line in done.stdout.strip().splitlines()]
    # Then each reset was followed by a resume of the same session on the server (one session opened, nothing
    # replayed), and the tokens are local greedy's
    expected = reference_tokens(tiny_model, load_tokenizer(tiny_model)(PROMPTS, return_tensors="pt", padding=True),
                                LONG_SESSION_TOKENS).tolist()
    assert output == expected
    new = log.read_text()[len(before):]
    assert new.count(" opened by ") == 1 and new.count(" resumed by ") >= 2, new[-3000:]
    assert "Resumed the session on blocks 0:6" in done.stderr and "Replayed" not in done.stderr, done.stderr[-2000:]


LONG_PROMPTS = [" ".join(f"{word} {i}" for i in range(60)) for word in ("apple", "river", "stone", "cloud")]


def test_a_prefill_larger_than_one_relayed_connection_carries_goes_in_chunks_with_local_greedy_tokens(
        tiny_model: Path, nat_swarm: NatSwarm) -> None:
    from generation_checks import reference_tokens

    from swarmclient.textgen import load_tokenizer

    # Given 4 prompts of about 180 tokens each through the relay: their prefill alone (4 x ~180 x hidden 64 x 4 bytes,
    # ~180 KiB) is more than the 128 KiB one relayed connection carries, so it could never pass as one step
    batch = load_tokenizer(tiny_model)(LONG_PROMPTS, return_tensors="pt", padding=True)
    assert batch.input_ids.numel() * 64 * 4 > 128 << 10
    log = nat_swarm.server.log_path
    before = log.read_text()
    swarm_file, key = nat_swarm.member_args[1], nat_swarm.member_args[3]
    done = nat_swarm.lab.exec(nat_swarm.lab.nodes[2], [sys.executable, "-c", SESSIONS, str(tiny_model), swarm_file,
                                                       key, "1", "8", *nat_swarm.peers],
                              timeout=300, env={"PYTHONPATH": REPO}, input=json.dumps(LONG_PROMPTS))
    assert done.returncode == 0, done.stderr[-2000:]
    output, _ = [json.loads(line) for line in done.stdout.strip().splitlines()]
    # Then the client sent it as several steps of at most 64 KiB (resuming the session when the relay reset its
    # connection): one session, nothing replayed, and the tokens are local greedy's
    assert output == reference_tokens(tiny_model, batch, 8).tolist()
    new = log.read_text()[len(before):]
    assert new.count(" opened by ") == 1, new[-3000:]
    assert "Replayed" not in done.stderr, done.stderr[-2000:]


def test_a_client_without_membership_is_refused_by_the_server_behind_the_relay(tiny_model: Path,
                                                                               nat_swarm: NatSwarm) -> None:
    # a stranger's client may ride the relay to a member server, which refuses it as it refuses direct callers
    done = nat_swarm.lab.exec(nat_swarm.lab.nodes[2], cli_command(
        "generate", str(tiny_model), "Hello", "--initial-peers", *nat_swarm.peers, "--max-new-tokens", "2"),
        timeout=300)
    assert done.returncode != 0 and done.stdout.strip() == ""
    assert "not a member" in done.stderr or "Unauthorized" in done.stderr, done.stderr[-1500:]


def strangers_dial(swarm: NatSwarm, seconds: float) -> tuple[dict[str, object], str]:
    """A stranger (node 1, listening nowhere) tries to be reachable through the relay; another (node 2) dials it
    there for `seconds`. Returns the dialer's report and the stranger's peer id."""
    env = {"PYTHONPATH": REPO}
    listener = swarm.lab.run(swarm.lab.nodes[1], [sys.executable, str(STRANGER), "listen", swarm.peers[0],
                                                  str(swarm.stranger_key)], name="stranger-listen", env=env)
    peer = listener.wait_for_line("ready", timeout=60).split()[1]
    done = swarm.lab.exec(swarm.lab.nodes[2], [sys.executable, str(STRANGER), "dial", swarm.peers[0], peer,
                                               str(seconds)], timeout=seconds + 60, env=env)
    listener.terminate()
    assert done.returncode == 0, done.stderr[-1500:]
    return json.loads(done.stdout.strip().splitlines()[-1]), peer


def test_a_stranger_cannot_be_reached_through_the_relay(nat_swarm: NatSwarm) -> None:
    # When a stranger takes a relay slot and another stranger dials it through the relay for 10 s
    report, peer = strangers_dial(nat_swarm, 10)
    # Then the relay cut the stranger off, said so once, and no attempt got through
    wait_for_log(nat_swarm.dht, f"disconnected {peer[-8:]}, not a member of this swarm")
    assert report["attempts"] >= 3 and report["answered"] == 0, report


@pytest.mark.swarm
def test_an_open_swarms_relay_relays_for_anyone(tiny_model: Path, tmp_path: Path) -> None:
    # the control of the test above: without a swarm file everyone is a member, and the same strangers get through
    from netlab.lab import unavailable

    if unavailable():
        pytest.skip(f"no network namespaces here: {unavailable()}")
    try:
        swarm = start_nat_swarm(tiny_model, tmp_path, private=False)
    except LabError as e:
        pytest.skip(f"cannot build network namespaces here: {e}")
    try:
        report, _ = strangers_dial(swarm, 10)
    finally:
        swarm.lab.close()
    assert report["answered"] >= 1, report


@pytest.mark.swarm
def test_a_swarm_mixing_a_public_server_and_one_behind_nat_generates_local_greedy_tokens(tiny_model: Path,
                                                                                         tmp_path: Path) -> None:
    # Given blocks 0:3 on a server anyone can dial (node 3) and 3:6 on the server behind NAT
    from netlab.lab import start_servers, unavailable

    if unavailable():
        pytest.skip(f"no network namespaces here: {unavailable()}")
    try:
        swarm = start_nat_swarm(tiny_model, tmp_path, nodes=4, blocks="3:6")
    except LabError as e:
        pytest.skip(f"cannot build network namespaces here: {e}")
    try:
        start_servers(swarm.lab, tiny_model, swarm.peers, [(swarm.lab.nodes[3], 0, 3, tuple(swarm.member_args[:2]) + (
            "--identity", str(tmp_path / "public.key")))])
        # When a member client generates, with push and without (the public server runs no relay transport, so it
        # cannot push to the other; the client then sends that step itself)
        for push in ("--push", "--no-push"):
            tokens = generate_in(swarm.lab, 2, tiny_model, swarm.peers, PROMPTS, 12, push, *swarm.member_args)
            # Then the tokens are local greedy generation's
            assert tokens == expected_ids(tiny_model, PROMPTS, 12)
    finally:
        swarm.lab.close()
