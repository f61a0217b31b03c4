"""Durable jobs end to end: real worker processes, a real swarm, real stores (embedded, and Redis + PostgreSQL)."""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from generation_checks import CITY
from jobs_support import claims, job_status, log_pattern, requests_of, wait_for
from sqlalchemy import select

from jobs import store
from jobs.db import held
from jobs.models import Job
from jobs.outputs import iter_errors, iter_results
from jobs.runtime import Runtime
from jobs.submission import submit_batch
from jobs.worker.runner import STEP_LOG
from launch.local_swarm import LocalSwarm
from launch.local_worker import start_local_worker
from launch.processes import ManagedProcess

K = 4  # checkpoint every K tokens
LEASE = 10.0  # seconds: the workers' lease
CELERY_READY = " ready."  # what a Celery worker logs once it consumes tasks ('celery@host ready.')


@pytest.fixture(params=["embedded", "redis+postgres"])
def backend(request: pytest.FixtureRequest, make_runtime: Callable[..., Runtime]) -> Runtime:
    """A migrated store and broker: SQLite + the embedded SQLite broker, or PostgreSQL + Redis."""
    if request.param == "embedded":
        return make_runtime(checkpoint_every=K)
    return make_runtime(database_url=request.getfixturevalue("postgres_url"),
                        broker_url=request.getfixturevalue("redis_url"), checkpoint_every=K)


WorkerFactory = Callable[..., ManagedProcess]


@pytest.fixture
def start_worker(shared_swarm: LocalSwarm, tmp_path: Path) -> Iterator[WorkerFactory]:
    """Start plain `swarmbatch worker` processes (no beat; own process groups) on a runtime's store and broker."""
    workers: list[ManagedProcess] = []

    def start(runtime: Runtime, *, batch_size: int | None = 4, lease_seconds: float = LEASE) -> ManagedProcess:
        settings = runtime.settings.model_copy(update={
            "initial_peers": shared_swarm.initial_peers, "worker_batch_size": batch_size,
            "lease_seconds": lease_seconds, "sweep_interval": 2.0})
        workers.append(start_local_worker(settings, log_dir=tmp_path, name=f"worker{len(workers)}", verbose=True))
        return workers[-1]

    yield start
    for worker in workers:
        worker.terminate()


def batch_file(count: int, *, max_tokens: int = 40, bad_lines: bool = False) -> bytes:
    """`count` requests, half greedy and half sampled with a seed; optionally with bad lines mixed in."""
    lines = []
    for i in range(count):
        body: dict[str, Any] = {"prompt": f"Request number {i} says that", "max_tokens": max_tokens, "temperature": 0}
        if i % 2:
            body.update(temperature=0.9, top_p=0.95, seed=1000 + i)
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body}))
        if bad_lines and i == 2:
            lines.append("{broken json")
            lines.append(json.dumps({"custom_id": "req-0", "method": "POST", "url": "/v1/completions",
                                     "body": {"prompt": "duplicate id"}}))
    return ("\n".join(lines) + "\n").encode()


def texts(runtime: Runtime, job_id: str) -> dict[str, str]:
    with runtime.session() as session:
        job = store.get_job(session=session, job_id=job_id)
        lines = [json.loads(line) for line in iter_results(sessions=held(session), job=job)]
    custom_ids = [line["custom_id"] for line in lines]
    assert len(custom_ids) == len(set(custom_ids)), "a request appears twice in the results"
    return {line["custom_id"]: line["response"]["body"]["choices"][0]["text"] for line in lines}


def steps_reached(log: Path) -> dict[int, int]:
    """Per request id, the most tokens a worker had generated (from its debug step lines)."""
    reached: dict[int, int] = {}
    for match in log_pattern(STEP_LOG).finditer(log.read_text()):
        for pair in match.group(2).split():
            request_id, count = (int(x) for x in pair.split("="))
            reached[request_id] = max(reached.get(request_id, 0), count)
    return reached


