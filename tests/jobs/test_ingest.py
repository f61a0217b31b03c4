"""Checking a REST submission's lines off the request (jobs.ingest): in commits, durable across a killed worker,
exactly once with two checkers at once, and whole-file failures in OpenAI's shape. Real stores, real worker
processes, the tiny model's tokenizer."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import new_key
from jobs_support import ApiClient, check_lines, wait_for
from sqlalchemy import select

from jobs import files, ingest, store
from jobs.models import Job, JobStatus, Request
from jobs.runtime import Runtime
from jobs.submission import submit_unchecked
from jobs.worker.sweep import sweep_store
from launch.local_worker import start_local_worker


@pytest.fixture(params=["sqlite", "postgresql"])
def any_store_runtime(request: pytest.FixtureRequest, make_runtime: Callable[..., Runtime], redis_url: str,
                      tiny_model: Path) -> Runtime:
    """The runtime on each supported database (Redis broker); the API serves the tiny model."""
    database_url = request.getfixturevalue("postgres_url") if request.param == "postgresql" else None
    return make_runtime(database_url=database_url, broker_url=redis_url, api_models=[str(tiny_model)])


def line(custom_id: str, prompt: str = "Hello there", **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt, "max_tokens": 4, "temperature": 0, **body}})


def big_file(count: int) -> tuple[bytes, set[str], list[tuple[int, str]]]:
    """`count` lines, a bad one every 97th, and near the end a line reusing the custom_id of line 1 (a duplicate
    found only if the custom_ids of earlier commits are known); returns (file, good custom_ids, (line, code) errors)."""
    lines, good, errors = [], set(), []
    for number in range(1, count + 1):
        if number % 97 == 0:
            lines.append("{not json")
            errors.append((number, "invalid_json"))
        elif number == count - 3:
            lines.append(line("req-1", "a second line with the first line's id"))
            errors.append((number, "duplicate_custom_id"))
        else:
            lines.append(line(f"req-{number}", f"Request number {number} says that the council"))
            good.add(f"req-{number}")
    return ("\n".join(lines) + "\n").encode(), good, errors


def submit(runtime: Runtime, data: bytes, model: Path, **options: Any) -> str:
    """A REST submission (what POST /v1/batches calls): stored with its lines unchecked; returns the job id."""
    return submit_unchecked(runtime, model=str(model), pieces=lambda: [data], filename="big.jsonl",
                            **options).job.id


def assert_each_line_once(runtime: Runtime, job_id: str, good: set[str], errors: list[tuple[int, str]]) -> None:
    """Every good line is one request (indexes 0..n-1 in line order), every bad line one error, none twice."""
    with runtime.session() as session:
        rows = session.execute(select(Request.custom_id, Request.index, Request.line_number)
                               .where(Request.job_id == job_id).order_by(Request.index)).all()
        job = session.get(Job, job_id)
        assert job is not None and job.ingest_offset is None
        stored_errors = [(e["line_number"], e["code"]) for e in job.line_errors]
    assert [r.index for r in rows] == list(range(len(rows)))
    assert [r.custom_id for r in rows] == sorted(good, key=lambda c: int(c.split("-")[1]))
    assert [r.line_number for r in rows] == sorted(r.line_number for r in rows)
    assert stored_errors == errors


def test_lines_are_checked_in_commits_and_the_counts_and_errors_grow_as_they_are(
        runtime_with_api: tuple[Runtime, httpx.Client], tiny_model: Path) -> None:
    # Given a 3,000-line submission, answered at once with nothing checked yet
    runtime, api = runtime_with_api
    data, good, errors = big_file(3_000)
    created = api.post("/v1/batches", files={"file": ("big.jsonl", data)}, data={"model": str(tiny_model)})
    assert created.status_code == 200, created.text
    job_id = created.json()["id"]
    assert created.json()["request_counts"]["total"] == 0 and created.json()["status"] == "validating"

    # When a worker checks its lines, 200 a commit, while a client polls the batch
    checking = threading.Thread(target=ingest.check_lines, args=(runtime, job_id), kwargs={"lines_per_commit": 200})
    checking.start()
    seen: list[tuple[int, int]] = []
    while checking.is_alive():
        batch = api.get(f"/v1/batches/{job_id}").json()
        seen.append((batch["request_counts"]["total"], len((batch["errors"] or {}).get("data") or [])))
    checking.join()

    # Then the client saw the requests and the line errors grow, commit by commit, before the last line was checked
    partial = sorted({s for s in seen if 0 < s[0] < len(good)})
    assert len(partial) >= 3, seen
    assert seen == sorted(seen)  # they only ever grow
    assert any(0 < bad < len(errors) for _, bad in partial)
    assert_each_line_once(runtime, job_id, good, errors)
    final = api.get(f"/v1/batches/{job_id}").json()
    assert final["status"] == "validating" and final["request_counts"]["total"] == len(good)
    assert final["endpoint"] == "/v1/completions"  # a multipart batch's endpoint: what its lines use


@pytest.fixture
def runtime_with_api(make_runtime: Callable[..., Runtime], redis_url: str, tiny_model: Path,
                     client: ApiClient) -> tuple[Runtime, httpx.Client]:
    runtime = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)])
    return runtime, client(runtime, new_key(runtime))


@pytest.mark.swarm  # real worker processes
@pytest.mark.parametrize("store_kind", ["embedded", "redis+postgres"])
def test_a_worker_killed_mid_check_leaves_each_line_stored_once_and_another_goes_on(
        store_kind: str, make_runtime: Callable[..., Runtime], request: pytest.FixtureRequest, tiny_model: Path,
        tmp_path: Path) -> None:
    # Given a 20,000-line submission and a real worker process checking its lines
    if store_kind == "embedded":
        runtime = make_runtime(api_models=[str(tiny_model)], lease_seconds=2.0, sweep_interval=1.0)
    else:
        runtime = make_runtime(database_url=request.getfixturevalue("postgres_url"),
                               broker_url=request.getfixturevalue("redis_url"), api_models=[str(tiny_model)],
                               lease_seconds=2.0, sweep_interval=1.0)
    data, good, errors = big_file(20_000)
    job_id = submit(runtime, data, tiny_model)
    first = start_local_worker(runtime.settings, log_dir=tmp_path, name="first", verbose=True)
    try:
        # When it is killed (SIGKILL, its whole process group) once it has committed some lines
        wait_for(lambda: cursor(runtime, job_id)[1] > 0, 120, "the first worker's first commit")
        first.kill()
        offset, checked = cursor(runtime, job_id)
        assert offset is not None and 0 < checked < 20_000, "the worker finished before it could be killed"
        # Then what it committed is stored, nothing more: the job is validating and its requests wait unclaimed
        with runtime.session() as session:
            statuses = set(session.scalars(select(Request.status).where(Request.job_id == job_id)))
            assert session.get(Job, job_id).status == JobStatus.validating  # type: ignore[union-attr]
        assert statuses <= {"pending"}
        # and a sweep neither ends the job nor lets it run before its lines are all checked
        sweep_store(runtime)
        assert job_status(runtime, job_id) == JobStatus.validating
    finally:
        first.terminate()
    # When another worker comes, Then it goes on from the cursor (its sweep dispatches the job once the dead
    # worker's hold lapses) and every line ends stored exactly once
    second = start_local_worker(runtime.settings, log_dir=tmp_path, name="second", verbose=True)
    try:
        wait_for(lambda: cursor(runtime, job_id)[0] is None, 180, "the second worker to check the rest")
        assert_each_line_once(runtime, job_id, good, errors)
        log = second.log_path.read_text()
        assert f"Job {job_id}: checking its lines from line {checked + 1} " in log
    finally:
        second.terminate()


def cursor(runtime: Runtime, job_id: str) -> tuple[int | None, int]:
    with runtime.session() as session:
        offset, checked = session.execute(select(Job.ingest_offset, Job.ingest_line).where(Job.id == job_id)).one()
        return offset, checked


def job_status(runtime: Runtime, job_id: str) -> str:
    with runtime.session() as session:
        return str(session.scalar(select(Job.status).where(Job.id == job_id)))


def test_two_checkers_at_once_store_each_line_once(any_store_runtime: Runtime, tiny_model: Path) -> None:
    # Given a submission whose message was delivered twice: two workers check its lines at once
    runtime = any_store_runtime
    data, good, errors = big_file(3_000)
    job_id = submit(runtime, data, tiny_model)
    outcomes: list[ingest.Ingested] = []
    checkers = [threading.Thread(target=lambda: outcomes.append(ingest.check_lines(runtime, job_id,
                                                                                   lines_per_commit=300)))
                for _ in range(2)]
    for checker in checkers:
        checker.start()
    for checker in checkers:
        checker.join()

    # Then every line is stored once, and only one of them says the job is ready (it sends the chains)
    assert_each_line_once(runtime, job_id, good, errors)
    assert sorted(o.requests for o in outcomes) == [0, len(good)]


def test_a_check_stops_after_its_slice_of_time_and_the_next_goes_on_where_it_stopped(
        make_runtime: Callable[..., Runtime], redis_url: str, tiny_model: Path) -> None:
    # Given a submission of 1,000 lines, checked 100 a commit, in slices that end after their first commit
    runtime = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)])
    data, good, errors = big_file(1_000)
    job_id = submit(runtime, data, tiny_model)

    # When a worker checks slice after slice, as long as it is told there is more
    slices = [ingest.check_lines(runtime, job_id, lines_per_commit=100, seconds=0)]
    while slices[-1].more:
        slices.append(ingest.check_lines(runtime, job_id, lines_per_commit=100, seconds=0))

    # Then each slice stored one commit and said so, the last said how many requests the job has, and each line is
    # stored once
    assert len(slices) == 11 and all(s.more and s.requests == 0 for s in slices[:-1])
    assert slices[-1] == ingest.Ingested(ran=True, requests=len(good))
    assert_each_line_once(runtime, job_id, good, errors)


@pytest.mark.parametrize(("data", "code", "message"), [
    (b"\n".join([line("a").encode(), line("b").encode(), line("c").encode(), line("d").encode()]),
     "too_many_lines", "the input file has 4 non-empty lines; the limit is 3 (SWARMBATCH_MAX_LINES)"),
    (line("a").encode() + b'\n{"custom_id": "b\xff"}\n', "invalid_encoding", "the input file is not valid UTF-8 (line 2"),
    (b"\n  \n\n", "empty_file", "the input file has no non-empty line"),
])
def test_a_file_that_fails_as_a_whole_ends_the_batch_failed_with_that_error_and_no_request(
        make_runtime: Callable[..., Runtime], redis_url: str, tiny_model: Path, data: bytes, code: str,
        message: str) -> None:
    runtime = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)], max_lines=3)
    job_id = submit(runtime, data, tiny_model)

    check_lines(runtime, job_id)

    with runtime.session() as session:
        job = store.get_job(session=session, job_id=job_id)
        assert job.status == JobStatus.failed and job.ingest_offset is None and job.error_file_id is not None
        assert store.job_counts(session=session, job_id=job_id).total == 0
        [error] = job.line_errors
    assert error["code"] == code and error["message"].startswith(message) and "\n" not in error["message"]


def test_a_file_over_the_limit_the_workers_hold_fails_the_batch_whole(
        make_runtime: Callable[..., Runtime], redis_url: str, tiny_model: Path) -> None:
    # Given a file the API stored under its limit, and workers whose operator lowered it since
    api = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)])
    data = (line("a") + "\n" + line("b") + "\n").encode()
    job_id = submit(api, data, tiny_model)
    worker = make_runtime(database_url=api.settings.resolved_database_url, broker_url=redis_url,
                          api_models=[str(tiny_model)], max_file_bytes=len(data) - 1)

    check_lines(worker, job_id)

    with worker.session() as session:
        job = store.get_job(session=session, job_id=job_id)
        [error] = job.line_errors
    assert job.status == JobStatus.failed and error["code"] == "file_too_large"
    assert error["message"].startswith(f"the input file is {len(data)} bytes; the limit is {len(data) - 1}")


def test_an_input_file_deleted_before_its_lines_are_checked_fails_the_batch_saying_so(
        make_runtime: Callable[..., Runtime], redis_url: str, tiny_model: Path) -> None:
    runtime = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)])
    job_id = submit(runtime, (line("a") + "\n").encode(), tiny_model)
    with runtime.session() as session:
        job = store.get_job(session=session, job_id=job_id)
        files.delete_file(session=session, row=files.get_file(session=session, file_id=str(job.input_file_id)))
        session.commit()

    check_lines(runtime, job_id)

    with runtime.session() as session:
        job = store.get_job(session=session, job_id=job_id)
        [error] = job.line_errors
    assert job.status == JobStatus.failed and error["code"] == "file_not_found"
    assert "upload it again and create a new batch" in error["message"]


def test_a_job_whose_lines_are_unchecked_is_not_settled_and_is_dispatched_once_its_hold_lapses(
        make_runtime: Callable[..., Runtime], redis_url: str, tiny_model: Path) -> None:
    # Given a submission whose chain was lost (its message never reached a worker)
    runtime = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)], lease_seconds=0.5)
    job_id = submit(runtime, (line("a") + "\n").encode(), tiny_model)

    # When the sweeps come by, while the submission's hold lasts and after it lapsed
    held = sweep_store(runtime)
    time.sleep(0.6)
    lapsed = sweep_store(runtime)

    # Then the job, without a request yet, is not finished for want of one, and is sent to a worker once
    assert held == [] and lapsed == [job_id] and sweep_store(runtime) == []
    assert job_status(runtime, job_id) == JobStatus.validating
