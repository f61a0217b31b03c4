"""The REST API, served by a real uvicorn on 127.0.0.1 and called with httpx, over a real store and Redis broker.

No worker runs: process_job messages wait in Redis. Where a test needs finished requests it writes them with
the store's own claim/finish functions, as a worker would.
"""
from __future__ import annotations

import json
import logging
import select
import shutil
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from factories import new_key
from jobs_support import ApiClient, check_lines
from ports import free_port

from jobs import clock, ingest, store
from jobs.assembly import build_runtime
from jobs.models import RequestStatus
from jobs.progress import describe_job
from jobs.runtime import Runtime
from jobs.settings import Settings
from jobs.worker.sweep import sweep_store


@pytest.fixture
def runtime(make_runtime: Callable[..., Runtime], redis_url: str, tiny_model: Path) -> Runtime:
    """SQLite store, real Redis broker; the API serves the tiny model."""
    return make_runtime(broker_url=redis_url, api_models=[str(tiny_model)])


@pytest.fixture(params=["sqlite", "postgresql"])
def any_store_runtime(request: pytest.FixtureRequest, make_runtime: Callable[..., Runtime], redis_url: str,
                      tiny_model: Path) -> Runtime:
    """The runtime on each supported database: SQLite, then PostgreSQL."""
    database_url = request.getfixturevalue("postgres_url") if request.param == "postgresql" else None
    return make_runtime(database_url=database_url, broker_url=redis_url, api_models=[str(tiny_model)])



def request_line(custom_id: str, prompt: str = "Hello there", **body: Any) -> dict[str, Any]:
    """One OpenAI batch request line for /v1/completions."""
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": 4, "temperature": 0, **body}}


def jsonl(lines: list[Any]) -> bytes:
    """Lines as a JSONL file (strings are written as they are, to make bad lines)."""
    return "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines).encode() + b"\n"


def upload(api: httpx.Client, model: Path, lines: list[Any], **fields: str) -> httpx.Response:
    """POST /v1/batches as a multipart upload."""
    return api.post("/v1/batches", files={"file": ("batch.jsonl", jsonl(lines), "application/jsonl")},
                    data={"model": str(model), **fields})


def checked(api: httpx.Client, runtime: Runtime, response: httpx.Response) -> dict[str, Any]:
    """The batch a submission answered, once a worker checked its lines (as the worker process does first)."""
    assert response.status_code == 200, response.text
    check_lines(runtime, response.json()["id"])
    return dict(api.get(f"/v1/batches/{response.json()['id']}").json())


def read_jsonl(response: httpx.Response) -> list[dict[str, Any]]:
    """A JSONL response's lines."""
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


def test_a_multipart_upload_is_queued_with_its_request_counts(runtime: Runtime, client: ApiClient, tiny_model: Path,
                                                              redis_url: str) -> None:
    api = client(runtime, new_key(runtime))

    response = upload(api, tiny_model, [request_line("a"), request_line("b")], metadata='{"team": "docs"}')

    assert response.status_code == 200, response.text
    job = response.json()
    assert job["id"].startswith("batch_")
    assert job["object"] == "batch" and job["status"] == "validating"
    assert job["request_counts"] == {"total": 0, "completed": 0, "failed": 0}  # its lines are not checked yet
    job = checked(api, runtime, response)
    assert job["status"] == "validating" and job["request_counts"] == {"total": 2, "completed": 0, "failed": 0}
    assert job["input_file_id"].startswith("file-") and job["input_filename"] == "batch.jsonl"
    assert job["metadata"] == {"team": "docs"}
    # and the upload is kept as the batch's input file, readable through the Files API
    assert api.get(f"/v1/files/{job['input_file_id']}/content").content == jsonl([request_line("a"), request_line("b")])
    assert job["completion_window"] == "24h" and job["errors"] is None
    assert redis.Redis.from_url(redis_url).llen("celery") >= 1  # process_job waits in the real broker
    assert api.get(f"/v1/batches/{job['id']}").json()["status"] == "validating"


def test_a_json_body_is_queued_with_its_request_counts(runtime: Runtime, client: ApiClient, tiny_model: Path) -> None:
    api = client(runtime, new_key(runtime))
    body = {"model": str(tiny_model), "completion_window": "2h", "metadata": {"run": "7"},
            "requests": [request_line("a", model=str(tiny_model)), request_line("b"), request_line("c")]}

    response = api.post("/v1/batches", json=body)

    job = checked(api, runtime, response)
    assert job["status"] == "validating" and job["request_counts"]["total"] == 3
    assert job["completion_window"] == "2h" and job["metadata"] == {"run": "7"}
    assert [j["id"] for j in api.get("/v1/batches").json()["data"]] == [job["id"]]