def test_a_job_survives_kill_9_of_its_worker_with_identical_output(
        backend: Runtime, start_worker: WorkerFactory, tiny_model: Path) -> None:
    # Given a job of 12 requests (greedy and sampled), some bad lines, and a worker generating it
    job = submit_batch(backend, batch_file(12, bad_lines=True), model=str(tiny_model))
    first = start_worker(backend)
    wait_for(lambda: any(len(r.generated_ids) >= K and r.status == "in_progress" for r in requests_of(backend, job.id)),
             120, "committed tokens of an unfinished request")
    # When the worker's whole process group is killed -9 mid-generation (no beat runs anywhere)
    first.kill()
    killed_at = time.monotonic()
    unfinished = {r.id: r.attempts for r in requests_of(backend, job.id) if r.status != "completed"}
    committed = {r.id: len(r.generated_ids) for r in requests_of(backend, job.id) if r.status != "completed"}
    reached = steps_reached(first.log_path)
    # Then another plain worker, once up, takes the interrupted requests over within 2 lease periods, and completes
    # the job (its start-up, which a machine loaded by other tests may stretch, is no part of the takeover)
    second = start_worker(backend)
    wait_for(lambda: CELERY_READY in second.log_path.read_text(errors="replace"), 120, "the second worker to start")
    wait_for(lambda: any(r.attempts > unfinished[r.id] for r in requests_of(backend, job.id) if r.id in unfinished),
             2 * LEASE, "an interrupted request to be claimed again")
    print(f"\nresumed {time.monotonic() - killed_at:.1f} s after the kill (lease {LEASE:.0f} s)")
    wait_for(lambda: job_status(backend, job.id) == "completed", 180, "the job to complete")
    interrupted = {r.id: len(r.generated_ids) for r in requests_of(backend, job.id)}
    assert any(0 < n for n in committed.values()), "the kill should interrupt a request that had committed tokens"
    # and recomputes at most K tokens per interrupted request
    assert reached, "the first worker's step log should show its progress"
    recomputed = {rid: reached[rid] - committed[rid] for rid in committed if rid in reached}
    print(f"\nrecomputed tokens per interrupted request (K={K}): {recomputed}")
    assert recomputed and all(0 <= n <= K for n in recomputed.values()), recomputed
    assert all(n > 0 for n in interrupted.values())
    # and its texts equal an uninterrupted run's, with no request lost or twice
    reference = submit_batch(backend, batch_file(12, bad_lines=True), model=str(tiny_model))
    wait_for(lambda: job_status(backend, reference.id) == "completed", 180, "the reference job")
    got, expected = texts(backend, job.id), texts(backend, reference.id)
    assert sorted(got) == [f"req-{i}" for i in sorted(range(12), key=lambda i: f"req-{i}")]
    assert got == expected
    # and the bad lines are reported with their line numbers
    with backend.session() as session:
        errors = [json.loads(line)["error"] for line in
                  iter_errors(sessions=held(session), job=store.get_job(session=session, job_id=job.id))]
    assert [(e["line"], e["code"]) for e in errors] == [(4, "invalid_json"), (5, "duplicate_custom_id")]
    assert second.proc.poll() is None


