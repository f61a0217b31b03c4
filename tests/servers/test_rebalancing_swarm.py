"""Healing with real processes, under a real worker's batch job (PostgreSQL + Redis): four unpinned servers cover a
30-block model (SmolLM2's depth) twice; both holders of one half are killed -9 mid-job, a remaining server moves there,
and the job completes with transformers' greedy tokens; a server joining a covered swarm takes its weakest half."""
from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest
from generation_checks import reference_tokens
from jobs_support import job_status, log_pattern, requests_of
from tiers import process_fixture

from jobs.runtime import Runtime
from jobs.submission import submit_batch
from jobs.worker.runner import STEP_LOG
from launch.local_swarm import LocalSwarm
from launch.local_worker import start_local_worker
from launch.processes import ManagedProcess
from modelprep import write_tiny_model
from swarmclient.coverage import coverage_report
from swarmclient.swarm import Swarm
from swarmclient.textgen import load_tokenizer
from swarmnet.data_structures import ServerState
from swarmnet.model_spec import ModelSpec

LAYERS, HALF = 30, 15
PERIOD = 1.0  # --announce-period and --rebalance-period: records of a killed server then live 10 s (the floor)
# tiny spans measure their speed noisily, the more so on a busy box: every server announces the same throughput, so
# placement and moves follow coverage alone (a measured 15:30 twice as fast as each 0:15 sent a late server to 0:15)
SERVER_ARGS = ["--announce-period", str(PERIOD), "--rebalance-period", str(PERIOD), "--move-drain-seconds", "2",
               "--balance-quality", "0.5", "--throughput", "1000"]
# a killed server's records outlive it by up to 10 s; then a round (up to 1.25 periods), the drain, a load (< 1 s)
COVER_BOUND = 10.0 + 1.25 * PERIOD + 2.0 + 5.0
JOB_PROMPTS = ["Hello world, this is", "The quick brown fox", "Once upon a time", "In the beginning the swarm"]
JOB_TOKENS = 32
LONG_JOB = [f"Request number {i} says that" for i in range(12)], 160  # six batches of 2, one after the other
STEP_PATTERN = log_pattern(STEP_LOG)


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


def wait_for(what: str, check: Callable[[], bool], timeout: float, seen: Callable[[], object] = lambda: None) -> None:
    """Poll `check` until it holds; past `timeout`, fail saying what `seen` reports then."""
    deadline = time.monotonic() + timeout
    began = time.monotonic()
    while not check():
        assert time.monotonic() < deadline, f"not {what} in {timeout:.0f} s; seen: {seen()}"
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


def job_file(prompts: list[str], max_tokens: int) -> bytes:
    """Greedy completions, one line per prompt, custom ids `req-I`."""
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}} for i, prompt in enumerate(prompts)]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def greedy_ids(model_dir: Path, prompt: str, max_new_tokens: int, eos: set[int]) -> list[int]:
    """transformers' greedy continuation of one prompt, up to and without its first EOS (as a job stores it)."""
    tokens = reference_tokens(model_dir, load_tokenizer(model_dir)([prompt], return_tensors="pt"), max_new_tokens)[0]
    ids = tokens.tolist()
    return next((ids[:i] for i, token in enumerate(ids) if token in eos), ids)


def tokens_in_log(log: Path) -> dict[int, tuple[float, int]]:
    """Per request id, (time, count) of the first debug step line at which the worker had generated that many."""
    seen: dict[int, tuple[float, int]] = {}
    for line in log.read_text().splitlines():
        if match := STEP_PATTERN.search(line):
            at = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for pair in match.group(2).split():
                request_id, count = (int(x) for x in pair.split("="))
                if count > seen.get(request_id, (0.0, -1))[1]:
                    seen[request_id] = (at, count)
    return seen


@pytest.fixture
def job_runtime(make_runtime: Callable[..., Runtime], postgres_url: str, redis_url: str) -> Runtime:
    """PostgreSQL + Redis, checkpointing every 2 tokens."""
    return make_runtime(database_url=postgres_url, broker_url=redis_url, checkpoint_every=2)


def run_worker(runtime: Runtime, swarm: LocalSwarm, batch_size: int = 4) -> ManagedProcess:
    settings = runtime.settings.model_copy(update={"initial_peers": swarm.initial_peers, "worker_batch_size": batch_size,
                                                   "lease_seconds": 10.0, "sweep_interval": 2.0})
    return start_local_worker(settings, log_dir=swarm.log_dir, name="worker", verbose=True)


def expect_greedy_outputs(runtime: Runtime, job_id: str, model_dir: Path, prompts: list[str], max_tokens: int) -> None:
    """The job completed with each custom id once and every line's tokens equal to transformers' greedy ones."""
    rows = requests_of(runtime, job_id)
    assert sorted(r.custom_id for r in rows) == sorted(f"req-{i}" for i in range(len(prompts)))
    assert all(r.status == "completed" for r in rows), [(r.custom_id, r.status, r.last_error) for r in rows]
    eos = ModelSpec.open(model_dir).eos_token_ids
    for row in rows:
        prompt = prompts[int(row.custom_id.removeprefix("req-"))]
        assert list(row.generated_ids) == greedy_ids(model_dir, prompt, max_tokens, eos), row.custom_id