@pytest.mark.parametrize("window", ["infh", "nanh", "1e300h", "99999999999h", "169h", "0s", "-1h", "24 hours", ""])
def test_a_completion_window_that_is_not_a_bounded_duration_is_a_400_and_creates_no_job(
        runtime: Runtime, client: ApiClient, tiny_model: Path, window: str) -> None:
    api = client(runtime, new_key(runtime))
    body = {"model": str(tiny_model), "completion_window": window, "requests": [request_line("a")]}

    response = api.post("/v1/batches", json=body)

    assert response.status_code == 400, response.text
    assert "completion window" in response.json()["error"]["message"]
    assert api.get("/v1/batches").json()["data"] == []


# ---- metadata: the user's alone, in OpenAI's shape ---------------------------------------------------------------
def json_body(model: Path, metadata: object) -> dict[str, Any]:
    """A JSON body of one request with this metadata."""
    return {"model": str(model), "metadata": metadata, "requests": [request_line("a")]}


@pytest.mark.parametrize("metadata", [
    {f"k{i}": "v" for i in range(17)},
    {"k" * 65: "v"},
    {"note": "v" * 513},
    {"summarize": 1},
    {"summarize": {"prompt": "{document}"}, "output": "/tmp/x"},
    {"tags": ["a", "b"]},
    {"note": None},
    ["a", "b"],
], ids=["17 pairs", "key of 65", "value of 513", "number", "object", "list value", "null value", "not an object"])
@pytest.mark.parametrize("form", ["json", "multipart"])
def test_metadata_beyond_openais_shape_is_a_400_in_one_line_and_creates_no_job(
        runtime: Runtime, client: ApiClient, tiny_model: Path, metadata: object, form: str) -> None:
    api = client(runtime, new_key(runtime))

    response = (api.post("/v1/batches", json=json_body(tiny_model, metadata)) if form == "json" else
                upload(api, tiny_model, [request_line("a")], metadata=json.dumps(metadata)))

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "InvalidJob" and "metadata" in error["message"] and "\n" not in error["message"]
    assert api.get("/v1/batches").json()["data"] == []


def test_metadata_at_openais_limits_is_kept_as_given(runtime: Runtime, client: ApiClient, tiny_model: Path) -> None:
    api = client(runtime, new_key(runtime))
    metadata = {"k" * 64: "v" * 512, **{f"k{i}": f"v{i}" for i in range(15)}}

    response = api.post("/v1/batches", json=json_body(tiny_model, metadata))

    assert response.status_code == 200, response.text
    assert response.json()["metadata"] == metadata and response.json()["summary"] is None


def test_a_batch_whose_metadata_names_the_services_own_keys_is_an_ordinary_batch(
        any_store_runtime: Runtime, client: ApiClient, tiny_model: Path, tmp_path: Path) -> None:
    # Given a batch whose metadata holds every key a summary job once kept there, pointing at a folder of the caller's
    runtime = any_store_runtime
    api = client(runtime, new_key(runtime))
    target = tmp_path / "written-by-a-key-holder"
    metadata = {"summarize": '{"prompt": "{document}"}', "schedule": "nightly", "period": "p", "model_id": "m",
                "output": str(target), "template_sha": "t", "documents": "[]", "skipped": "3", "outputs_written": ""}
    job = checked(api, runtime, api.post("/v1/batches", json={**json_body(tiny_model, metadata),
                                                              "requests": [request_line("a"), request_line("b")]}))
    assert job["metadata"] == metadata and job["summary"] is None
    # When a worker finishes its requests and a sweep comes by
    finish(runtime, job["id"], {0: (RequestStatus.completed, [5, 6]), 1: (RequestStatus.completed, [7])})
    assert sweep_store(runtime) == []
    # Then the job completed like any batch, no file was written, and the metadata is shown back as it was
    finished = api.get(f"/v1/batches/{job['id']}").json()
    assert finished["status"] == "completed" and finished["metadata"] == metadata and finished["summary"] is None
    assert not target.exists()
    assert "skipped" not in describe_job(finished)
    # And a later sweep still returns normally
    assert sweep_store(runtime) == []


