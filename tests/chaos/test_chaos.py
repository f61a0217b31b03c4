"""Chaos: a job survives its broker, its database and a block server crashing mid-job (issue 14's chaos suite).

Real processes throughout: a DHT node and two block servers that each hold every block (either is the other's
spare), one plain `swarmbatch worker` (no beat), and private Redis and PostgreSQL servers (conftest.py) that are
killed and restarted on their ports. Each time the job completes with every custom_id once, texts identical to an
uninterrupted run of the same batch, and every request on its first attempt. Each test prints the time from the
fault to resumed progress and the tokens recomputed per request (run with -s to see them).
"""
from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from jobs_support import job_status, requests_of, wait_for
from private_servers import PrivatePostgres, PrivateRedis
from sqlalchemy.exc import DBAPIError

from jobs import store
from jobs.assembly import build_runtime
from jobs.db import held
from jobs.migrate import upgrade
from jobs.models import RequestStatus
from jobs.outputs import iter_results
from jobs.runtime import Runtime
from jobs.settings import Settings
from jobs.submission import submit_batch
from jobs.worker.job_worker import JobWorker
from launch.local_swarm import LocalSwarm
from launch.local_worker import start_local_worker
from launch.processes import ManagedProcess

pytestmark = [pytest.mark.swarm]  # private Redis and PostgreSQL servers, a swarm and workers: real processes

K = 4          # checkpoint every K tokens
LEASE = 8.0    # seconds: the worker's lease, short so that lost work comes back fast
SWEEP = 1.5    # seconds between the worker's maintenance ticks
COUNT, MAX_TOKENS, BATCH = 8, 40, 4
OUTAGE = 2.0   # seconds PostgreSQL stays down: well within the lease (a longer one is test_store_faults' business)


def batch_file() -> bytes:
    """COUNT requests, half greedy and half sampled with a seed (both reproducible)."""
    lines = []
    for i in range(COUNT):
        body: dict[str, Any] = {"prompt": f"Chaos test request {i} reports that", "max_tokens": MAX_TOKENS,
                                "temperature": 0}
        if i % 2:
            body.update(temperature=0.9, top_p=0.95, seed=500 + i)
        lines.append({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body})
    return ("\n".join(json.dumps(line) for line in lines) + "\n").encode()