def test_kill_9_of_a_worker_holding_a_large_sized_claim_loses_at_most_k_tokens_per_request(
        make_runtime: Callable[..., Runtime], start_worker: WorkerFactory, tiny_model: Path) -> None:
    # Given a 24-request job and a worker with default settings: it sizes its claim itself (all 24 fit the servers)
    runtime = make_runtime(checkpoint_every=K)
    job = submit_batch(runtime, batch_file(24), model=str(tiny_model))
    first = start_worker(runtime, batch_size=None)
    wait_for(lambda: sum(len(r.generated_ids) >= K and r.status == "in_progress"
                         for r in requests_of(runtime, job.id)) >= 16, 120, "16 requests with committed tokens")
    # When it is killed -9 mid-generation
    first.kill()
    committed = {r.id: len(r.generated_ids) for r in requests_of(runtime, job.id) if r.status != "completed"}
    reached = steps_reached(first.log_path)
    (claimed, _), *_ = claims(first.log_path.read_text())
    assert len(claimed) == 24, f"the worker should have claimed the whole job at once, claimed {claimed}"
    # Then another worker completes the job, recomputing at most K tokens per interrupted request
    start_worker(runtime, batch_size=None)
    wait_for(lambda: job_status(runtime, job.id) == "completed", 180, "the job to complete")
    recomputed = {rid: reached[rid] - committed[rid] for rid in committed if rid in reached}
    print(f"\nrecomputed tokens per interrupted request (K={K}): {recomputed}")
    assert len(recomputed) >= 16 and all(0 <= n <= K for n in recomputed.values()), recomputed
    # and its texts equal an uninterrupted run's
    reference = submit_batch(runtime, batch_file(24), model=str(tiny_model))
    wait_for(lambda: job_status(runtime, reference.id) == "completed", 180, "the reference job")
    assert texts(runtime, job.id) == texts(runtime, reference.id)


def test_two_workers_never_generate_the_same_request(
        make_runtime: Callable[..., Runtime], postgres_url: str, redis_url: str, start_worker: WorkerFactory,
        tiny_model: Path) -> None:
    runtime = make_runtime(database_url=postgres_url, broker_url=redis_url, checkpoint_every=K)
    job = submit_batch(runtime, batch_file(16, max_tokens=24), model=str(tiny_model))
    workers = [start_worker(runtime, batch_size=2), start_worker(runtime, batch_size=2)]
    wait_for(lambda: job_status(runtime, job.id) == "completed", 180, "the job to complete")
    rows = requests_of(runtime, job.id)
    assert [r.attempts for r in rows] == [1] * 16, "a request was claimed twice"
    claimed = [set(ids) for w in workers for ids, _ in claims(w.log_path.read_text())]
    all_ids = [rid for batch in claimed for rid in batch]
    assert sorted(all_ids) == sorted(r.id for r in rows), "every request generated exactly once"


def test_cancelling_mid_job_keeps_finished_and_partial_outputs(
        backend: Runtime, start_worker: WorkerFactory, tiny_model: Path) -> None:
    job = submit_batch(backend, batch_file(8, max_tokens=400), model=str(tiny_model))
    start_worker(backend, batch_size=4)
    wait_for(lambda: any(len(r.generated_ids) >= K for r in requests_of(backend, job.id)), 120, "progress")
    with backend.session() as session:
        backend.lifecycle.cancel(session, job.id)
        session.commit()
    wait_for(lambda: job_status(backend, job.id) == "cancelled", 30, "cancelled")
    rows = requests_of(backend, job.id)
    assert {r.status for r in rows} <= {"completed", "cancelled"}
    partial = [r for r in rows if r.status == "cancelled" and r.generated_ids]
    assert partial and all(r.finish_reason == "cancelled" for r in partial)
    results = texts(backend, job.id)
    assert {f"req-{rows.index(r)}" for r in partial} <= set(results)


@pytest.mark.swarm
def test_a_job_waits_for_missing_blocks_and_says_so(
        make_runtime: Callable[..., Runtime], tiny_model: Path, tmp_path: Path) -> None:
    runtime = make_runtime(checkpoint_every=K)
    with LocalSwarm(tiny_model, [(0, 3)], log_dir=tmp_path / "half-swarm") as swarm:
        settings = runtime.settings.model_copy(update={"initial_peers": swarm.initial_peers, "sweep_interval": 2.0})
        worker = start_local_worker(settings, log_dir=tmp_path)
        try:
            job = submit_batch(runtime, batch_file(2, max_tokens=8), model=str(tiny_model))

            def blocked() -> bool:
                with runtime.session() as session:
                    reason = session.scalar(select(Job.blocked_reason).where(Job.id == job.id))
                return bool(reason and "3:6" in reason)
            wait_for(blocked, 120, "the job to report the missing blocks")
            assert job_status(runtime, job.id) in ("validating", "in_progress")
            swarm.start_server(3, 6)
            wait_for(lambda: job_status(runtime, job.id) == "completed", 180, "the job to complete")
        finally:
            worker.terminate()


