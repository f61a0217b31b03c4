"""A server under a flood of DHT store requests keeps its decode step latency (security audit 2, N2a).

Servers run their DHT node on the event loop (and the p2pd) that serves inference steps. A stranger sends a server
one store request after another, each as large as p2pd carries (3.9 MiB: 6,300 records with the stranger's real
RSA-2048 key and garbage signatures), while a member client runs decode steps through that server. The server
refuses each request whole, unparsed, at its first look (over dht_wire's byte cap; in a private swarm, a
non-member's), so the steps keep their latency. Before, an open swarm's server verified every record of each request:
6,300 RSA verifications, about 0.4 s of its loop per request.

The strangers are their own processes (bench/dht_flood.py's `FloodSender`), niced: in an attack their CPU is another
machine's, and a thread here would share the client's GIL. On a shared 2-core VM a 4 MiB flood still costs this
machine's CPU whatever it targets (the senders, the receiving p2pd's decryption), so the steps also run under a
control flood: a second stranger flooding the DHT node, the same load on the machine and none on the server. Each
round runs BLOCK seconds of steps per condition (about 50 steps; long enough to span whole requests, so that a
server slow to handle them cannot hide it between two), in a rotating order. Per round, the server-flooded median
step is divided by the larger of the quiet and control ones (seconds apart, so other work on the machine falls on
all alike); the median of those ratios must stay within 2.5 (measured: about 1.05), and so must that of the mean
steps (a block's seconds over its steps: the median alone hides stalls -- before, with 0.4 s stalls, it moved 1.3x
while the steps per second fell 7x). A whole pass can still land in a busy stretch of a
shared VM, so a second pass runs when the first exceeds it; every pass is printed. Beside latency, the server's own
CPU per request (flooded alone) is bounded: that is what its code controls (its p2pd's decryption, about 25 ms per
3.9 MiB request here, is not). `python bench/dht_flood.py` prints the same figures for longer runs.
"""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiers import process_fixture

from launch.local_swarm import LocalSwarm
from swarmclient.model import DistributedModelForCausalLM

pytestmark = pytest.mark.alone  # it measures time against a bound: run after the parallel phase, alone

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_dht_flood", ROOT / "bench" / "dht_flood.py")
assert _spec is not None and _spec.loader is not None
bench = sys.modules["bench_dht_flood"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

ROUNDS = 8       # each round: BLOCK seconds of steps quiet, with the server flooded, with the DHT node flooded
BLOCK = 0.25     # seconds: spans several whole requests (their transfer, then their handling), ~50 steps
TOLERANCE = 2.5  # per round, server-flooded median <= this x the larger of the quiet and control medians (median)
PASSES = 2       # a second pass of rounds only when the first exceeds TOLERANCE (see above)
MAX_PYTHON_MS = 15.0  # CPU of the server's own process per flood request (2-7 ms measured; its p2pd's ~25 ms apart)


@process_fixture(scope="module", params=["private", "open"])
def swarm(request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[LocalSwarm]:
    with LocalSwarm(tiny_model, [(0, 6)], log_dir=tmp_path_factory.mktemp("flood"),
                    private=request.param == "private") as started:
        yield started


@process_fixture()
def floods(swarm: LocalSwarm, tmp_path: Path) -> Iterator[dict[str, object]]:
    dht = swarm.initial_peers[0]
    senders: dict[str, object] = {}
    try:
        senders[bench.SERVER] = bench.FloodSender(dht, swarm.servers[0].peer_id, tmp_path / "stranger1.key")
        senders[bench.CONTROL] = bench.FloodSender(dht, dht.rsplit("/p2p/", 1)[1], tmp_path / "stranger2.key")
        yield senders
    finally:
        for sender in senders.values():
            sender.close()  # type: ignore[attr-defined]


def test_a_server_flooded_with_4_mib_store_requests_keeps_its_decode_step_latency(
        swarm: LocalSwarm, floods: dict[str, bench.FloodSender], tiny_model: Path) -> None:
    request_bytes = floods[bench.SERVER].request_bytes
    assert 4_000_000 < request_bytes < (4 << 20) - (16 << 10)
    passes: list[str] = []
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers,
                                                     access=swarm.access() if swarm.swarm_file else None) as model:
        for _ in range(PASSES):
            # When a stranger floods the server during some blocks of decode steps, and another the DHT node in others
            result = bench.decode_steps(model, floods, ROUNDS, BLOCK)
            ratio = max(bench.paired_ratio(result, bench.SERVER, bench.QUIET, bench.CONTROL, of=of)
                        for of in (bench.median, bench.mean))
            passes.append(bench.report(result, request_bytes))
            print(passes[-1])
            # Then the floods were real: requests kept landing while the steps ran, each refused whole, unparsed
            for name in (bench.SERVER, bench.CONTROL):
                assert result["landed"][name] >= ROUNDS and result["failed"][name] == 0, passes[-1]
                assert result["verdicts"][name] == [0], passes[-1]  # no verdict per record: refused unparsed
            if ratio <= TOLERANCE:
                break
    # And the server-flooded steps are about as fast as those the flood does not reach
    assert ratio <= TOLERANCE, "\n\n".join(passes)
    # And the server spends little CPU of its own on each request (flooded alone, no steps)
    cost = bench.flood_cost(floods[bench.SERVER], swarm.servers[0].pid)
    print(cost)
    assert cost["python_ms"] <= MAX_PYTHON_MS, cost
