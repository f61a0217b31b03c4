"""A worker sizes its own batch from what real servers announce, and waits for room instead of failing.

Real servers (the tiny model, all blocks on one server, configured small), the worker's own code path in this
process (JobWorker.process, as the Celery task runs it).
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from jobs_support import requests_of
from sqlalchemy import select

from jobs import store
from jobs.assembly import build_runtime
from jobs.models import Job, Request
from jobs.runtime import Runtime
from jobs.submission import submit_batch
from jobs.worker.job_worker import JobWorker
from jobs.worker.runner import NO_ROOM_LOG, BatchRunner, Lane, RowResult, RowState
from jobs.worker.sizing import CLAIM_AHEAD, PipelinePlan
from jobs.worker.sweep import sweep_store
from launch.local_swarm import LocalSwarm
from swarmnet.model_spec import ModelSpec

PLAN = re.compile(r"Job \S+: claim (\d+) in (\d+) lanes \((.*)\)")


def batch_file(count: int, *, max_tokens: int = 12) -> bytes:
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "The river " * (1 + i % 3), "max_tokens": max_tokens, "temperature": 0}})
             for i in range(count)]
    return ("\n".join(lines) + "\n").encode()


def run_to_completion(runtime: Runtime, job_id: str) -> None:
    worker = JobWorker(runtime)
    for _ in range(50):
        if not worker.process(job_id).more:
            break
    with runtime.session() as session:
        counts = store.job_counts(session=session, job_id=job_id)
    assert counts.completed == counts.total, counts


def refusals(swarm: LocalSwarm, runtime: Runtime, model: Path) -> dict[str, int]:
    """The server's error counters (busy, cache_full, invalid_request...) from its `info` answer."""
    client = runtime.swarm_model(str(model)).swarm
    peer = swarm.servers[0].peer_id
    return dict(client.loop.run(client.call_info(peer))["errors"])


def run_logged(swarm: LocalSwarm, make_runtime: Callable[..., Runtime], model: Path, count: int,
               caplog: pytest.LogCaptureFixture) -> tuple[LocalSwarm, Runtime, Job]:
    """A job of `count` requests run to completion by a worker with default settings, its plans logged in `caplog`."""
    runtime = make_runtime(initial_peers=swarm.initial_peers, checkpoint_every=4)
    job = submit_batch(runtime, batch_file(count), model=str(model))
    with caplog.at_level(logging.INFO, logger="jobs.worker.job_worker"):
        run_to_completion(runtime, job.id)
    return swarm, runtime, job


def plans_logged(caplog: pytest.LogCaptureFixture) -> list[re.Match[str]]:
    """The plans the worker logged: (claim, lanes, bound) in groups 1-3."""
    return [m for m in (PLAN.search(r.getMessage()) for r in caplog.records) if m]


def shortest_row(runtime: Runtime, job_id: str) -> int:
    """The fewest tokens a claimed row of the job reserves: its prompt + max_tokens."""
    with runtime.session() as session:
        rows = session.scalars(select(Request).where(Request.job_id == job_id)).all()
        return min(len(r.prompt_ids) + r.max_tokens for r in rows)


@pytest.fixture
def small_server(local_swarm: Callable[..., LocalSwarm], tiny_model: Path) -> Callable[..., LocalSwarm]:
    def start(*args: str) -> LocalSwarm:
        blocks = ModelSpec.open(tiny_model).num_blocks
        return local_swarm(tiny_model, [(0, blocks)], server_args=list(args))
    return start