@pytest.mark.swarm
def test_a_request_longer_than_any_server_grants_one_caller_fails_at_once_and_the_rest_runs(
        make_runtime: Callable[..., Runtime], tiny_model: Path, tmp_path: Path) -> None:
    # Given servers that grant one caller 32 tokens of KV cache per block (64 tokens, half each, nothing lent)
    runtime = make_runtime(checkpoint_every=K)
    small_cache = ["--attn-cache-tokens", "64", "--max-cache-share-per-peer", "0.5", "--no-lend-idle-cache"]
    with LocalSwarm(tiny_model, [(0, 3), (3, 6)], log_dir=tmp_path / "small-cache", server_args=small_cache) as swarm:
        settings = runtime.settings.model_copy(update={"initial_peers": swarm.initial_peers, "sweep_interval": 2.0})
        worker = start_local_worker(settings, log_dir=tmp_path)
        try:
            # When a job holds a request that fits and one that needs prompt + 100 tokens
            lines = [{"custom_id": name, "method": "POST", "url": "/v1/completions",
                      "body": {"prompt": "Hello there", "max_tokens": tokens, "temperature": 0}}
                     for name, tokens in (("fits", 8), ("too-long", 100))]
            job = submit_batch(runtime, "".join(json.dumps(line) + "\n" for line in lines).encode(),
                               model=str(tiny_model))
            # Then the job ends within a minute (not at its deadline, a day later): the short one completed, the
            # long one failed with one line saying what it needs, what the servers grant, and what to change
            wait_for(lambda: job_status(runtime, job.id) == "completed", 60, "the job to end")
        finally:
            worker.terminate()
    rows = {r.custom_id: r for r in requests_of(runtime, job.id)}
    assert rows["fits"].status == "completed" and rows["fits"].generated_ids
    failed = rows["too-long"]
    assert failed.status == "failed" and failed.attempts == 1 and "\n" not in (failed.last_error or "")
    prompt = len(failed.prompt_ids)
    assert f"needs {prompt + 100} tokens of KV cache per block (prompt {prompt} + max_tokens 100), and the most any " \
           "server of the swarm grants one caller is 32: lower max_tokens" in (failed.last_error or ""), failed.last_error


def penalized_batch(count: int, *, max_tokens: int = 40) -> bytes:
    """`count` requests with penalties on (greedy ones and sampled ones with vLLM's extensions, explicit seeds), and
    the same prompts without them (`plain-i`)."""
    lines = []
    for i in range(count):
        prompt = {"prompt": f"Request number {i} says that", "max_tokens": max_tokens, "temperature": 0}
        penalties: dict[str, Any] = {"frequency_penalty": 0.8, "presence_penalty": 0.6, "repetition_penalty": 1.3,
                                     "logit_bias": {"5": 3, "6": -100}}
        if i % 2:
            penalties.update(temperature=0.9, seed=2000 + i, top_k=20, min_p=0.05)
        lines.append({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                      "body": {**prompt, **penalties}})
        lines.append({"custom_id": f"plain-{i}", "method": "POST", "url": "/v1/completions", "body": prompt})
    return ("\n".join(json.dumps(line) for line in lines) + "\n").encode()


