"""The throughput features of a worker: pipelined micro-batches, continuous batching, server-side merging, chunked
prefills.

Real worker processes on a real swarm; the features must change how the work is scheduled, never its output.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from jobs_support import claims, job_status, log_pattern, requests_of, wait_for
from tiers import process_fixture

from jobs.runtime import Runtime
from jobs.submission import submit_batch
from launch.local_swarm import LocalSwarm
from launch.local_worker import start_local_worker
from servers.sessions import SESSION_CLOSED_LOG, SESSION_OPENED_LOG
from swarmnet.model_spec import ModelSpec

# prefill_chunk_tokens 8: every lane's prefill goes as steps of at most 8 tokens, taking turns with the other lane's
FEATURES_ON = {"pipeline_lanes": 2, "continuous_batching": True, "prefill_chunk_tokens": 8}
FEATURES_OFF = {"pipeline_lanes": 1, "continuous_batching": False, "prefill_chunk_tokens": 0}


@process_fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def throughput_swarm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[LocalSwarm]:
    """Two servers, halves of the tiny model or of SmolLM2."""
    model = request.getfixturevalue("tiny_model" if request.param == "tiny" else "smollm2_model")
    blocks = ModelSpec.open(model).num_blocks
    with LocalSwarm(model, [(0, blocks // 2), (blocks // 2, blocks)],
                    log_dir=tmp_path_factory.mktemp("throughput-swarm")) as swarm:
        yield swarm


def mixed_batch(count: int) -> bytes:
    """Greedy requests whose lengths differ a lot, so that rows finish at different steps."""
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "The river " * (1 + i % 5), "max_tokens": 4 + 5 * (i % 6),
                                  "temperature": 0}})
             for i in range(count)]
    return ("\n".join(lines) + "\n").encode()


def run_job(runtime: Runtime, swarm: LocalSwarm, model: Path, log_dir: Path, name: str, features: dict[str, object]
            ) -> tuple[str, Path]:
    """Run a 12-request job with one worker process (batch 4) and these features; returns (job id, worker log)."""
    job = submit_batch(runtime, mixed_batch(12), model=str(model))
    settings = runtime.settings.model_copy(update={"initial_peers": swarm.initial_peers, "worker_batch_size": 4,
                                                   **features})
    worker = start_local_worker(settings, log_dir=log_dir, name=name, verbose=True)
    try:
        wait_for(lambda: job_status(runtime, job.id) == "completed", 120, f"the job with {name}")
    finally:
        worker.terminate()
    return job.id, worker.log_path


def most_sessions_open_at_once(log: str) -> int:
    """From a server's log: the largest number of inference sessions open at the same time."""
    opened, closed = log_pattern(SESSION_OPENED_LOG), log_pattern(SESSION_CLOSED_LOG)
    open_now = most = 0
    for line in log.splitlines():
        open_now += 1 if opened.search(line) else -1 if closed.search(line) else 0
        most = max(most, open_now)
    return most


def test_pipelining_and_continuous_batching_change_the_schedule_but_not_the_texts(
        make_runtime: Callable[..., Runtime], throughput_swarm: LocalSwarm, tmp_path: Path) -> None:
    model = Path(throughput_swarm.model_dir)
    runtime = make_runtime(checkpoint_every=4)
    server_log = throughput_swarm.servers[0].log_path
    before = len(server_log.read_text())
    on_job, on_log = run_job(runtime, throughput_swarm, model, tmp_path, "features-on", FEATURES_ON)
    on_server_log = server_log.read_text()[before:]
    off_job, _ = run_job(runtime, throughput_swarm, model, tmp_path, "features-off", FEATURES_OFF)

    # pipelining: the first server held two micro-batch sessions of the worker at once
    assert most_sessions_open_at_once(on_server_log) >= 2
    # continuous batching: requests were claimed into freed slots, and the first one started before the first
    # claimed batch had finished (it did not wait for the whole batch)
    log = on_log.read_text()
    first = next(ids for ids, refill in claims(log) if not refill)
    refills = [ids for ids, refill in claims(log) if refill]
    assert refills, "no request took a freed slot"
    rows = {r.id: r for r in requests_of(runtime, on_job)}
    refilled = refills[0]
    assert min(rows[i].started_at for i in refilled) < max(rows[i].completed_at for i in first)
    assert all(r.attempts == 1 for r in rows.values())
    # and the greedy texts are the same as with every feature off
    def texts(job_id: str) -> dict[str, tuple[list[int], str | None]]:
        return {r.custom_id: (r.generated_ids, r.output_text) for r in requests_of(runtime, job_id)}
    assert texts(on_job) == texts(off_job)


@pytest.mark.parametrize(("setting", "expected"), [(1024, 1024), (8, 8), (0, None)])
def test_a_workers_swarm_client_chunks_prefills_as_its_settings_say(make_runtime: Callable[..., Runtime], setting: int,
                                                                     expected: int | None) -> None:
    runtime = make_runtime(prefill_chunk_tokens=setting)
    assert runtime.client_config().prefill_chunk_tokens == expected
    assert runtime.client_config().verify_fraction == runtime.settings.verify_fraction