def test_a_server_taking_one_row_per_session_gets_one_row_per_lane(
        small_server: Callable[..., LocalSwarm], make_runtime: Callable[..., Runtime], tiny_model: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # Given a server whose sessions hold one row each (--max-batch-size 1), and a 12-request job with default settings
    # When a worker runs it
    swarm, runtime, job = run_logged(small_server("--max-batch-size", "1"), make_runtime, tiny_model, 12, caplog)
    # Then it claimed one row per lane, as many as the lanes, and the server never refused anything
    claim, lanes, bound = next((int(m[1]), int(m[2]), m[3]) for m in plans_logged(caplog))
    assert claim == lanes and bound == "bound: max batch size", (claim, lanes, bound)
    # And a claim set by hand (4 in 2 lanes) still runs one row per session there
    explicit = build_runtime(runtime.settings.model_copy(update={"worker_batch_size": 4, "pipeline_lanes": 2}))
    run_to_completion(explicit, submit_batch(explicit, batch_file(4), model=str(tiny_model)).id)
    assert refusals(swarm, runtime, tiny_model) == {}


def test_a_server_with_little_free_cache_gets_a_claim_that_fits(
        small_server: Callable[..., LocalSwarm], make_runtime: Callable[..., Runtime], tiny_model: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # Given a server that lets one caller cache 120 tokens per block (240, half each; no lending past the share),
    # and requests of ~20 tokens
    # When a worker runs it with default settings
    swarm, runtime, job = run_logged(small_server("--attn-cache-tokens", "240", "--no-lend-idle-cache"), make_runtime,
                                     tiny_model, 16, caplog)
    # Then its claim was what fits in that share and as many again (waiting to start), and no session was refused
    # (no cache_full / busy storm)
    plans, shortest = plans_logged(caplog), shortest_row(runtime, job.id)
    assert plans and all(m[3] == "bound: cache share" for m in plans), [m[0] for m in plans]
    assert all(int(m[1]) * shortest <= CLAIM_AHEAD * 120 for m in plans)
    assert refusals(swarm, runtime, tiny_model) == {}


def test_a_worker_alone_on_a_server_is_lent_the_whole_cache_and_claims_for_it(
        small_server: Callable[..., LocalSwarm], make_runtime: Callable[..., Runtime], tiny_model: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # Given the same server with lending on (the default): a caller alone there may cache 180 tokens per block (all
    # but a reserve of a quarter), not 120
    # When a worker runs a job of 32 requests with default settings
    swarm, runtime, job = run_logged(small_server("--attn-cache-tokens", "240"), make_runtime, tiny_model, 32, caplog)
    # Then its first claim holds more rows than its share alone would let it (what fits 180 twice, not 120 twice),
    # and the server refused nothing
    plans, shortest = plans_logged(caplog), shortest_row(runtime, job.id)
    assert plans and plans[0][3] == "bound: cache share" and int(plans[0][1]) * shortest > CLAIM_AHEAD * 120, \
        [m[0] for m in plans]
    assert all(int(m[1]) * shortest <= CLAIM_AHEAD * 180 for m in plans)
    assert refusals(swarm, runtime, tiny_model) == {}


def test_rows_the_servers_have_no_room_for_wait_and_complete_identically(
        small_server: Callable[..., LocalSwarm], make_runtime: Callable[..., Runtime], tiny_model: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # Given the same small server, and a batch run with a plan that knows nothing of the cache (as when the swarm
    # could not be read): 8 rows in 4 lanes, of which the server admits only some at once
    swarm, runtime, rows, runner, reference = small_server_run(small_server, make_runtime, tiny_model,
                                                               PipelinePlan(claim=8, lanes=4, max_lanes=4))
    # When it runs
    with caplog.at_level(logging.WARNING, logger="jobs.worker.runner"):
        results = runner.run()
    # Then the server refused some lanes for lack of room, those rows waited (no failure, no ban) and completed
    assert any(r.msg == NO_ROOM_LOG for r in caplog.records), "the server should have refused a lane"
    client = runtime.swarm_model(str(tiny_model)).swarm
    assert not client.bans.banned()
    assert refusals(swarm, runtime, tiny_model).get("busy", 0) > 0
    # with the tokens of a run that never waited
    assert_generated_as_the_worker_would(runtime, reference, rows, results)


def test_a_claim_beyond_the_cache_share_starts_only_lanes_that_fit_in_it(
        small_server: Callable[..., LocalSwarm], make_runtime: Callable[..., Runtime], tiny_model: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # Given the same small server (120 tokens per block for one caller), and a plan that knows that share but holds
    # more rows than fit in it (a claim reaches ahead of what runs at once): 8 rows of ~20 tokens, in one lane
    swarm, runtime, rows, runner, reference = small_server_run(
        small_server, make_runtime, tiny_model, PipelinePlan(claim=8, lanes=1, max_lanes=4, cache_tokens=120))
    assert Lane([(RowState(r.id, [], []), r) for r in rows]).reservation() > 120
    # When it runs
    with caplog.at_level(logging.WARNING, logger="jobs.worker.runner"):
        results = runner.run()
    # Then its lanes were cut to what fits in the share: the server refused none, no row waited for room
    assert not any(r.msg == NO_ROOM_LOG for r in caplog.records)
    assert refusals(swarm, runtime, tiny_model) == {}
    # and the tokens are those of the job run as the worker sizes it
    assert_generated_as_the_worker_would(runtime, reference, rows, results)


def small_server_run(small_server: Callable[..., LocalSwarm], make_runtime: Callable[..., Runtime], model: Path,
                     plan: PipelinePlan) -> tuple[LocalSwarm, Runtime, list[Request], BatchRunner, Job]:
    """A server letting one caller cache 120 tokens per block, two 8-request jobs, and a BatchRunner with `plan` over
    all of the first (as if claimed, leases never lost); the second is the reference the worker runs itself."""
    swarm = small_server("--attn-cache-tokens", "240", "--no-lend-idle-cache")
    runtime = make_runtime(initial_peers=swarm.initial_peers, checkpoint_every=4)
    job = submit_batch(runtime, batch_file(8), model=str(model))
    reference = submit_batch(runtime, batch_file(8), model=str(model))
    rows, runner = claimed_runner(runtime, model, job.id, plan)
    return swarm, runtime, rows, runner, reference


def assert_generated_as_the_worker_would(runtime: Runtime, reference: Job, rows: list[Request],
                                         results: dict[int, RowResult]) -> None:
    """The runner's tokens per request equal those of the reference job (the same requests) run by a worker."""
    run_to_completion(runtime, reference.id)
    expected = {r["custom_id"]: r["generated_ids"] for r in _generated(runtime, reference.id)}
    assert {row.custom_id: results[row.id].generated for row in rows} == expected


def claimed_runner(runtime: Runtime, model: Path, job_id: str, plan: PipelinePlan) -> tuple[list[Request], BatchRunner]:
    """A BatchRunner over all of a job's requests (as if claimed, leases never lost), with the given plan."""
    with runtime.session() as session:
        rows = list(session.scalars(select(Request).where(Request.job_id == job_id).order_by(Request.index)))
        for row in rows:
            session.expunge(row)

    def checkpoint(_progress: dict[int, list[int]], _texts: dict[int, str]) -> set[int]:
        return {r.id for r in rows}
    runner = BatchRunner(runtime.swarm_model(str(model)), runtime.tokenizer(str(model)), rows, checkpoint_every=4,
                         checkpoint=checkpoint, continuous=True, plan=plan)
    return rows, runner


def _generated(runtime: Runtime, job_id: str) -> list[dict[str, Any]]:
    with runtime.session() as session:
        return [{"custom_id": r.custom_id, "generated_ids": list(r.generated_ids)}
                for r in session.scalars(select(Request).where(Request.job_id == job_id))]


def test_rows_waiting_for_room_keep_their_lease(
        small_server: Callable[..., LocalSwarm], make_runtime: Callable[..., Runtime], tiny_model: Path) -> None:
    # Given a server with room for a few of this job's rows at a time, a batch of 12 claimed at once (explicit setting)
    # under a 1-second lease, and sweeps running all along that return every lapsed lease to pending
    swarm = small_server("--attn-cache-tokens", "200", "--no-lend-idle-cache")
    runtime = make_runtime(initial_peers=swarm.initial_peers, checkpoint_every=4, lease_seconds=1.0,
                           worker_batch_size=12, pipeline_lanes=4)
    # (90 tokens a row: 2 rows fit at a time, so the batch outlasts several leases even on a fast box, where 60 did
    # not always: 2.8 s once)
    job = submit_batch(runtime, batch_file(12, max_tokens=90), model=str(tiny_model))
    done = threading.Event()
    swept: list[list[str]] = []

    def sweeping() -> None:
        while not done.wait(0.3):
            swept.append(sweep_store(runtime))
    sweeper = threading.Thread(target=sweeping)
    sweeper.start()
    began = time.monotonic()
    try:
        # When the worker runs the batch: its rows wait for room several lease periods
        run_to_completion(runtime, job.id)
    finally:
        done.set()
        sweeper.join()
    # Then no lease lapsed while rows waited: each request was claimed once, by the one batch
    elapsed = time.monotonic() - began
    assert elapsed > 3 * 1.0, "the batch should outlast several leases"
    assert [r.attempts for r in requests_of(runtime, job.id)] == [1] * 12
    # though sweeps ran all along, at least one per lease period (every 0.3 s, more slowly on a busy box)
    assert len(swept) >= elapsed / 1.0, (len(swept), elapsed)