def test_bad_lines_are_reported_while_the_good_ones_are_queued(runtime: Runtime, client: ApiClient,
                                                               tiny_model: Path) -> None:
    api = client(runtime, new_key(runtime))
    lines = [request_line("good-1"), "{not json", {**request_line("get"), "method": "GET"}, request_line("good-1"),
             request_line("good-2")]

    response = upload(api, tiny_model, lines)

    job = checked(api, runtime, response)
    assert job["request_counts"]["total"] == 2
    expected = [(2, "invalid_json"), (3, "invalid_method"), (4, "duplicate_custom_id")]
    assert [(e["line"], e["code"]) for e in job["errors"]["data"]] == expected
    errors = api.get(f"/v1/batches/{job['id']}/errors")
    assert errors.status_code == 200 and errors.headers["content-type"].startswith("application/jsonl")
    assert [(e["error"]["line"], e["error"]["code"]) for e in read_jsonl(errors)] == expected


def test_a_file_without_a_good_line_is_created_and_then_fails_with_each_line_error(runtime: Runtime, client: ApiClient,
                                                                                   tiny_model: Path) -> None:
    # Given a file whose every line is bad
    api = client(runtime, new_key(runtime))

    # When it is submitted, then a worker checks its lines
    response = upload(api, tiny_model, ["{not json", {**request_line("x"), "url": "/v1/audio/speech"}])
    job = checked(api, runtime, response)

    # Then the submission was created (OpenAI's batches.create), and the batch failed with each line's error
    assert response.json()["status"] == "validating"
    assert job["status"] == "failed" and job["failed_at"] is not None and job["in_progress_at"] is None
    assert job["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert [(e["line"], e["code"]) for e in job["errors"]["data"]] == [(1, "invalid_json"), (2, "invalid_url")]
    assert all("\n" not in e["message"] for e in job["errors"]["data"])
    # and its error file holds the same lines, as OpenAI's does
    errors = read_jsonl(api.get(f"/v1/files/{job['error_file_id']}/content"))
    assert [(e["error"]["line"], e["error"]["code"]) for e in errors] == [(1, "invalid_json"), (2, "invalid_url")]
    assert job["output_file_id"] is None


def test_a_malformed_body_is_refused_with_what_is_missing(runtime: Runtime, client: ApiClient) -> None:
    api = client(runtime, new_key(runtime))

    no_model = api.post("/v1/batches", files={"file": ("b.jsonl", jsonl([request_line("a")]))})
    no_requests = api.post("/v1/batches", json={"model": "m"})

    assert no_model.status_code == 400 and "model" in no_model.json()["error"]["message"]
    assert no_requests.status_code == 400 and "requests" in no_requests.json()["error"]["message"]


def test_requests_without_a_valid_key_are_refused_with_a_hint(runtime: Runtime, client: ApiClient) -> None:
    anonymous, stranger = client(runtime), client(runtime, "sb-not-a-key")

    missing = anonymous.get("/v1/batches")
    unknown = stranger.get("/v1/batches")

    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert "swarmbatch keys create NAME" in missing.json()["error"]["message"]
    assert unknown.status_code == 401 and "unknown API key" in unknown.json()["error"]["message"]
    assert anonymous.post("/v1/batches", json={"model": "m", "requests": []}).status_code == 401
    assert anonymous.post("/v1/batches", content=b"{not json", headers={"content-type": "application/json"}
                          ).status_code == 401  # refused before the body is read


def test_another_key_can_neither_see_nor_touch_a_job(any_store_runtime: Runtime, client: ApiClient,
                                                     tiny_model: Path) -> None:
    # Given a job submitted with the owner's key
    owner = client(any_store_runtime, new_key(any_store_runtime, "owner"))
    other = client(any_store_runtime, new_key(any_store_runtime, "other"))
    job_id = upload(owner, tiny_model, [request_line("a")]).json()["id"]

    # When the other key asks for it, Then it does not exist for that key
    for response in (other.get(f"/v1/batches/{job_id}"), other.get(f"/v1/batches/{job_id}/results"),
                     other.get(f"/v1/batches/{job_id}/errors"), other.post(f"/v1/batches/{job_id}/cancel")):
        assert response.status_code == 404, response.text
        assert response.json()["error"]["type"] == "JobNotFound"
    assert other.get("/v1/batches").json() == {"object": "list", "data": [], "first_id": None, "last_id": None,
                                               "has_more": False}
    # and the owner's job was not cancelled
    assert owner.get(f"/v1/batches/{job_id}").json()["status"] == "validating"
    assert [j["id"] for j in owner.get("/v1/batches").json()["data"]] == [job_id]


def test_jobs_are_listed_newest_first_up_to_the_limit(runtime: Runtime, client: ApiClient, tiny_model: Path) -> None:
    api = client(runtime, new_key(runtime))
    ids = [upload(api, tiny_model, [request_line("a")]).json()["id"] for _ in range(3)]

    listed = api.get("/v1/batches", params={"limit": 2}).json()

    assert listed["object"] == "list" and [j["id"] for j in listed["data"]] == ids[::-1][:2]
    assert listed["has_more"] is True and (listed["first_id"], listed["last_id"]) == (ids[2], ids[1])
    rest = api.get("/v1/batches", params={"limit": 2, "after": listed["last_id"]}).json()
    assert [j["id"] for j in rest["data"]] == [ids[0]] and rest["has_more"] is False
    for limit in (0, 101):
        refused = api.get("/v1/batches", params={"limit": limit})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "limit"


def finish(runtime: Runtime, job_id: str, outcomes: dict[int, tuple[RequestStatus, list[int]]]) -> None:
    """As a worker would: check the job's lines, claim the first requests, then finish them (in reverse order) with
    these outcomes."""
    ingest.check_lines(runtime, job_id)  # a no-op once they are checked
    with runtime.session() as session:
        token, rows = store.claim_requests(session=session, job_id=job_id, worker="test", limit=len(outcomes),
                                           lease_seconds=60, max_attempts=5)
        for row in sorted(rows, key=lambda r: -r.index):
            status, generated = outcomes[row.index]
            assert store.finish_request(session=session, request_id=row.id, token=token, status=status,
                                        generated=generated, finish_reason="length", output_text=f"out {row.index}",
                                        error="swarm gave up" if status == RequestStatus.failed else None)
        session.commit()


def test_cancelling_keeps_the_completed_outputs_in_input_order(runtime: Runtime, client: ApiClient,
                                                               tiny_model: Path) -> None:
    # Given a job of four requests: 0 and 2 completed, 1 failed, 3 still pending
    api = client(runtime, new_key(runtime))
    job_id = upload(api, tiny_model, [request_line(f"r{i}", prompt=f"Hi {i}") for i in range(4)]).json()["id"]
    finish(runtime, job_id, {0: (RequestStatus.completed, [5, 6]), 1: (RequestStatus.failed, []),
                             2: (RequestStatus.completed, [7, 8, 9])})
    partial = read_jsonl(api.get(f"/v1/batches/{job_id}/results"))

    # When it is cancelled (no request is running)
    cancelled = api.post(f"/v1/batches/{job_id}/cancel")

    # Then it is cancelled at once and the finished outputs stay, in input order, in the OpenAI line shape
    assert cancelled.status_code == 200, cancelled.text
    job = cancelled.json()
    assert job["status"] == "cancelled" and job["cancelled_at"] is not None
    assert job["request_counts"] == {"total": 4, "completed": 2, "failed": 1}
    results = api.get(f"/v1/batches/{job_id}/results")
    assert results.headers["content-type"].startswith("application/jsonl")
    lines = read_jsonl(results)
    assert lines == partial
    assert [line["custom_id"] for line in lines] == ["r0", "r2"]
    first = lines[0]
    assert set(first) == {"id", "custom_id", "response", "error"} and first["error"] is None
    assert first["response"]["status_code"] == 200
    body = first["response"]["body"]
    assert body["object"] == "text_completion" and body["model"] == str(tiny_model)
    assert body["choices"][0]["text"] == "out 0" and body["usage"]["completion_tokens"] == 2
    failed = read_jsonl(api.get(f"/v1/batches/{job_id}/errors"))
    assert [(e["custom_id"], e["error"]["code"], e["error"]["message"]) for e in failed] == \
        [("r1", "request_failed", "swarm gave up"),
         ("r3", "batch_cancelled", "the batch was cancelled before this request ran")]
    assert api.get(f"/v1/batches/{job_id}").json()["status"] == "cancelled"


def test_healthz_answers_ok_when_the_database_is_migrated(runtime: Runtime, client: ApiClient) -> None:
    response = client(runtime).get("/healthz")

    assert response.status_code == 200 and response.json() == {"status": "ok"}


@pytest.mark.parametrize("path", ["/healthz", "/metrics"])
def test_health_and_metrics_answer_503_when_the_database_is_not_migrated(tmp_path: Path, client: ApiClient,
                                                                          path: str) -> None:
    bare = build_runtime(Settings(home=tmp_path / "bare", database_url=f"sqlite:///{tmp_path / 'empty.sqlite'}"))
    try:
        response = client(bare).get(path)
    finally:
        bare.close()

    assert response.status_code == 503
    error = response.json()["error"]
    assert error["type"] == "StoreUnavailable" and "swarmbatch db upgrade" in error["message"]


def test_metrics_count_jobs_requests_and_generated_tokens(any_store_runtime: Runtime, client: ApiClient,
                                                          tiny_model: Path) -> None:
    # Given one validating job with one completed request (3 tokens) and one pending
    api = client(any_store_runtime, new_key(any_store_runtime))
    job_id = upload(api, tiny_model, [request_line("a"), request_line("b")]).json()["id"]
    finish(any_store_runtime, job_id, {0: (RequestStatus.completed, [1, 2, 3])})

    # When Prometheus scrapes, without a key
    response = client(any_store_runtime).get("/metrics")

    # Then the numbers match the rows
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in response.text.splitlines() if line and not line.startswith("#")}
    assert samples['swarmbatch_jobs{status="validating"}'] == 1.0
    assert samples['swarmbatch_jobs{status="completed"}'] == 0.0
    assert samples['swarmbatch_requests{status="completed"}'] == 1.0
    assert samples['swarmbatch_requests{status="pending"}'] == 1.0
    assert samples["swarmbatch_tokens_generated_total"] == 3.0


