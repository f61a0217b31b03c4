"""Healing with real processes: four unpinned servers cover a 30-block model (SmolLM2's depth) twice; both holders
of one half are killed -9 in the middle of a generation, a remaining server moves there, and the generation ends
with transformers' greedy tokens."""
from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest
import torch
from generation_checks import reference_tokens
from tiers import process_fixture

from launch.local_swarm import LocalSwarm
from modelprep import write_tiny_model
from swarmclient.config import ClientConfig
from swarmclient.coverage import coverage_report
from swarmclient.generation import generate_tokens
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.swarm import Swarm
from swarmclient.textgen import load_tokenizer
from swarmnet.data_structures import ServerState
from swarmnet.model_spec import ModelSpec

LAYERS, HALF = 30, 15
PERIOD = 1.0  # --announce-period and --rebalance-period: records of a killed server then live 10 s (the floor)
SERVER_ARGS = ["--announce-period", str(PERIOD), "--rebalance-period", str(PERIOD), "--move-drain-seconds", "2",
               "--balance-quality", "0.5"]  # tiny spans measure their speed noisily: move on holes, not on noise
# a killed server's records outlive it by up to 10 s; then a round (up to 1.25 periods), the drain, a load (< 1 s)
COVER_BOUND = 10.0 + 1.25 * PERIOD + 2.0 + 5.0
PROMPTS = ["Hello world, this is", "The quick brown fox"]


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama as deep as SmolLM2-135M (30 blocks)."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-30", layers=LAYERS, seed=3)


def spans(client: Swarm) -> dict[str, tuple[int, int, ServerState]]:
    """Each server's announced span and state, as a client reads them now."""
    found: dict[str, tuple[int, int, ServerState]] = {}
    for servers in client.loop.run(client.block_infos(refresh=True)):
        for peer, info in servers.items():  # a server that moved left OFFLINE records under the blocks it left
            if peer not in found or found[peer][2] is ServerState.OFFLINE:
                found[peer] = (info.start, info.end, info.state)
    return found


def halves(client: Swarm) -> dict[tuple[int, int], list[str]]:
    """The ONLINE servers of each half."""
    online = {peer: (a, b) for peer, (a, b, state) in spans(client).items() if state is ServerState.ONLINE}
    return {half: sorted(p for p, s in online.items() if s == half) for half in [(0, HALF), (HALF, LAYERS)]}


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    began = time.monotonic()
    while not check():
        assert time.monotonic() < deadline, f"not {what} in {timeout:.0f} s"
        time.sleep(0.25)
    print(f"{what}: {time.monotonic() - began:.1f} s")


@process_fixture()
def healing_swarm(deep_model: Path, tmp_path: Path) -> Iterator[tuple[LocalSwarm, Swarm]]:
    """Two servers started at once (both pick 0:15, one moves to the hole 15:30), then two more one by one (each
    takes the half with one server): 2 + 2."""
    with LocalSwarm(deep_model, [], log_dir=tmp_path, server_args=SERVER_ARGS) as swarm:
        spec = ModelSpec.open(deep_model)
        client = Swarm.connect(swarm.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks)
        try:
            for server in [swarm.start_unpinned(HALF, wait=False) for _ in range(2)]:
                server.wait_for_line("Serving blocks", timeout=60)
            wait_for("one server per half", lambda: all(len(p) == 1 for p in halves(client).values()), 30)
            for count in (3, 4):
                swarm.start_unpinned(HALF)
                wait_for(f"{count} servers online", lambda c=count: sum(map(len, halves(client).values())) == c, 10)
            wait_for("two servers per half", lambda: all(len(p) == 2 for p in halves(client).values()), 15)
            yield swarm, client
        finally:
            client.close()


def moved_at(swarm: LocalSwarm) -> list[tuple[float, str]]:
    """(wall-clock time, line) of each 'Moved blocks' line in the servers' logs."""
    lines = [line for path in swarm.log_dir.glob("server*.log") for line in path.read_text().splitlines()
             if "Moved blocks" in line]
    return sorted((datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp(), line) for line in lines)


def test_killing_both_holders_of_a_half_mid_generation_heals_and_changes_no_token(
        deep_model: Path, healing_swarm: tuple[LocalSwarm, Swarm]) -> None:
    swarm, client = healing_swarm
    by_peer = {server.peer_id: server for server in swarm.servers}
    victims = halves(client)[(HALF, LAYERS)]
    batch = load_tokenizer(deep_model)(PROMPTS, return_tensors="pt", padding=True)
    expected = reference_tokens(deep_model, batch, 24)
    config = ClientConfig(max_retries=40, max_backoff=1.0)  # a job's client waits out the hole
    stamps: list[float] = []
    killed: list[float] = []

    def on_token(index: int, _: torch.Tensor) -> None:
        stamps.append(time.time())
        if len(stamps) == 4:
            for peer in victims:
                by_peer[peer].kill()
            killed.append(time.time())

    with DistributedModelForCausalLM.from_pretrained(deep_model, initial_peers=swarm.initial_peers,
                                                     config=config) as model:
        rows = batch.input_ids.shape[0]
        with model.inference_session(batch_size=rows, max_length=batch.input_ids.shape[1] + 24) as session:
            tokens = generate_tokens(model.head, session.step, batch.input_ids, batch.attention_mask,
                                     max_new_tokens=24, params=model.sampling_params(rows, False, 1.0, 1.0, 0),
                                     eos_token_ids=model.eos_token_ids, pad_token_id=model.pad_token_id,
                                     on_token=on_token)
    assert torch.equal(tokens, expected)
    survivors = halves(client)
    assert len(survivors[(0, HALF)]) == 1 and len(survivors[(HALF, LAYERS)]) == 1
    assert not set(victims) & {p for peers in survivors.values() for p in peers}
    moves = [(at, line) for at, line in moved_at(swarm) if at > killed[0]]
    assert len(moves) == 1 and re.search(r"0:15 -> 15:30 .*no server held blocks 15:30", moves[0][1]), moves
    report = coverage_report(client.model_id, client.loop.run(client.block_infos(refresh=True)))
    mover = next(s for s in report["servers"] if s["peer_id"] == survivors[(HALF, LAYERS)][0])
    assert mover["moves"][-1]["reason"] == "no server held blocks 15:30" and report["bottleneck"]["throughput"] > 0
    covered, next_token = moves[0][0] - killed[0], stamps[4] - killed[0]
    print(f"kill -9 -> 15:30 served again: {covered:.1f} s; -> the generation's next token: {next_token:.1f} s")
    assert covered < COVER_BOUND
