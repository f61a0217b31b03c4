"""A real block server's Prometheus endpoint (`serve --metrics-port`) reports what it was sent."""
from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families
from test_server_requests import forward, good_inputs, open_session, step
from tiers import process_fixture

from launch.local_swarm import LocalSwarm
from launch.processes import cli_command
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.swarm import Swarm
from swarmclient.textgen import load_tokenizer
from swarmnet import protocol
from swarmnet.data_structures import ServerInfo
from swarmnet.model_spec import ModelSpec

CACHE_TOKENS = 256
ANNOUNCE_PERIOD = 1.0  # short, so a test sees the DHT record follow the server's load
Metrics = dict[tuple[str, frozenset[tuple[str, str]]], float]


@process_fixture(scope="module")
def metered(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalSwarm, Swarm, str]]:
    """One server holding all 6 blocks with /metrics on a free port, announcing every second, and a client."""
    spec = ModelSpec.open(tiny_model)
    port = free_port()
    with LocalSwarm(tiny_model, [], log_dir=tmp_path_factory.mktemp("metrics")) as swarm:
        swarm.start_servers([(0, 6, ["--metrics-port", str(port), "--attn-cache-tokens", str(CACHE_TOKENS),
                                     "--announce-period", str(ANNOUNCE_PERIOD)])])
        client = Swarm.connect(swarm.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks)
        try:
            yield swarm, client, f"http://127.0.0.1:{port}/metrics"
        finally:
            client.close()


def scrape(url: str) -> Metrics:
    """Every sample of the endpoint, keyed by (sample name, labels)."""
    response = httpx.get(url, timeout=10)
    response.raise_for_status()
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def value(metrics: Metrics, name: str, **labels: str) -> float:
    """One sample's value; 0 if the endpoint does not have it (a counter nobody incremented yet)."""
    return metrics.get((name, frozenset(labels.items())), 0.0)


def eventually(url: str, check: Callable[[Metrics], bool], timeout: float = 10.0) -> Metrics:
    """Scrape until `check` holds (a session closes on the server a moment after the client's stream ends)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(url)
        if check(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def test_an_online_server_reports_its_state_span_and_cache_budget(tiny_model: Path, metered) -> None:
    swarm, _, url = metered
    metrics = scrape(url)
    assert value(metrics, "swarmbatch_server_state", state="online") == 1.0
    assert value(metrics, "swarmbatch_server_state", state="joining") == 0.0
    assert (value(metrics, "swarmbatch_server_span_start"), value(metrics, "swarmbatch_server_span_end")) == (0, 6)
    assert value(metrics, "swarmbatch_server_cache_budget_block_tokens") == CACHE_TOKENS * 6
    assert value(metrics, "swarmbatch_server_cache_lent") == 1  # nobody else wants cache: a lone caller may borrow
    info = {dict(labels)["peer_id"]: dict(labels) for name, labels in metrics if name == "swarmbatch_server_span_info"}
    assert info[swarm.servers[0].peer_id]["model_id"] == ModelSpec.open(tiny_model).model_id
    assert value(metrics, "swarmbatch_server_throughput") > 0
    # docker-compose.yml's health check of a server looks for exactly this line
    assert 'swarmbatch_server_state{state="online"} 1.0' in httpx.get(url, timeout=10).text.splitlines()


def test_forwards_count_steps_tokens_and_errors_by_code(tiny_model: Path, metered) -> None:
    swarm, client, url = metered
    hidden_size, peer = ModelSpec.open(tiny_model).hidden_size, swarm.servers[0].peer_id
    before = scrape(url)
    # When: one good forward of batch 2 x 4 tokens and one with the wrong hidden size
    _, meta = forward(client, peer, good_inputs(hidden_size, batch=2, length=4), {"start": 0, "end": 6})
    assert protocol.response_error(meta) is None
    _, meta = forward(client, peer, [torch.zeros(1, 4, hidden_size + 1), torch.ones(1, 4, dtype=torch.long),
                                     torch.arange(4)[None]], {"start": 0, "end": 6})
    assert protocol.response_error(meta) is not None
    # Then: one more step of 8 tokens, one more invalid_request error
    after = scrape(url)
    for name, delta in (("swarmbatch_server_steps_total", 1), ("swarmbatch_server_tokens_total", 8)):
        assert value(after, name) - value(before, name) == delta, name
    assert (value(after, "swarmbatch_server_errors_total", code="invalid_request")
            - value(before, "swarmbatch_server_errors_total", code="invalid_request")) == 1


def test_an_open_session_shows_in_open_sessions_and_reserved_cache_until_it_closes(tiny_model: Path, metered) -> None:
    swarm, client, url = metered
    hidden_size = ModelSpec.open(tiny_model).hidden_size
    before = scrape(url)
    session = open_session(client, swarm.servers[0].peer_id, batch_size=2, max_length=16)
    step(client, session, good_inputs(hidden_size, batch=2, length=5))
    hidden, _, _ = good_inputs(hidden_size, batch=2, length=1)
    step(client, session, [hidden, torch.ones(2, 6, dtype=torch.long), torch.full((2, 1), 5)])
    during = scrape(url)
    assert value(during, "swarmbatch_server_open_sessions") == 1
    assert value(during, "swarmbatch_server_cache_reserved_block_tokens") == 2 * 16 * 6  # batch x length x blocks
    assert value(during, "swarmbatch_server_steps_total") - value(before, "swarmbatch_server_steps_total") == 2
    assert value(during, "swarmbatch_server_tokens_total") - value(before, "swarmbatch_server_tokens_total") == 2 * 6
    client.loop.run(session.close())
    after = eventually(url, lambda m: value(m, "swarmbatch_server_open_sessions") == 0)
    assert value(after, "swarmbatch_server_open_sessions") == 0
    assert value(after, "swarmbatch_server_cache_reserved_block_tokens") == 0


def test_a_generation_counts_its_prefill_and_every_decode_step(tiny_model: Path, metered) -> None:
    swarm, _, url = metered
    batch = load_tokenizer(tiny_model)(["Hello world, this is", "A"], return_tensors="pt", padding=True)
    before = scrape(url)
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=swarm.initial_peers) as model:
        new = model.generate(batch.input_ids, batch.attention_mask, max_new_tokens=6)[:, batch.input_ids.shape[1]:]
    # one prefill of the padded prompts, then one step per new token but the last (it is never fed back)
    rows, prompt_length, new_tokens = batch.input_ids.shape[0], batch.input_ids.shape[1], new.shape[1]
    after = eventually(url, lambda m: value(m, "swarmbatch_server_open_sessions") == 0)
    assert value(after, "swarmbatch_server_steps_total") - value(before, "swarmbatch_server_steps_total") == new_tokens
    assert (value(after, "swarmbatch_server_tokens_total") - value(before, "swarmbatch_server_tokens_total")
            == rows * prompt_length + rows * (new_tokens - 1))


def announced(client: Swarm, peer_id: str, check: Callable[[ServerInfo], bool], timeout: float = 15.0) -> ServerInfo:
    """The server's DHT record of block 0, read until `check` holds (it is refreshed every ANNOUNCE_PERIOD)."""
    deadline = time.monotonic() + timeout
    while True:
        record = client.loop.run(client.block_infos(refresh=True))[0][peer_id]
        if check(record) or time.monotonic() > deadline:
            return record
        time.sleep(0.2)