def test_the_openapi_docs_describe_the_routes(runtime: Runtime, client: ApiClient) -> None:
    api = client(runtime)

    docs = api.get("/docs")
    schema = api.get("/openapi.json").json()

    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    assert {"/v1/batches", "/v1/batches/{job_id}", "/v1/batches/{job_id}/results", "/v1/batches/{job_id}/errors",
            "/v1/batches/{job_id}/cancel", "/healthz", "/metrics"} <= set(schema["paths"])
    body = schema["paths"]["/v1/batches"]["post"]["requestBody"]["content"]
    assert {"multipart/form-data", "application/json"} <= set(body)


# ---- the operator's guards: the models a key may name, the metrics token ----------------------------------------
def test_a_model_the_operator_does_not_list_is_refused_alike_whether_its_path_exists_or_not(
        runtime: Runtime, client: ApiClient, tiny_model: Path, tmp_path: Path) -> None:
    # Given a server path that holds no model yet, and an API that serves only the tiny model
    api = client(runtime, new_key(runtime))
    elsewhere = tmp_path / "elsewhere" / "model"
    body = {"model": str(elsewhere), "requests": [request_line("a", model=str(elsewhere))]}

    # When a key names it before and after a real model is copied there
    missing = api.post("/v1/batches", json=body)
    shutil.copytree(tiny_model, elsewhere)
    existing = api.post("/v1/batches", json=body)

    # Then both answers are the same 400, byte for byte, and nothing was created
    assert missing.status_code == existing.status_code == 400
    assert missing.content == existing.content
    assert missing.json() == {"error": {"type": "InvalidJob", "code": "invalid_job", "param": None,
                                        "message": f"model {str(elsewhere)!r} is not served "
                                        "here; list the models with GET /v1/models, or ask the operator "
                                        "(SWARMBATCH_API_MODELS, SWARMBATCH_MODEL_ALIASES)"}}
    assert api.get("/v1/batches").json()["data"] == []


