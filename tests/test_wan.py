"""A swarm across machines: DHT, block servers and client in separate network namespaces with latency between them
(tests/netlab). Skipped, with the reason, where the process may not build namespaces (not root, tools missing)."""
from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from netlab.lab import LabError, NetLab, start_dht, start_servers
from test_swarm_generation import PROMPTS, reference_tokens
from tiers import process_fixture

from launch.processes import ManagedProcess, cli_command
from servers.neighbours import ROUND_TRIPS_LINE
from swarmclient.textgen import load_tokenizer, strip_after_eos

pytestmark = pytest.mark.alone  # it measures time against a bound: run after the parallel phase, alone

LabFactory = Callable[..., NetLab]


@process_fixture()
def netlab(tmp_path: Path) -> Iterator[LabFactory]:
    """Build NetLabs (skips the test where this process cannot); each is torn down after the test."""
    from netlab.lab import unavailable

    reason = unavailable()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    labs: list[NetLab] = []

    def build(nodes: int, *, delay_ms: float | Sequence[float] = 0.0,
              link_delay_ms: Mapping[tuple[int, int], float] | None = None) -> NetLab:
        lab = NetLab(nodes, delay_ms=delay_ms, link_delay_ms=link_delay_ms, log_dir=tmp_path / f"lab{len(labs)}")
        labs.append(lab)
        try:
            lab.build()
        except LabError as e:
            pytest.skip(f"cannot build network namespaces here: {e}")
        return lab

    yield build
    for lab in labs:
        lab.close()


def generate_in(lab: NetLab, node_index: int, model_dir: Path, initial_peers: Sequence[str], prompts: Sequence[str],
                max_new_tokens: int, *extra: str) -> list[list[int]]:
    """`swarmbatch generate --json` run inside a node of the lab; the token ids per prompt."""
    return generate_with_routes(lab, node_index, model_dir, initial_peers, prompts, max_new_tokens, *extra)[0]


