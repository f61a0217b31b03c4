"""File reads stay consistent when the file is deleted under them (issue 28, N16), on PostgreSQL (READ COMMITTED,
where a delete commits between two reads of one download): a download ends incomplete, never as a short answer
that looks whole; a batch whose input file goes while its lines are checked fails with one error saying so.

A real uvicorn serving the app over a real PostgreSQL store and Redis broker; the ingest is the worker's own code
(jobs.ingest.check_lines), run in a thread.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from factories import new_key
from jobs_support import ApiClient, complete_every_request
from sqlalchemy import text

from jobs import files, ingest, retention
from jobs.api.slots import CUT_SHORT_LOG
from jobs.models import StoredFile, utcnow
from jobs.runtime import Runtime
from jobs.worker.sweep import sweep_store

FILE_CHUNKS = 6  # chunks of the downloaded file (jobs.files.CHUNK_BYTES each), and a short last one


@pytest.fixture
def runtime(make_runtime: Callable[..., Runtime], postgres_url: str, redis_url: str, tiny_model: Path) -> Runtime:
    """PostgreSQL store, Redis broker; the API serves the tiny model."""
    return make_runtime(database_url=postgres_url, broker_url=redis_url, api_models=[str(tiny_model)])


def upload(api: httpx.Client, data: bytes) -> str:
    uploaded = api.post("/v1/files", files={"file": ("f.jsonl", data)}, data={"purpose": "batch"})
    assert uploaded.status_code == 200, uploaded.text
    return str(uploaded.json()["id"])


def test_a_download_of_a_file_deleted_while_it_streams_ends_incomplete_never_as_a_short_whole_answer(
        runtime: Runtime, client: ApiClient, caplog: pytest.LogCaptureFixture) -> None:
    # Given a file of 6 chunks and a bit, and a download of it by a client with a 64 KiB receive buffer (the server
    # cannot run far ahead of it)
    key = new_key(runtime)
    api = client(runtime, key)
    data = bytes(range(256)) * (FILE_CHUNKS * files.CHUNK_BYTES // 256) + b"and the last few bytes"
    file_id = upload(api, data)
    small_buffer = httpx.HTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)])
    received = bytearray()
    with httpx.Client(base_url=api.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30,
                      transport=small_buffer) as downloader:
        with downloader.stream("GET", f"/v1/files/{file_id}/content") as response:
            assert response.status_code == 200
            pieces = response.iter_raw()
            while len(received) < 64 * 1024:  # the first piece is read
                received += next(pieces)

            # When its owner deletes the file through the API
            deleted = api.delete(f"/v1/files/{file_id}")
            assert deleted.status_code == 200, deleted.text

            # Then the download does not end as if it were whole: the connection breaks off short of the file
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                for piece in pieces:
                    received += piece
    assert len(received) < len(data) and data.startswith(received), len(received)
    # and the API says so in one line, with no error of its own
    [cut] = [r for r in caplog.records if r.msg == CUT_SHORT_LOG]
    assert cut.getMessage() == (f"GET '/v1/files/{file_id}/content': what the answer streams went while it was sent "
                                f"(FileNotFound); connection aborted, the answer cut short")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    # and the file is gone, its bytes too
    assert api.get(f"/v1/files/{file_id}/content").status_code == 404
    with runtime.session() as session:
        assert session.execute(text("SELECT count(*) FROM file_chunks WHERE file_id = :id"),
                               {"id": file_id}).scalar_one() == 0


def read_short_of_the_end(api: httpx.Client, key: str, path: str, delete: str) -> bytes:
    """Stream `path` through a 64 KiB receive buffer (the server cannot run far ahead), DELETE `delete` once 64 KiB
    came, then read on: what came, once the connection broke off (a whole answer fails the test)."""
    small_buffer = httpx.HTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)])
    received = bytearray()
    with httpx.Client(base_url=api.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30,
                      transport=small_buffer) as downloader:
        with downloader.stream("GET", path) as response:
            assert response.status_code == 200
            pieces = response.iter_raw()
            while len(received) < 64 * 1024:
                received += next(pieces)
            deleted = api.delete(delete)
            assert deleted.status_code == 200, deleted.text
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                for piece in pieces:
                    received += piece
    return bytes(received)


@pytest.mark.parametrize("via", ["results", "output file"])
def test_results_whose_output_file_is_deleted_while_they_stream_end_incomplete_never_with_emptied_lines(
        runtime: Runtime, client: ApiClient, via: str) -> None:
    # Given a completed batch of 1000 requests, each with 8 KB of output (5 pages of the store's reads)
    key = new_key(runtime)
    api = client(runtime, key)
    lines = [{"custom_id": f"r{n}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "Hi", "max_tokens": 4}} for n in range(1000)]
    job_id = api.post("/v1/batches", json={"model": str(runtime.settings.api_models[0]), "requests": lines}).json()["id"]
    complete_every_request(runtime, job_id, output=lambda index: f"{index:08d}" * 1000)
    sweep_store(runtime)  # the job is settled: its output file is made
    job = api.get(f"/v1/batches/{job_id}").json()
    assert job["status"] == "completed" and job["output_file_id"], job
    path = {"results": f"/v1/batches/{job_id}/results", "output file": f"/v1/files/{job['output_file_id']}/content"}

    # When its results stream, and its output file is deleted through the API meanwhile
    received = read_short_of_the_end(api, key, path[via], delete=f"/v1/files/{job['output_file_id']}")

    # Then the answer breaks off: every line that came whole holds its output, none came emptied
    whole = received[:received.rfind(b"\n") + 1].decode().splitlines()
    assert 0 < len(whole) < 1000
    for line in whole:
        result = json.loads(line)
        index = int(result["custom_id"][1:])
        assert result["response"]["body"]["choices"][0]["text"] == f"{index:08d}" * 1000, result["custom_id"]
    assert api.get(f"/v1/batches/{job_id}/results").status_code == 410


def request_line(number: int) -> str:
    return json.dumps({"custom_id": f"req-{number}", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": f"Request number {number} says that the council met " * 8,
                                "max_tokens": 4}})


def batch_from_file(api: httpx.Client, data: bytes) -> tuple[str, str]:
    """Upload `data` and create a batch from it; returns (batch id, file id)."""
    file_id = upload(api, data)
    created = api.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                            "completion_window": "24h"})
    assert created.status_code == 200, created.text
    return str(created.json()["id"]), file_id


def checking_in_a_thread(runtime: Runtime, job_id: str) -> tuple[threading.Thread, list[BaseException]]:
    """The worker's check of the job's lines, slice after slice, in a thread; what it raised, if anything."""
    raised: list[BaseException] = []

    def check() -> None:
        try:
            while ingest.check_lines(runtime, job_id, lines_per_commit=200).more:
                pass
        except BaseException as e:  # noqa: BLE001 - the test reports it
            raised.append(e)

    thread = threading.Thread(target=check, name=f"ingest-{job_id}", daemon=True)
    thread.start()
    return thread, raised


def assert_failed_with_one_error_saying_the_file_was_deleted(api: httpx.Client, job_id: str, file_id: str) -> None:
    job = api.get(f"/v1/batches/{job_id}").json()
    assert job["status"] == "failed", job
    [error] = job["errors"]["data"]
    assert error["code"] == "file_not_found" and file_id in error["message"], error
    assert "upload it again and create a new batch" in error["message"] and "\n" not in error["message"]
    assert job["request_counts"]["total"] == 0, job["request_counts"]


def test_a_batch_whose_input_file_is_deleted_while_its_lines_are_checked_fails_with_one_error(
        runtime: Runtime, client: ApiClient) -> None:
    # Given a batch made from a file of 8 chunks, whose lines a worker is checking (some are stored already)
    api = client(runtime, new_key(runtime))
    data = "".join(request_line(n) + "\n" for n in range(1, 18_000)).encode()
    assert len(data) > 8 * files.CHUNK_BYTES
    job_id, file_id = batch_from_file(api, data)
    thread, raised = checking_in_a_thread(runtime, job_id)
    deadline = time.monotonic() + 60
    while api.get(f"/v1/batches/{job_id}").json()["request_counts"]["total"] == 0:
        assert thread.is_alive() and time.monotonic() < deadline, raised
        time.sleep(0.01)

    # When its owner deletes the file through the API
    assert api.delete(f"/v1/files/{file_id}").status_code == 200

    # Then the check ends without an error of its own, and the batch fails saying what happened
    thread.join(timeout=120)
    assert not thread.is_alive() and not raised, raised
    assert_failed_with_one_error_saying_the_file_was_deleted(api, job_id, file_id)


def test_a_batch_whose_input_file_is_deleted_while_it_is_scanned_fails_with_one_error(
        runtime: Runtime, client: ApiClient) -> None:
    # Given a batch made from a file of 3 chunks, and the file's bytes locked (as a delete in progress holds them)
    api = client(runtime, new_key(runtime))
    data = "".join(request_line(n) + "\n" for n in range(1, 7_000)).encode()
    assert len(data) > 3 * files.CHUNK_BYTES
    job_id, file_id = batch_from_file(api, data)
    with runtime.session() as deleting:
        deleting.execute(text("LOCK TABLE file_chunks IN ACCESS EXCLUSIVE MODE"))

        # When a worker starts checking the batch (it finds the file, then waits on its bytes), and the file is
        # deleted meanwhile (as DELETE /v1/files/{id} deletes it) and the delete commits
        thread, raised = checking_in_a_thread(runtime, job_id)
        wait_for_a_reader_waiting_on_the_lock(runtime, thread)
        row = deleting.get(StoredFile, file_id)
        assert row is not None
        retention.delete_file(session=deleting, row=row, now=utcnow())
        deleting.commit()

    # Then the check ends without an error of its own, and the batch fails saying what happened
    thread.join(timeout=120)
    assert not thread.is_alive() and not raised, raised
    assert_failed_with_one_error_saying_the_file_was_deleted(api, job_id, file_id)


def wait_for_a_reader_waiting_on_the_lock(runtime: Runtime, thread: threading.Thread) -> None:
    """Until a connection of the runtime's database waits on a lock to read file_chunks."""
    deadline = time.monotonic() + 30
    query = text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                 "AND wait_event_type = 'Lock' AND query ILIKE '%file_chunks%'")
    while True:
        with runtime.engine.connect() as connection:
            if connection.execute(query).scalar_one():
                return
        assert thread.is_alive() and time.monotonic() < deadline, "the check never waited on the file's bytes"
        time.sleep(0.01)