def test_the_api_serves_smollm2_alone_unless_the_operator_lists_models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWARMBATCH_API_MODELS", raising=False)
    assert Settings().api_models == ["smollm2"]
    monkeypatch.setenv("SWARMBATCH_API_MODELS", "smollm2, /models/my model ,,/models/tiny")
    assert Settings().api_models == ["smollm2", "/models/my model", "/models/tiny"]
    monkeypatch.setenv("SWARMBATCH_API_MODELS", "")
    assert Settings().api_models == ["smollm2"]


def test_metrics_need_the_operators_token_when_one_is_set(make_runtime: Callable[..., Runtime], client: ApiClient,
                                                          redis_url: str) -> None:
    runtime = make_runtime(broker_url=redis_url, metrics_token="scrape-me")
    api_key = new_key(runtime)

    anonymous = client(runtime).get("/metrics")
    wrong = client(runtime, "scrape-you").get("/metrics")
    with_an_api_key = client(runtime, api_key).get("/metrics")
    right = client(runtime, "scrape-me").get("/metrics")

    for refused in (anonymous, wrong, with_an_api_key):
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert "SWARMBATCH_METRICS_TOKEN" in refused.json()["error"]["message"] and "scrape-me" not in refused.text
    assert right.status_code == 200 and 'swarmbatch_jobs{status="validating"} 0.0' in right.text
    assert client(runtime).get("/healthz").status_code == 200  # health stays open to the orchestrator


