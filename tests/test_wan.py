"""A swarm across machines: DHT, block servers and client in separate network namespaces with latency between them
(tests/netlab). Skipped, with the reason, where the process may not build namespaces (not root, tools missing)."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from netlab.lab import LabError, NetLab, start_dht, start_servers
from test_swarm_generation import PROMPTS, reference_tokens
from tiers import process_fixture

from launch.processes import cli_command
from swarmclient.textgen import load_tokenizer, strip_after_eos

LabFactory = Callable[..., NetLab]


@process_fixture()
def netlab(tmp_path: Path) -> Iterator[LabFactory]:
    """Build NetLabs (skips the test where this process cannot); each is torn down after the test."""
    from netlab.lab import unavailable

    reason = unavailable()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    labs: list[NetLab] = []

    def build(nodes: int, *, delay_ms: float | Sequence[float] = 0.0) -> NetLab:
        lab = NetLab(nodes, delay_ms=delay_ms, log_dir=tmp_path / f"lab{len(labs)}")
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
    done = lab.exec(lab.nodes[node_index], cli_command("generate", str(model_dir), *prompts, "--initial-peers",
                                                       *initial_peers, "--max-new-tokens", str(max_new_tokens),
                                                       "--json", *extra), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return [item["token_ids"] for item in json.loads(done.stdout.splitlines()[-1])["outputs"]]


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