def test_a_batch_job_survives_kill_9_of_both_holders_of_a_half_and_the_swarm_heals_under_it(
        deep_model: Path, healing_swarm: tuple[LocalSwarm, Swarm], job_runtime: Runtime) -> None:
    # Given 4 unpinned servers (2 per half) and a worker generating a batch job of greedy lines
    swarm, client = healing_swarm
    by_peer = {server.peer_id: server for server in swarm.servers}
    victims = halves(client)[(HALF, LAYERS)]
    job = submit_batch(job_runtime, job_file(JOB_PROMPTS, JOB_TOKENS), model=str(deep_model))
    worker = run_worker(job_runtime, swarm)
    try:
        wait_for("tokens committed", lambda: any(len(r.generated_ids) >= 4 for r in requests_of(job_runtime, job.id)),
                 120)
        # When both holders of 15:30 are killed -9 mid-job
        for peer in victims:
            by_peer[peer].kill()
        killed = time.time()
        before = tokens_in_log(worker.log_path)
        # Then a remaining server moves to 15:30, and the job completes
        wait_for("the job completed", lambda: job_status(job_runtime, job.id) == "completed", 240)
    finally:
        worker.terminate()
    # with each custom id once and every text equal to local greedy
    expect_greedy_outputs(job_runtime, job.id, deep_model, JOB_PROMPTS, JOB_TOKENS)
    survivors = halves(client)
    assert len(survivors[(0, HALF)]) == 1 and len(survivors[(HALF, LAYERS)]) == 1
    assert not set(victims) & {p for peers in survivors.values() for p in peers}
    # by one move, logged with its reason, shown by `swarm status`: the hole, or (when one victim's record expired
    # before the other's) the bottleneck of a half that seemed to have one slow server left
    moves = [(at, line) for at, line in moved_at(swarm) if at > killed]
    assert len(moves) == 1, moves
    logged = re.search(r"Moved blocks 0:15 -> 15:30 in .*\): (no server held blocks 15:30|bottleneck \d+ -> \d+ "
                       r"steps/s)$", moves[0][1])
    assert logged, moves
    report = coverage_report(client.model_id, client.loop.run(client.block_infos(refresh=True)))
    mover = next(s for s in report["servers"] if s["peer_id"] == survivors[(HALF, LAYERS)][0])
    assert mover["moves"][-1]["reason"] == logged.group(1) and report["bottleneck"]["throughput"] > 0
    after = tokens_in_log(worker.log_path)
    resumed = min(at for rid, (at, count) in after.items() if count > before.get(rid, (0.0, 0))[1])
    covered, next_token = moves[0][0] - killed, resumed - killed
    print(f"kill -9 -> 15:30 served again: {covered:.1f} s; -> the job's next token: {next_token:.1f} s")
    assert covered < COVER_BOUND


@pytest.mark.swarm
def test_a_server_joining_a_covered_swarm_mid_job_takes_the_weakest_half(
        deep_model: Path, job_runtime: Runtime, tmp_path: Path) -> None:
    # Given a covered swarm: two pinned servers on 0:15, one on 15:30, and a worker generating a batch job
    with LocalSwarm(deep_model, [(0, HALF), (0, HALF), (HALF, LAYERS)], log_dir=tmp_path,
                    server_args=SERVER_ARGS) as swarm:
        spec = ModelSpec.open(deep_model)
        client = Swarm.connect(swarm.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks)
        job = submit_batch(job_runtime, job_file(*LONG_JOB), model=str(deep_model))
        worker = run_worker(job_runtime, swarm, batch_size=2)
        try:
            wait_for("tokens committed",
                     lambda: any(len(r.generated_ids) >= 2 for r in requests_of(job_runtime, job.id)), 120)
            # When an unpinned server joins late
            late = swarm.start_unpinned(HALF)
            # Then it serves 15:30, the weakest half, without moving anyone
            wait_for("the late server on 15:30", lambda: late.peer_id in halves(client)[(HALF, LAYERS)], 30,
                     seen=lambda: (late.peer_id, spans(client)))
            assert job_status(job_runtime, job.id) == "in_progress", "the job should still run when the server joins"
            wait_for("the job completed", lambda: job_status(job_runtime, job.id) == "completed", 240)
            assert {half: len(peers) for half, peers in halves(client).items()} == {(0, HALF): 2, (HALF, LAYERS): 2}
            assert moved_at(swarm) == []
        finally:
            worker.terminate()
            client.close()
    # and the job's texts equal local greedy, each custom id once
    expect_greedy_outputs(job_runtime, job.id, deep_model, *LONG_JOB)