def test_a_burst_of_scrapes_reads_the_store_once_per_cache_period(make_runtime: Callable[..., Runtime], client: ApiClient,
                                                                  redis_url: str, tiny_model: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Given metrics cached for 5 s (by the jobs clock, which the test moves) and one scrape at t0
    t0 = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
    now = [t0]
    monkeypatch.setattr(clock, "now", lambda: now[0])
    runtime = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)], metrics_cache_seconds=5)
    scraper = client(runtime)
    assert 'swarmbatch_jobs{status="validating"} 0.0' in scraper.get("/metrics").text
    # When a job is queued, Then scrapes within the 5 s show the first read, and the first one after shows the job
    upload(client(runtime, new_key(runtime)), tiny_model, [request_line("a")])
    now[0] = t0 + timedelta(seconds=4.9)
    assert 'swarmbatch_jobs{status="validating"} 0.0' in scraper.get("/metrics").text
    now[0] = t0 + timedelta(seconds=5)
    assert 'swarmbatch_jobs{status="validating"} 1.0' in scraper.get("/metrics").text


# ---- bounded inputs: body size, prompt length, concurrent submissions -------------------------------------------------
def raw_request(api: httpx.Client, key: str, headers: dict[str, str]) -> socket.socket:
    """A socket that has sent the head of POST /v1/batches (and nothing of its body)."""
    sock = socket.create_connection((api.base_url.host, api.base_url.port), timeout=10)
    lines = ["POST /v1/batches HTTP/1.1", f"Host: {api.base_url.host}", f"Authorization: Bearer {key}",
             *(f"{name}: {value}" for name, value in headers.items())]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of a response the server ends by closing the connection."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:  # the server dropped a body it did not read: what it sent first is still here
        pass
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, body


def test_a_body_declared_over_the_limit_gets_413_before_it_is_sent(runtime: Runtime, client: ApiClient) -> None:
    # Given a client that declares a 250 MB multipart upload (the limit is 200 MiB) and sends none of it
    key = new_key(runtime)
    api = client(runtime, key)
    started = time.monotonic()
    with raw_request(api, key, {"Content-Type": "multipart/form-data; boundary=b", "Content-Length": "250000000"}
                     ) as sock:
        # When it waits for an answer
        status, headers, body = read_response(sock)
    elapsed = time.monotonic() - started

    # Then the 413 comes at once, without the body (the client never sent it), and closes the connection
    assert status == 413 and elapsed < 1.0, (status, elapsed)
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["type"] == "RequestTooLarge" and "250000000 bytes" in error["message"]
    assert "SWARMBATCH_MAX_FILE_BYTES" in error["message"] and "\n" not in error["message"]
    assert api.get("/v1/batches").json()["data"] == []