def test_a_request_with_penalties_killed_mid_generation_resumes_to_the_text_of_an_undisturbed_run(
        make_runtime: Callable[..., Runtime], start_worker: WorkerFactory, tiny_model: Path) -> None:
    # Given a job of requests with penalties, biases, top_k and min_p, and a worker generating it
    runtime = make_runtime(checkpoint_every=K)
    job = submit_batch(runtime, penalized_batch(4), model=str(tiny_model))
    first = start_worker(runtime)
    wait_for(lambda: any(len(r.generated_ids) >= K and r.status == "in_progress" and r.custom_id.startswith("req")
                         for r in requests_of(runtime, job.id)), 120, "committed tokens of a penalized request")
    # When the worker is killed -9 mid-generation, and another one finishes the job from the checkpoints
    first.kill()
    resumed = {r.custom_id for r in requests_of(runtime, job.id) if r.status != "completed" and r.generated_ids}
    start_worker(runtime)
    wait_for(lambda: job_status(runtime, job.id) == "completed", 180, "the job to complete")
    # Then every text equals an undisturbed run's (a penalty counted from the stored token ids, as before the kill)
    reference = submit_batch(runtime, penalized_batch(4), model=str(tiny_model))
    wait_for(lambda: job_status(runtime, reference.id) == "completed", 180, "the reference job")
    got, expected = texts(runtime, job.id), texts(runtime, reference.id)
    assert any(custom_id.startswith("req") for custom_id in resumed), resumed
    assert got == expected and len(got) == 8
    # and the penalties changed what greedy decoding writes (token 6, biased by -100, never appears)
    assert any(got[f"req-{i}"] != got[f"plain-{i}"] for i in range(0, 4, 2))
    assert all(6 not in r.generated_ids for r in requests_of(runtime, job.id) if r.custom_id.startswith("req"))


TAGS = {"type": "object", "additionalProperties": False, "required": ["tags", "score"],
        "properties": {"tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 6}},
                       "score": {"type": "integer", "minimum": -5, "maximum": 5}}}


def structured_batch(model: Path) -> tuple[bytes, dict[str, dict[str, Any]]]:
    """Chat lines with response formats: two JSON schemas (strict, greedy and sampled), JSON mode (sampled, with biases
    that make the random model close its strings and objects soon), free text, and a schema cut short by max_tokens;
    and the schema each custom_id's output must validate against. 160 tokens hold the longest answer either schema
    allows, even spelled a byte per token."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    closing = {str(tokenizer.convert_tokens_to_ids('"')): 5, str(tokenizer.convert_tokens_to_ids("}")): 2}
    formats: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {}
    for i in range(2):
        sampled = {"temperature": 1.0, "seed": 300 + i}
        for name, schema in (("city", CITY), ("tags", TAGS)):
            spec = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
            formats[f"{name}-greedy-{i}"] = (spec, {"temperature": 0}, schema)
            formats[f"{name}-sampled-{i}"] = (spec, sampled, schema)
        formats[f"object-{i}"] = ({"type": "json_object"}, {**sampled, "logit_bias": closing}, {"type": "object"})
    lines = [{"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": f"Describe {custom_id} as JSON"}], "max_tokens": 160,
                       "response_format": spec, **sampling}}
             for custom_id, (spec, sampling, _) in formats.items()]
    lines.append({"custom_id": "cut", "method": "POST", "url": "/v1/chat/completions",  # city-greedy-0, cut short
                  "body": {"messages": [{"role": "user", "content": "Describe city-greedy-0 as JSON"}], "max_tokens": 6,
                           "temperature": 0, "response_format": formats["city-greedy-0"][0]}})
    lines.append({"custom_id": "free", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": [{"role": "user", "content": "Describe a city"}], "max_tokens": 40,
                           "temperature": 0}})
    return ("\n".join(json.dumps(line) for line in lines) + "\n").encode(), \
        {custom_id: schema for custom_id, (_, _, schema) in formats.items()}


def answers(runtime: Runtime, job_id: str) -> dict[str, tuple[str, str]]:
    """Each chat line's (content, finish_reason)."""
    with runtime.session() as session:
        job = store.get_job(session=session, job_id=job_id)
        lines = [json.loads(line) for line in iter_results(sessions=held(session), job=job)]
    return {line["custom_id"]: ((choice := line["response"]["body"]["choices"][0])["message"]["content"],
                                choice["finish_reason"]) for line in lines}