@pytest.fixture(scope="module")
def swarm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(tiny_model, [(0, 6), (0, 6)], log_dir=tmp_path_factory.mktemp("chaos-swarm")) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def reference(tiny_model: Path, swarm: LocalSwarm, private_postgres: PrivatePostgres,
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The batch's texts from an uninterrupted run, generated in this process before any fault."""
    upgrade(private_postgres.url)
    runtime = build_runtime(Settings(home=tmp_path_factory.mktemp("reference"), database_url=private_postgres.url,
                               broker_url="memory://", checkpoint_every=K, initial_peers=swarm.initial_peers))
    try:
        job = submit_batch(runtime, batch_file(), model=str(tiny_model))
        while JobWorker(runtime).process(job.id).more:
            pass
        assert job_status(runtime, job.id) == "completed"
        return texts(runtime, job.id)
    finally:
        runtime.close()


@pytest.fixture
def runtime(make_runtime: Callable[..., Runtime], private_postgres: PrivatePostgres,
            private_redis: PrivateRedis, reference: dict[str, str]) -> Runtime:
    """This process's view of the private store and broker (the reference is generated first, fault-free)."""
    return make_runtime(database_url=private_postgres.url, broker_url=private_redis.url, checkpoint_every=K)


@pytest.fixture
def worker(swarm: LocalSwarm, tmp_path: Path) -> Iterator[Callable[..., ManagedProcess]]:
    """Start one plain `swarmbatch worker` (own process group, debug log with its steps); stopped after the test."""
    started: list[ManagedProcess] = []

    def start(runtime: Runtime, **settings: Any) -> ManagedProcess:
        update = {"initial_peers": swarm.initial_peers, "worker_batch_size": BATCH, "lease_seconds": LEASE,
                  "sweep_interval": SWEEP, **settings}
        started.append(start_local_worker(runtime.settings.model_copy(update=update), log_dir=tmp_path,
                                          verbose=True))
        return started[-1]

    yield start
    for process in started:
        process.terminate()


# ---- reading the job while its store may be down --------------------------------------------------------------------
def texts(runtime: Runtime, job_id: str) -> dict[str, str]:
    """custom_id -> text of the job's results; asserts that no custom_id appears twice."""
    with runtime.session() as session:
        lines = [json.loads(line) for line in iter_results(sessions=held(session), job=store.get_job(session=session,
                                                                                               job_id=job_id))]
    custom_ids = [line["custom_id"] for line in lines]
    assert len(custom_ids) == len(set(custom_ids)), "a request appears twice in the results"
    return {line["custom_id"]: line["response"]["body"]["choices"][0]["text"] for line in lines}


def tokens(runtime: Runtime, job_id: str) -> int | None:
    """Generated tokens committed so far; None while the database does not answer."""
    try:
        with runtime.session() as session:
            return store.generated_tokens(session=session, job_id=job_id)
    except DBAPIError:
        return None


def committed_mid_request(runtime: Runtime, job_id: str) -> bool:
    """Some request is in progress with committed tokens: the moment to strike."""
    return any(r.status == RequestStatus.in_progress and len(r.generated_ids) >= K for r in requests_of(runtime, job_id))


def progress_beyond(runtime: Runtime, job_id: str, baseline: int, timeout: float) -> float:
    """Wait until more than `baseline` tokens are committed; returns when (time.monotonic())."""
    wait_for(lambda: (tokens(runtime, job_id) or 0) > baseline, timeout, "committed progress after the fault")
    return time.monotonic()


STEP = re.compile(r"^(\S+ \S+) DEBUG jobs\.worker\.runner: step \d+: ((?:\d+=\d+ ?)+)$", re.MULTILINE)


def steps(log: Path) -> list[tuple[float, dict[int, int]]]:
    """The worker's step lines: (wall-clock time, {request id: tokens so far}) for each decode step of a lane."""
    return [(datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(),
             {int(rid): int(count) for rid, count in (pair.split("=") for pair in match.group(2).split())})
            for match in STEP.finditer(log.read_text())]


def recomputed(log: Path, runtime: Runtime, job_id: str) -> dict[str, int]:
    """custom_id -> tokens generated more than once, from the worker's step lines.

    Each change of a request's count is one generated token; a count that starts again below where it was (a
    resume from the last checkpoint) generates tokens twice. 0 everywhere means nothing was recomputed.
    """
    sequences: dict[int, list[int]] = {}
    for _, counts in steps(log):
        for request_id, count in counts.items():
            seen = sequences.setdefault(request_id, [])
            if not seen or seen[-1] != count:
                seen.append(count)
    rows = requests_of(runtime, job_id)
    return {r.custom_id: len(sequences.get(r.id, [])) - len(r.generated_ids) for r in rows if r.id in sequences}


def slowest_resume(log: Path, fault: float) -> float:
    """Seconds from the fault (wall clock) until the last request that was generating then made its next token."""
    before: dict[int, int] = {}
    resumed: dict[int, float] = {}
    for at, counts in steps(log):
        for request_id, count in counts.items():
            if at <= fault:
                before[request_id] = count
            elif request_id in before and count > before[request_id]:
                resumed.setdefault(request_id, at)
    assert resumed, "requests that were generating at the fault generate again"
    return max(resumed.values()) - fault


def assert_complete_and_identical(runtime: Runtime, job_id: str, reference: dict[str, str]) -> None:
    """Completed; every custom_id once, with the uninterrupted run's text; each request claimed once."""
    wait_for(lambda: job_status(runtime, job_id) == "completed", 180, "the job to complete")
    assert texts(runtime, job_id) == reference
    assert [(r.custom_id, r.attempts) for r in requests_of(runtime, job_id)] == [(f"req-{i}", 1) for i in range(COUNT)]


def report(fault: str, **facts: object) -> None:
    print(f"\n[chaos] {fault}: " + ", ".join(f"{name.replace('_', ' ')} {value}" for name, value in facts.items()))


# ---- the faults -----------------------------------------------------------------------------------------------------
def test_redis_killed_and_restarted_mid_job(runtime: Runtime, worker: Callable[..., ManagedProcess],
                                            private_redis: PrivateRedis, reference: dict[str, str],
                                            tiny_model: Path) -> None:
    # Given a job of two batches on a worker (no continuous refill: each batch is one task, the next one enqueued)
    job = submit_batch(runtime, batch_file(), model=str(tiny_model))
    process = worker(runtime, continuous_batching=False)
    wait_for(lambda: committed_mid_request(runtime, job.id), 120, "committed tokens of an unfinished request")
    # When Redis is killed -9 mid-batch (every queued message is lost with it) and restarted on its port
    private_redis.kill()
    killed = time.monotonic()
    # the batch in hand finishes without the broker, and its task fails to enqueue the next one (so the chain, and
    # the messages that were queued, are gone: only the worker's own sweep can bring the job back)
    wait_for(lambda: [r.status for r in requests_of(runtime, job.id)].count(RequestStatus.completed) >= BATCH
             and not any(r.status == RequestStatus.in_progress for r in requests_of(runtime, job.id)),
             120, "the first batch to finish")
    finished = time.monotonic()
    wait_for(lambda: bool(re.search(r"process_job\[[\w-]+\] raised unexpected", process.log_path.read_text())), 30,
             "the task's enqueue of the next batch to fail")
    private_redis.start()
    restarted = time.monotonic()
    # Then the worker reconnects, its own sweep re-enqueues the job, and the rest of the job runs
    wait_for(lambda: any(r.status != RequestStatus.pending for r in requests_of(runtime, job.id)[BATCH:]), 120,
             "the second batch to be claimed")
    resumed = time.monotonic()
    assert_complete_and_identical(runtime, job.id, reference)
    report("Redis kill -9", outage_s=f"{restarted - killed:.1f}", batch_ended_in_outage_after_s=f"{finished - killed:.1f}",
           next_batch_claimed_after_restart_s=f"{resumed - restarted:.1f}", fault_to_resumed_s=f"{resumed - killed:.1f}",
           tokens_recomputed=recomputed(process.log_path, runtime, job.id))
    assert process.proc.poll() is None, "the worker must survive its broker"


def test_postgres_crashed_and_restarted_mid_job(runtime: Runtime, worker: Callable[..., ManagedProcess],
                                               private_postgres: PrivatePostgres, reference: dict[str, str],
                                               tiny_model: Path) -> None:
    # Given a job on a worker, with tokens committed
    job = submit_batch(runtime, batch_file(), model=str(tiny_model))
    process = worker(runtime)
    wait_for(lambda: committed_mid_request(runtime, job.id), 120, "committed tokens of an unfinished request")
    before = tokens(runtime, job.id) or 0
    # When PostgreSQL crashes (immediate stop: every connection dropped, no clean shutdown) and restarts after a while
    private_postgres.crash()
    crashed, crashed_at = time.monotonic(), time.time()
    time.sleep(OUTAGE)
    private_postgres.start()
    restarted = time.monotonic()
    # Then the worker's checkpoints get through again (retried, not failed), and the job completes
    resumed = progress_beyond(runtime, job.id, before, 60)
    assert_complete_and_identical(runtime, job.id, reference)
    report("PostgreSQL crash", outage_s=f"{restarted - crashed:.1f}",
           fault_to_committed_progress_s=f"{resumed - crashed:.1f}",
           slowest_request_resumed_s=f"{slowest_resume(process.log_path, crashed_at):.1f}",
           tokens_recomputed=recomputed(process.log_path, runtime, job.id))
    assert "the database failed" in process.log_path.read_text(), "the worker should have retried its store"


def open_sessions(server: ManagedProcess, since: int) -> int:
    """Inference sessions the server's log shows opened after byte `since` and still open."""
    with open(server.log_path, "rb") as file:
        file.seek(since)
        log = file.read().decode(errors="replace")
    return len(re.findall(r"Session \w+ opened", log)) - len(re.findall(r"Session \w+ closed|closing it", log))


def test_a_block_server_killed_mid_job_fails_over_to_its_spare(runtime: Runtime, worker: Callable[..., ManagedProcess],
                                                              swarm: LocalSwarm, reference: dict[str, str],
                                                              tiny_model: Path) -> None:
    # Given a job on a worker whose sessions run on one of two servers that hold the same blocks
    marks = {server.name: server.log_path.stat().st_size for server in swarm.servers}  # sessions of earlier tests
    job = submit_batch(runtime, batch_file(), model=str(tiny_model))
    process = worker(runtime)
    wait_for(lambda: committed_mid_request(runtime, job.id), 120, "committed tokens of an unfinished request")
    # When the server in use is killed -9 mid-job
    victim = max(swarm.servers, key=lambda server: open_sessions(server, marks[server.name]))
    assert open_sessions(victim, marks[victim.name]) > 0, "the worker's sessions run on some server"
    before = tokens(runtime, job.id) or 0
    victim.kill()
    killed, killed_at = time.monotonic(), time.time()
    # Then the worker's sessions fail over to the spare, and the job completes as if nothing happened
    resumed = progress_beyond(runtime, job.id, before, 60)
    assert_complete_and_identical(runtime, job.id, reference)
    report("block server kill -9", fault_to_committed_progress_s=f"{resumed - killed:.1f}",
           slowest_request_resumed_s=f"{slowest_resume(process.log_path, killed_at):.1f}",
           tokens_recomputed=recomputed(process.log_path, runtime, job.id))
    # the worker's inference sessions failed over inside the task (no batch failed, no request was given back)
    assert re.search(r"Attempt 1 failed \(server \w+ failed", process.log_path.read_text())
