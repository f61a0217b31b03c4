"""A BlockServer's one status snapshot, and its shutdown whatever part of start-up ran."""
from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from ports import free_port

from servers.config import ServerConfig
from servers.counters import ServerCounters
from servers.errors import ServerConfigError
from servers.machine import BOOT_ID, this_machine
from servers.memory import CacheBudget
from servers.server import BlockServer
from servers.status import ServerStatus, SpanStatus
from swarmnet.data_structures import PROTOCOL_VERSION, ServerInfo, ServerState
from swarmnet.network import run_async


def a_status(*, span: SpanStatus | None) -> ServerStatus:
    stats = ServerCounters(steps=3, tokens=12, merged_steps=1, merged_sessions=2, max_merged=2)
    stats.record_error("invalid_request")
    return ServerStatus(state=ServerState.ONLINE, model_id="tiny", peer_id="QmPeer", dtype="float32", quant="none",
                        version=PROTOCOL_VERSION, revision="abc", max_batch_size=8, max_length=64,
                        max_sessions_per_peer=3, stats=stats,
                        span=span, machine="0123456789abcdef")


def a_span() -> SpanStatus:
    budget = CacheBudget(100, 4, owner_share=0.5)
    budget.reserve("s", owner="QmCaller", batch_size=2, max_length=10, num_blocks=4)
    return SpanStatus(start=2, end=6, throughput=50.0, sessions=1, forwards=1, cache=budget.use())


def test_the_announcement_is_the_wire_record_of_the_snapshot() -> None:
    info = a_status(span=a_span()).announcement()
    assert info == ServerInfo(state=ServerState.ONLINE, start=2, end=6, throughput=50.0, cache_tokens_left=80,
                              dtype="float32", quant="none", version=PROTOCOL_VERSION, revision="abc",
                              max_batch_size=8, max_length=64, max_sessions_per_peer=3, cache_tokens_per_peer=50,
                              cache_tokens_most_per_peer=50, machine="0123456789abcdef")


def test_the_info_answer_is_the_announcement_plus_identity_and_load() -> None:
    status = a_status(span=a_span())
    answer = status.info_answer()
    # the keys clients of every version read: the wire record's, then these, in this order
    assert list(answer) == [*ServerInfo.model_fields, "peer_id", "model_id", "steps", "tokens", "errors", "sessions",
                            "merged_steps", "merged_sessions", "max_merged", "forwards"]
    assert {key: answer[key] for key in ServerInfo.model_fields} == status.announcement().to_wire()
    assert (answer["peer_id"], answer["model_id"], answer["steps"], answer["tokens"], answer["errors"],
            answer["sessions"], answer["merged_steps"], answer["merged_sessions"], answer["max_merged"],
            answer["forwards"]) == ("QmPeer", "tiny", 3, 12, {"invalid_request": 1}, 1, 1, 2, 2, 1)


def test_a_joining_status_has_no_span_to_announce() -> None:
    with pytest.raises(RuntimeError, match="not loaded its span"):
        a_status(span=None).announcement()


def test_a_status_keeps_its_counters_when_the_server_counts_on(tiny_model: Path) -> None:
    server = BlockServer(ServerConfig(model_dir=str(tiny_model), initial_peers=[], blocks=(0, 6)))
    before = server.status()
    server.stats.record_step(tokens=4)
    server.stats.record_error("internal")
    assert (before.stats.steps, dict(before.stats.errors)) == (0, {})
    assert (server.status().stats.steps, dict(server.status().stats.errors)) == (1, {"internal": 1})


def test_a_server_announces_its_hosts_machine_or_the_one_it_is_named(tiny_model: Path) -> None:
    # Two servers of one host announce one machine: the digest of the kernel's boot id, never the id itself
    plain = [BlockServer(ServerConfig(model_dir=str(tiny_model), initial_peers=[], blocks=(0, 6))) for _ in range(2)]
    assert plain[0].status().machine == plain[1].status().machine == this_machine()
    assert len(this_machine()) == 16 and BOOT_ID.read_text().strip().replace("-", "")[:16] not in this_machine()
    # and one named otherwise (--machine) announces that name
    named = BlockServer(ServerConfig(model_dir=str(tiny_model), initial_peers=[], blocks=(0, 6), machine="rack-2/vm-7"))
    assert named.status().machine == "rack-2/vm-7"
    with pytest.raises(ServerConfigError, match="--machine names a machine in 1 to 64 characters"):
        ServerConfig(model_dir=str(tiny_model), initial_peers=[], blocks=(0, 6), machine="m" * 65)


def test_a_server_that_never_started_shuts_down_cleanly(tiny_model: Path) -> None:
    server = BlockServer(ServerConfig(model_dir=str(tiny_model), initial_peers=[], blocks=(0, 6)))
    asyncio.run(server.shutdown())
    assert server.status().state == ServerState.OFFLINE and server.status().span is None


def child_pids() -> set[int]:
    """Child processes of this test process (a P2P daemon is one)."""
    return {int(pid) for path in Path("/proc/self/task").glob("*/children") for pid in path.read_text().split()}


@pytest.mark.swarm  # a real DHT node (p2pd)
def test_a_server_whose_start_failed_after_joining_stops_its_dht_node_and_metrics(tiny_model: Path) -> None:
    # Given: a server whose span is refused only after /metrics is up and it has joined the DHT
    port = free_port()
    server = BlockServer(ServerConfig(model_dir=str(tiny_model), initial_peers=[], blocks=(0, 99), metrics_port=port))
    children = child_pids()

    async def start_then_shut_down() -> None:
        with pytest.raises(ServerConfigError, match="outside the model"):
            await server.start()
        assert server.peer_id and server.serving is None and child_pids() > children  # p2pd runs
        await server.shutdown()

    # When it shuts down; Then its P2P daemon is gone and the metrics port is free again
    run_async(start_then_shut_down())
    assert child_pids() == children
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