def test_a_chunked_upload_is_refused_as_soon_as_it_passes_the_limit_and_no_more_is_read(
        make_runtime: Callable[..., Runtime], redis_url: str, client: ApiClient, tiny_model: Path) -> None:
    # Given a server taking files up to 1000 bytes, one submission at a time, and a chunked multipart upload (no
    # Content-Length) of 64 MB
    runtime = make_runtime(broker_url=redis_url, max_file_bytes=1000, max_concurrent_submissions=1,
                           api_models=[str(tiny_model)])
    key = new_key(runtime)
    api = client(runtime, key)
    form = (f'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\n{tiny_model}\r\n--b\r\n'
            'Content-Disposition: form-data; name="file"; filename="b.jsonl"\r\n\r\n').encode()
    line = json.dumps(request_line("a")).encode() + b"\n"
    chunk = line * (16384 // len(line))
    total = 64 * 1024 * 1024
    sent, answered = 0, False
    with raw_request(api, key, {"Content-Type": "multipart/form-data; boundary=b",
                                "Transfer-Encoding": "chunked"}) as sock:
        # When it streams the chunks, and goes on after the server answers
        with pytest.raises(OSError):  # Then the server stops reading: a closed connection refuses the next sends
            for piece in [form, *[chunk] * (total // len(chunk))]:
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
                answered = answered or bool(select.select([sock], [], [], 0)[0])
                time.sleep(0.001 if answered else 0)  # let the reset come back before the kernel's buffers fill
        # (a server draining the body would have taken all of it); and its answer, sent before it closed, is a 413
        status, headers, body = read_response(sock)
    assert status == 413, body
    assert sent < total
    assert json.loads(body)["error"]["type"] == "RequestTooLarge" and headers["connection"] == "close"
    assert api.get("/v1/batches").json()["data"] == []
    # and the refused upload gave its submission slot back
    assert upload(api, tiny_model, [request_line("a")]).status_code == 200


def test_a_ten_megabyte_prompt_is_refused_by_its_length_without_being_tokenized(runtime: Runtime, client: ApiClient,
                                                                                 tiny_model: Path) -> None:
    # Given a file with a good line and a one-line 10 MB prompt (about 10 s and 1.6 GB to tokenize)
    api = client(runtime, new_key(runtime))
    huge = "The city council voted. " * 420_000

    started = time.monotonic()
    response = upload(api, tiny_model, [request_line("good"), request_line("huge", prompt=huge)])
    job = checked(api, runtime, response)
    elapsed = time.monotonic() - started

    # Then the huge line is a context_length_exceeded line error counted in characters (so never tokenized)
    assert job["request_counts"]["total"] == 1
    [error] = job["errors"]["data"]
    assert (error["line"], error["code"]) == (2, "context_length_exceeded")
    assert f"the prompt is {len(huge)} characters" in error["message"]
    print(f"10 MB prompt refused in {elapsed:.2f} s (upload, store and check included)")


def slow_submission_holding_the_slot(api: httpx.Client, key: str, body: bytes) -> socket.socket:
    """A submission that has sent half of `body` and holds its key's one submission slot: a probe of the same key
    gets 429 (a free slot answers the probe's broken body 400). A probe takes the slot for an instant, so a slow
    submission that arrived then was refused (it has its answer already): it is replaced by another."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        slow = raw_request(api, key, {"Content-Type": "application/json", "Content-Length": str(len(body)),
                                      "Connection": "close"})
        slow.sendall(body[:len(body) // 2])
        while time.monotonic() < deadline and not select.select([slow], [], [], 0.2)[0]:
            if api.post("/v1/batches", content=b"{", headers={"content-type": "application/json"}).status_code == 429:
                return slow
        slow.close()
    raise AssertionError("the slow submission never took the slot")


def test_a_keys_submissions_over_its_bound_get_429_with_retry_after_and_another_keys_go_through(
        runtime: Runtime, client: ApiClient, tiny_model: Path) -> None:
    # Given alice's submission whose client has sent half its body (one submission per key: the default)
    alice, bob = new_key(runtime, "alice"), new_key(runtime, "bob")
    api, other = client(runtime, alice), client(runtime, bob)
    body = json.dumps({"model": str(tiny_model), "requests": [request_line("slow")]}).encode()
    batch = {"model": str(tiny_model), "requests": [request_line("a")]}
    with slow_submission_holding_the_slot(api, alice, body) as slow:
        # When alice submits another, and bob one
        refused = api.post("/v1/batches", json=batch)
        bobs = other.post("/v1/batches", json=batch)

        # Then alice's is refused at once with when to retry, and bob's is stored
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "5"
        error = refused.json()["error"]
        assert error["type"] == "TooManySubmissions" and "SWARMBATCH_MAX_SUBMISSIONS_PER_KEY" in error["message"]
        assert bobs.status_code == 200, bobs.text
        # and the busy one completes, giving its slot back
        slow.sendall(body[len(body) // 2:])
        status, _, slow_job = read_response(slow)
        assert status == 200, slow_job
    assert api.post("/v1/batches", json=batch).status_code == 200
    assert len(api.get("/v1/batches").json()["data"]) == 2


# ---- enqueue failures and idempotency keys ---------------------------------------------------------------------------
def test_a_job_whose_enqueue_fails_after_commit_is_returned_once_and_the_sweep_dispatches_it(
        make_runtime: Callable[..., Runtime], redis_url: str, client: ApiClient, tiny_model: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # Given an API whose broker is down (nothing listens on its port)
    down = make_runtime(broker_url=f"redis://127.0.0.1:{free_port()}/0", api_models=[str(tiny_model)])
    api = client(down, new_key(down))

    # When a batch is submitted
    with caplog.at_level(logging.WARNING, logger="jobs.submission"):
        response = upload(api, tiny_model, [request_line("a")])

    # Then the stored job is returned, once, with one line saying why its work waits
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["status"] == "validating" and [j["id"] for j in api.get("/v1/batches").json()["data"]] == [job["id"]]
    [record] = [r for r in caplog.records if job["id"] in r.getMessage()]
    assert "sweep" in record.getMessage() and "\n" not in record.getMessage()
    # and a worker's sweep, with a working broker, dispatches it
    up = make_runtime(database_url=down.settings.resolved_database_url, broker_url=redis_url)
    assert sweep_store(up) == [job["id"]]


def test_the_same_idempotency_key_returns_the_first_job(any_store_runtime: Runtime, client: ApiClient,
                                                        tiny_model: Path) -> None:
    owner = client(any_store_runtime, new_key(any_store_runtime, "owner"))
    other = client(any_store_runtime, new_key(any_store_runtime, "other"))
    lines = [request_line("a"), request_line("b")]

    def submit(api: httpx.Client, key: str, batch: list[Any] = lines) -> httpx.Response:
        return api.post("/v1/batches", files={"file": ("batch.jsonl", jsonl(batch), "application/jsonl")},
                        data={"model": str(tiny_model)}, headers={"Idempotency-Key": key})

    # Given a job submitted under a key
    first = submit(owner, "nightly-1")
    assert first.status_code == 200 and "idempotent-replayed" not in first.headers

    # When the same batch is sent again under the same key, Then the first job comes back, and no other is made
    again = submit(owner, "nightly-1")
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    assert again.headers["idempotent-replayed"] == "true"
    # a new key makes a new job; another API key's same header is its own job
    second = submit(owner, "nightly-2")
    theirs = submit(other, "nightly-1")
    assert len({first.json()["id"], second.json()["id"], theirs.json()["id"]}) == 3
    # the same key with another batch is a conflict, and the first job stays
    conflict = submit(owner, "nightly-1", [request_line("c")])
    assert conflict.status_code == 409 and conflict.json()["error"]["type"] == "IdempotencyConflict"
    assert first.json()["id"] in conflict.json()["error"]["message"]
    assert {j["id"] for j in owner.get("/v1/batches").json()["data"]} == {first.json()["id"], second.json()["id"]}
    assert [j["id"] for j in other.get("/v1/batches").json()["data"]] == [theirs.json()["id"]]
    assert submit(owner, "k" * 256).status_code == 400


def test_concurrent_submissions_under_one_idempotency_key_make_one_job(any_store_runtime: Runtime, client: ApiClient,
                                                                       tiny_model: Path) -> None:
    # two submissions of one key at once (the default is one per key: the second would be a 429)
    any_store_runtime.settings = any_store_runtime.settings.model_copy(update={"max_submissions_per_key": 2})
    api = client(any_store_runtime, new_key(any_store_runtime))
    batch = {"model": str(tiny_model), "requests": [request_line(f"r{i}") for i in range(50)]}

    with ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(lambda _: api.post("/v1/batches", json=batch, headers={"Idempotency-Key": "k"}),
                                  range(2)))

    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    assert len({r.json()["id"] for r in responses}) == 1
    assert len(api.get("/v1/batches").json()["data"]) == 1


@pytest.mark.parametrize("filename", ["batch\nFORGED LINE: API key 1 (alice) revoked.jsonl", "b" * 256 + ".jsonl"])
def test_an_upload_whose_name_forges_a_log_line_or_runs_long_is_a_400_and_stores_nothing(
        runtime: Runtime, client: ApiClient, filename: str, caplog: pytest.LogCaptureFixture) -> None:
    api = client(runtime, new_key(runtime))
    # the multipart body written by hand: clients escape a line break in a file name, an attacker's does not
    boundary = "b0und4ry"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
            f'Content-Type: application/jsonl\r\n\r\n{{"custom_id": "a"}}\n\r\n--{boundary}--\r\n').encode()
    with caplog.at_level(logging.INFO, logger="jobs"):
        answer = api.post("/v1/files", content=body,
                          headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "file", answer.text
    assert "rename the file" in answer.json()["error"]["message"]
    assert api.get("/v1/files").json()["data"] == []
    assert not any(line.startswith("FORGED LINE") for record in caplog.records for line in record.getMessage().splitlines())