def test_structured_outputs_killed_mid_generation_resume_to_the_text_of_an_undisturbed_run_and_all_validate(
        make_runtime: Callable[..., Runtime], start_worker: WorkerFactory, tiny_model: Path) -> None:
    # Given a job of chat lines with JSON schemas and JSON mode, greedy and sampled, and a worker generating it
    data, schemas = structured_batch(tiny_model)
    runtime = make_runtime(checkpoint_every=K)
    job = submit_batch(runtime, data, model=str(tiny_model))
    first = start_worker(runtime)
    wait_for(lambda: any(len(r.generated_ids) >= K and r.status == "in_progress" and r.custom_id in schemas
                         for r in requests_of(runtime, job.id)), 120, "committed tokens of a structured request")
    # When the worker is killed -9 mid-generation, and another one finishes the job from the checkpoints
    first.kill()
    resumed = {r.custom_id for r in requests_of(runtime, job.id) if r.status != "completed" and r.generated_ids}
    start_worker(runtime)
    wait_for(lambda: job_status(runtime, job.id) == "completed", 240, "the job to complete")
    # Then every answer equals an undisturbed run's (each grammar's matcher rebuilt from the committed tokens)
    reference = submit_batch(runtime, data, model=str(tiny_model))
    wait_for(lambda: job_status(runtime, reference.id) == "completed", 240, "the reference job")
    got, expected = answers(runtime, job.id), answers(runtime, reference.id)
    assert resumed & set(schemas), resumed
    assert got == expected and len(got) == len(schemas) + 2
    # and every structured answer ended by itself ("stop") as compact JSON that its schema validates
    for custom_id, schema in schemas.items():
        content, finish_reason = got[custom_id]
        assert finish_reason == "stop", (custom_id, content)
        value = json.loads(content)
        jsonschema.validate(value, schema)
        assert content == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    # and a schema cut short by max_tokens ends with "length", as at OpenAI; free text is not JSON
    assert got["cut"][1] == "length" and got["city-greedy-0"][0].startswith(got["cut"][0])
    with pytest.raises(ValueError):
        json.loads(got["free"][0])


def nul_token(model: Path) -> int:
    """The id of a token that decodes to a NUL character (byte-level BPE has one for every byte)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    return next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\x00")


def test_a_generated_nul_character_is_stored_and_returned_exactly(
        make_runtime: Callable[..., Runtime], postgres_url: str, redis_url: str, start_worker: WorkerFactory,
        tiny_model: Path) -> None:
    backend = make_runtime(database_url=postgres_url, broker_url=redis_url, checkpoint_every=K)
    # Given, on PostgreSQL (whose text cannot hold NUL), requests whose bias makes the model write NUL characters,
    # greedy and sampled, checkpointed every K tokens
    nul = nul_token(tiny_model)
    lines = [{"custom_id": f"nul-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"Request number {i} says that", "max_tokens": 2 * K + 1, "temperature": i % 2,
                       "seed": 7, "logit_bias": {str(nul): 100}}} for i in range(2)]
    job = submit_batch(backend, "".join(json.dumps(line) + "\n" for line in lines).encode(), model=str(tiny_model))
    # When a worker runs them
    start_worker(backend)
    wait_for(lambda: job_status(backend, job.id) == "completed", 120, "the job with NUL characters to complete")
    # Then the results hold the NUL characters exactly, once per token, and the request rows read back the same
    assert texts(backend, job.id) == {"nul-0": "\x00" * (2 * K + 1), "nul-1": "\x00" * (2 * K + 1)}
    assert all(r.output_text == "\x00" * (2 * K + 1) for r in requests_of(backend, job.id))