def test_info_metrics_and_the_dht_record_report_the_same_status(tiny_model: Path, metered) -> None:
    swarm, client, url = metered
    hidden_size, peer = ModelSpec.open(tiny_model).hidden_size, swarm.servers[0].peer_id
    # Given: an open session that reserved 2 rows x 16 tokens of cache on each block
    session = open_session(client, peer, batch_size=2, max_length=16)
    step(client, session, good_inputs(hidden_size, batch=2, length=5))
    left = CACHE_TOKENS - 2 * 16
    try:
        # When: the server has announced since, and info and /metrics are read
        record = announced(client, peer, lambda info: info.cache_tokens_left == left)
        info, metrics = client.loop.run(client.call_info(peer)), scrape(url)
    finally:
        client.loop.run(session.close())
    # Then: the three report the same figures
    assert {key: info[key] for key in ServerInfo.model_fields} == record.to_wire()
    reserved, budget = (value(metrics, "swarmbatch_server_cache_reserved_block_tokens"),
                        value(metrics, "swarmbatch_server_cache_budget_block_tokens"))
    assert info["cache_tokens_left"] == record.cache_tokens_left == (budget - reserved) // 6 == left
    assert info["sessions"] == value(metrics, "swarmbatch_server_open_sessions") == 1
    assert (info["start"], info["end"]) == (record.start, record.end) == (
        value(metrics, "swarmbatch_server_span_start"), value(metrics, "swarmbatch_server_span_end"))
    assert info["throughput"] == record.throughput == value(metrics, "swarmbatch_server_throughput") > 0
    assert info["state"] == record.state.value == "online" == next(
        dict(labels)["state"] for (name, labels), sample in metrics.items()
        if name == "swarmbatch_server_state" and sample == 1.0)
    assert (info["steps"], info["tokens"]) == (value(metrics, "swarmbatch_server_steps_total"),
                                               value(metrics, "swarmbatch_server_tokens_total"))
    assert info["errors"] == {dict(labels)["code"]: sample for (name, labels), sample in metrics.items()
                              if name == "swarmbatch_server_errors_total"}


def test_a_taken_metrics_port_is_a_one_line_usage_error(tiny_model: Path, metered) -> None:
    swarm, _, _ = metered
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(cli_command("serve", str(tiny_model), "--blocks", "0:6", "--metrics-port", str(port),
                                          "--initial-peers", *swarm.initial_peers),
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert error_lines == [f"Error: ServerConfigError: cannot serve metrics on 127.0.0.1:{port} "
                           "(Address already in use); pick a free --metrics-port or --metrics-host"]