def generate_with_routes(lab: NetLab, node_index: int, model_dir: Path, initial_peers: Sequence[str],
                         prompts: Sequence[str], max_new_tokens: int, *extra: str) -> tuple[list[list[int]], list[str]]:
    """`generate_in`, and the routes the client logged ("0:3@abcdef, 3:6@123456", peer ids cut to 6 characters)."""
    done = lab.exec(lab.nodes[node_index], cli_command("generate", str(model_dir), *prompts, "--initial-peers",
                                                       *initial_peers, "--max-new-tokens", str(max_new_tokens),
                                                       "--json", *extra), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    routes = re.findall(r"Route \d+:\d+ via (.+)$", done.stderr, flags=re.MULTILINE)
    return [item["token_ids"] for item in json.loads(done.stdout.splitlines()[-1])["outputs"]], routes


def peer_suffix(server: ManagedProcess) -> str:
    """The last 6 characters of a started server's peer id (what the client's route log shows), from its log."""
    match = re.search(r"announcing \S+/p2p/(\w+)", server.log_path.read_text())
    assert match, f"no 'announcing <address>' line in {server.log_path}"
    return match.group(1)[-6:]


def wait_for_log(server: ManagedProcess, needle: str, timeout: float = 60.0) -> None:
    """Wait until a server's log has a line containing `needle`."""
    deadline = time.monotonic() + timeout
    while needle not in server.log_path.read_text():
        assert time.monotonic() < deadline, f"no '{needle}' in {server.log_path} after {timeout:.0f} s"
        time.sleep(0.5)


def expected_ids(model_dir: Path, prompts: Sequence[str], max_new_tokens: int) -> list[list[int]]:
    """Local greedy `generate`, cut after EOS the way the CLI prints it."""
    from transformers import AutoConfig

    eos = AutoConfig.from_pretrained(model_dir).eos_token_id
    eos_ids = set(eos) if isinstance(eos, list) else {eos}
    batch = load_tokenizer(model_dir)(list(prompts), return_tensors="pt", padding=True)
    return [strip_after_eos(row, eos_ids) for row in reference_tokens(model_dir, batch, max_new_tokens).tolist()]


def test_servers_in_separate_namespaces_20ms_apart_generate_the_local_greedy_tokens(tiny_model: Path,
                                                                                        netlab: LabFactory) -> None:
    # Given a DHT and client on node 0 and two servers on nodes 1 and 2, each node delaying its input by 10 ms
    lab = netlab(3, delay_ms=10)
    peers = start_dht(lab, lab.nodes[0])
    start_servers(lab, tiny_model, peers, [(lab.nodes[1], 0, 3, ()), (lab.nodes[2], 3, 6, ())])
    # Then the servers are at least 20 ms apart, as the client is from each
    assert lab.rtt_ms(lab.nodes[1], lab.nodes[2]) >= 20.0
    assert lab.rtt_ms(lab.nodes[0], lab.nodes[1]) >= 20.0
    # When the client generates through them, relaying every hop, Then the tokens are local greedy generation's
    assert generate_in(lab, 0, tiny_model, peers, PROMPTS, 12, "--no-push") == expected_ids(tiny_model, PROMPTS, 12)


def test_three_servers_20ms_apart_pushing_to_each_other_generate_the_local_greedy_tokens(tiny_model: Path,
                                                                                         netlab: LabFactory) -> None:
    # Given the DHT and client on node 0 and three servers on nodes 1-3, every node 20 ms from every other
    lab = netlab(4, delay_ms=10)
    peers = start_dht(lab, lab.nodes[0])
    start_servers(lab, tiny_model, peers, [(lab.nodes[1], 0, 2, ()), (lab.nodes[2], 2, 4, ()), (lab.nodes[3], 4, 6, ())])
    # When the client generates with server-to-server push, Then the tokens are local greedy generation's
    assert generate_in(lab, 0, tiny_model, peers, PROMPTS, 12, "--push") == expected_ids(tiny_model, PROMPTS, 12)


def test_with_push_the_client_routes_through_servers_close_to_each_other_not_the_zigzag(tiny_model: Path,
                                                                                      netlab: LabFactory) -> None:
    # Given two holders of each half of the model: A1 (node 1), B1 (node 2), A2 (node 3), B2 (node 4), and the client
    # on node 0; A1-B2 and A2-B1 are 120 ms apart (a WAN between two sites), A1-B1 and A2-B2 are close; from the
    # client, A1 and B2 are close while A2 and B1 are 40 ms away (margins a loaded CI machine's noise stays inside: a
    # client's first ping of a server, dialling it, once measured the near A1 slower than A2 at 20 ms)
    lab = netlab(5, link_delay_ms={(1, 4): 60, (3, 2): 60, (0, 3): 20, (0, 2): 20})
    peers = start_dht(lab, lab.nodes[0])
    # (all announcing one speed: four servers measuring theirs at once on a busy machine may differ by more than the
    # round trips this test is about; --throughput is how identical boxes keep that noise out of routing)
    same = ("--throughput", "1000")
    a1, b1, a2, b2 = start_servers(lab, tiny_model, peers, [(lab.nodes[1], 0, 3, same), (lab.nodes[2], 3, 6, same),
                                                            (lab.nodes[3], 0, 3, same), (lab.nodes[4], 3, 6, same)])
    assert lab.rtt_ms(lab.nodes[1], lab.nodes[4]) >= 120.0 and lab.rtt_ms(lab.nodes[3], lab.nodes[2]) >= 120.0
    assert lab.rtt_ms(lab.nodes[1], lab.nodes[2]) < 10.0 and lab.rtt_ms(lab.nodes[0], lab.nodes[3]) >= 40.0
    for first in (a1, a2):  # each first-half server has measured both servers that may follow it
        wait_for_log(first, f"{ROUND_TRIPS_LINE} 2:")
    names = {peer_suffix(server): name for server, name in ((a1, "A1"), (b1, "B1"), (a2, "A2"), (b2, "B2"))}

    def chains(routes: list[str]) -> set[str]:
        return {"->".join(names[hop.rsplit("@", 1)[1]] for hop in route.split(", ")) for route in routes}

    # When the client generates with push (servers pass hidden states to each other)
    tokens, routes = generate_with_routes(lab, 0, tiny_model, peers, PROMPTS, 8, "--push")
    # Then it routes through a close pair (by the servers' own round trips), not A1->B2, which its own pings favour,
    # and the tokens are local greedy generation's
    assert routes and chains(routes) <= {"A1->B1", "A2->B2"}, chains(routes)
    assert tokens == expected_ids(tiny_model, PROMPTS, 8)
    # When it relays every hop itself instead, Then only its own round trips count: A1->B2
    tokens, routes = generate_with_routes(lab, 0, tiny_model, peers, PROMPTS, 8, "--no-push")
    assert chains(routes) == {"A1->B2"}
    assert tokens == expected_ids(tiny_model, PROMPTS, 8)
