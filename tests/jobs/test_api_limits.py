"""Per-key limits of the API (issue 28, N3 + N8 + N9): concurrent downloads, uploads and submissions (429 with
Retry-After), the body deadline (408), quotas (429 insufficient_quota), retention (the sweep deletes expired files,
the clock alone mocked) and cleanup after `keys revoke`.

A real uvicorn on 127.0.0.1 over a real SQLite store and Redis broker, called over real sockets and with httpx and
the openai SDK.
"""
from __future__ import annotations

import asyncio
import json
import logging
import platform
import select
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import new_key
from jobs_support import ApiClient, complete_every_request
from openai import OpenAI
from sqlalchemy import func
from sqlalchemy import select as sql_select
from typer.testing import CliRunner

import cli
from jobs import store
from jobs.api.send_deadline import SEND_DEADLINE_LOG, SendTimedOut, deadline_send
from jobs.api.slots import ALL_SUBMISSIONS, Slots
from jobs.models import FileChunk, Job, Request, StoredFile, utcnow
from jobs.runtime import Runtime
from jobs.worker.sweep import sweep_store

pytestmark = pytest.mark.alone  # it measures time against a bound: run after the parallel phase, alone

# the openai SDK asks the platform its processor, which runs `uname -p` once per process: ask at collection, so that
# no fast-tier test below is taken for one that starts a process (as conftest does for croniter)
platform.processor()

BIG = 8 * 1024 * 1024  # more than the kernel's socket buffers hold: a download of it stalls on the server


@pytest.fixture
def runtime(make_runtime: Callable[..., Runtime], redis_url: str, tiny_model: Path) -> Runtime:
    """SQLite store, real Redis broker; the API serves the tiny model."""
    return make_runtime(broker_url=redis_url, api_models=[str(tiny_model)])


def line(custom_id: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "Hello there", "max_tokens": 4}}


def batch(model: Path, *custom_ids: str, **fields: Any) -> dict[str, Any]:
    """An inline batch (JSON body)."""
    return {"model": str(model), "requests": [line(c) for c in custom_ids or ("a",)], **fields}


def upload(api: httpx.Client, data: bytes, **fields: str) -> httpx.Response:
    return api.post("/v1/files", files={"file": ("f.jsonl", data)}, data={"purpose": "batch", **fields})


def connect(api: httpx.Client) -> socket.socket:
    """A raw connection to the API with a 4 KiB receive buffer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((api.base_url.host, api.base_url.port))
    return sock


def stalled_download(api: httpx.Client, key: str, file_id: str) -> socket.socket:
    """A download whose first bytes are read (its status is 200), then nothing more."""
    sock = connect(api)
    sock.sendall(f"GET /v1/files/{file_id}/content HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer {key}\r\n\r\n"
                 .encode())
    assert sock.recv(64).startswith(b"HTTP/1.1 200")
    return sock


MULTIPART_HEAD = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b\r\n'
                  b'Content-Disposition: form-data; name="file"; filename="slow.jsonl"\r\n\r\n')


def started_upload(api: httpx.Client, key: str, *, declared: int = 100_000) -> socket.socket:
    """POST /v1/files declaring `declared` bytes, of which the form's head (and nothing of the file) is sent."""
    sock = connect(api)
    sock.sendall(f"POST /v1/files HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: {declared}\r\n\r\n".encode()
                 + MULTIPART_HEAD)
    return sock


def started_upload_holding_the_slot(api: httpx.Client, key: str, *, declared: int) -> socket.socket:
    """A started upload (as `started_upload`) that holds its key's one upload slot: a probe of the same key, a form
    without a file, gets 429 (a free slot answers it with an error and stores nothing). A probe takes the slot for
    an instant, so an upload that arrived then was refused (it has its answer already): it is replaced."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        slow = started_upload(api, key, declared=declared)
        while time.monotonic() < deadline and not select.select([slow], [], [], 0.2)[0]:
            if api.post("/v1/files", data={"purpose": "batch"}).status_code == 429:
                return slow
        slow.close()
    raise AssertionError("the started upload never took the slot")


def answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body of the answer on `sock` (read until the server closes or the body is whole)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, body


def _length(data: bytes) -> int:
    for header in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if header.lower().startswith(b"content-length:"):
            return int(header.split(b":")[1])
    return 1 << 62


def eventually(call: Callable[[], httpx.Response], status: int, within: float = 5.0) -> httpx.Response:
    """The first answer of `call` with `status`, trying again for `within` seconds."""
    deadline = time.monotonic() + within
    while (response := call()).status_code != status:
        assert time.monotonic() < deadline, (response.status_code, response.text)
        time.sleep(0.1)
    return response


def assert_refused(response: httpx.Response, status: int, kind: str, setting: str) -> None:
    """An OpenAI error body of `kind` in one line naming `setting`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == kind and setting in error["message"] and "\n" not in error["message"], error


# ---- concurrent downloads, uploads and submissions per key ----------------------------------------------------------
def test_a_keys_downloads_past_its_bound_get_429_and_each_gives_its_slot_back_however_it_ends(
        make_runtime: Callable[..., Runtime], redis_url: str, client: ApiClient, tiny_model: Path) -> None:
    # Given one download per key, and alice's 8 MB file
    runtime = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)], max_downloads_per_key=1)
    alice, bob = new_key(runtime, "alice"), new_key(runtime, "bob")
    as_alice, as_bob = client(runtime, alice), client(runtime, bob)
    file_id = upload(as_alice, b"a" * BIG).json()["id"]
    job_id = as_alice.post("/v1/batches", json=batch(tiny_model)).json()["id"]

    # When alice holds a download she does not read
    with stalled_download(as_alice, alice, file_id):
        # Then her next download of any kind is refused at once, with when to retry
        for path in (f"/v1/files/{file_id}/content", f"/v1/batches/{job_id}/results", f"/v1/batches/{job_id}/errors"):
            refused = as_alice.get(path)
            assert_refused(refused, 429, "TooManyDownloads", "SWARMBATCH_MAX_DOWNLOADS_PER_KEY")
            assert refused.headers["retry-after"] == "5"
        # and bob downloads as he likes
        bobs = upload(as_bob, b"b" * 1000).json()["id"]
        assert as_bob.get(f"/v1/files/{bobs}/content").content == b"b" * 1000

    # When she goes away, her slot is free again; and downloads that end in a 404 give theirs back at once
    whole = eventually(lambda: as_alice.get(f"/v1/files/{file_id}/content"), 200)
    assert len(whole.content) == BIG
    assert [as_alice.get("/v1/files/file-nope/content").status_code for _ in range(3)] == [404, 404, 404]
    assert as_alice.get(f"/v1/batches/{job_id}/results").status_code == 200


def test_a_keys_uploads_past_its_bound_get_429_while_another_keys_go_through(
        make_runtime: Callable[..., Runtime], redis_url: str, client: ApiClient, tiny_model: Path) -> None:
    # Given one upload per key, and alice's upload whose body has begun to arrive
    runtime = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)], max_uploads_per_key=1)
    alice, bob = new_key(runtime, "alice"), new_key(runtime, "bob")
    as_alice, as_bob = client(runtime, alice), client(runtime, bob)
    content = b"x" * 1000
    tail = content + b"\r\n--b--\r\n"
    with started_upload_holding_the_slot(as_alice, alice, declared=len(MULTIPART_HEAD) + len(tail)) as slow:

        # When alice uploads another file, and bob one
        refused, bobs = upload(as_alice, b"y"), upload(as_bob, b"z")

        # Then alice's is refused with when to retry, bob's is stored
        assert_refused(refused, 429, "TooManyUploads", "SWARMBATCH_MAX_UPLOADS_PER_KEY")
        assert refused.headers["retry-after"] == "5"
        assert bobs.status_code == 200, bobs.text
        # and alice's first one, once whole, is stored and gives its slot back
        slow.sendall(tail)
        status, _, body = answer(slow)
        assert status == 200 and json.loads(body)["bytes"] == len(content), body
    assert upload(as_alice, b"y").status_code == 200
    assert len(as_alice.get("/v1/files").json()["data"]) == 2


def test_the_servers_submission_slots_are_a_bound_over_all_keys() -> None:
    slots = Slots(ALL_SUBMISSIONS, total=2)
    assert slots.try_acquire() and slots.try_acquire() and not slots.try_acquire()
    assert "2 batch submissions are already in progress" in slots.refusal().message
    assert "SWARMBATCH_MAX_CONCURRENT_SUBMISSIONS" in slots.refusal().message
    slots.release()
    assert slots.try_acquire()


# ---- the body deadline ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/files", "/v1/batches"])
def test_a_body_trickling_in_is_cut_off_at_its_deadline_with_408_and_holds_nobody_elses_slot(
        make_runtime: Callable[..., Runtime], redis_url: str, client: ApiClient, tiny_model: Path, path: str) -> None:
    # Given a 2 s body deadline, and alice sending a body of 1000 declared bytes at a byte a second
    runtime = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)], body_deadline_seconds=2.0)
    alice, bob = new_key(runtime, "alice"), new_key(runtime, "bob")
    as_alice, as_bob = client(runtime, alice), client(runtime, bob)
    sock = connect(as_alice)
    started = time.monotonic()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer {alice}\r\n"
                 f"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 1000\r\n\r\n".encode())
    others: list[int] = []
    with sock:
        while not select.select([sock], [], [], 1.0)[0]:
            sock.sendall(b"-")
            # meanwhile bob uploads and submits as usual
            others += [upload(as_bob, b"b").status_code, as_bob.post("/v1/batches", json=batch(tiny_model)).status_code]
            assert time.monotonic() - started < 10, "no answer to the trickling body"

        # Then the answer is a 408 at the deadline, and the server closes the connection
        status, headers, body = answer(sock)
        elapsed = time.monotonic() - started
        assert sock.recv(1) == b""
    assert status == 408 and 2.0 <= elapsed < 3.5, (status, elapsed, body)
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["type"] == "RequestTimeout" and "SWARMBATCH_BODY_DEADLINE_SECONDS" in error["message"]
    assert others and set(others) == {200}
    # and alice's slot is hers again
    assert upload(as_alice, b"a").status_code == 200
    assert as_alice.post("/v1/batches", json=batch(tiny_model)).status_code == 200


# ---- the send deadline ---------------------------------------------------------------------------------------------
def read_all(sock: socket.socket) -> tuple[int, str]:
    """How many bytes come on `sock` until the server closes it, and how it ended ("eof" or "reset")."""
    sock.settimeout(10)
    count = 0
    try:
        while chunk := sock.recv(65536):
            count += len(chunk)
    except ConnectionResetError:
        return count, "reset"
    return count, "eof"


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])  # `swarmbatch api` runs uvloop; their transports differ
def test_a_download_that_stops_reading_loses_its_connection_at_the_send_deadline_and_frees_its_slot(
        make_runtime: Callable[..., Runtime], redis_url: str, serve: Callable[..., str], tiny_model: Path,
        caplog: pytest.LogCaptureFixture, loop: str) -> None:
    # Given a 3 s send deadline, two downloads per key (the default), and alice's 8 MB file
    runtime = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)], send_deadline_seconds=3.0)
    alice = new_key(runtime, "alice")
    as_alice = httpx.Client(base_url=serve(runtime, loop=loop), headers={"Authorization": f"Bearer {alice}"},
                            timeout=60)
    file_id = upload(as_alice, b"a" * BIG).json()["id"]

    # When alice opens two downloads and stops reading each after its first bytes
    started = time.monotonic()
    with stalled_download(as_alice, alice, file_id) as first, stalled_download(as_alice, alice, file_id) as second:
        # Then a third is refused while they hold her slots
        assert_refused(as_alice.get(f"/v1/files/{file_id}/content"), 429, "TooManyDownloads",
                       "SWARMBATCH_MAX_DOWNLOADS_PER_KEY")
        # and about 3 s later (the deadline) it is served whole: the stalled two gave their slots back
        whole = eventually(lambda: as_alice.get(f"/v1/files/{file_id}/content"), 200, within=15)
        freed_after = time.monotonic() - started
        assert len(whole.content) == BIG and 3.0 <= freed_after < 12, freed_after
        # and the stalled connections were reset: neither gets the whole file
        for stalled in (first, second):
            received, ended = read_all(stalled)
            assert ended == "reset" and received + 64 < BIG, (received, ended)
    # and the API said so in one line each, and nothing else went wrong
    aborted = [r for r in caplog.records if r.msg == SEND_DEADLINE_LOG]
    assert len(aborted) == 2 and all(r.getMessage() == f"GET '/v1/files/{file_id}/content': the client took "
                                     f"nothing of the answer for 3 s (SWARMBATCH_SEND_DEADLINE_SECONDS); "
                                     f"connection aborted" for r in aborted), [r.getMessage() for r in aborted]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    as_alice.close()


def test_a_send_past_the_deadline_under_a_server_without_a_transport_to_abort_fails_the_answer() -> None:
    # Given a server whose send never returns (its client reads nothing) and shows no transport
    async def stuck_send(message: dict[str, Any]) -> None:
        await asyncio.Event().wait()

    async def two_sends() -> float:
        send = deadline_send({"type": "http", "method": "GET", "path": "/x"}, stuck_send, 0.2)
        started = time.monotonic()
        with pytest.raises(SendTimedOut):
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
        await send({"type": "http.response.body", "body": b"y", "more_body": True})  # after that, sends are dropped
        return time.monotonic() - started

    # Then the first send fails at the deadline (the server closes the connection), and the next returns at once
    assert 0.2 <= asyncio.run(two_sends()) < 1.0


def test_a_slow_download_that_keeps_reading_outlasts_the_send_deadline(
        make_runtime: Callable[..., Runtime], redis_url: str, client: ApiClient, tiny_model: Path) -> None:
    # Given a 3 s send deadline and alice's 8 MB file
    runtime = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)], send_deadline_seconds=3.0)
    alice = new_key(runtime, "alice")
    as_alice = client(runtime, alice)
    file_id = upload(as_alice, b"a" * BIG).json()["id"]

    # When she reads it at about 1 MB/s, paced by the bytes received (about 8 s in all, each 1 MiB piece about 1 s)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sock.settimeout(10)
    sock.connect((as_alice.base_url.host, as_alice.base_url.port))
    started = time.monotonic()
    with sock:
        sock.sendall(f"GET /v1/files/{file_id}/content HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer {alice}\r\n"
                     f"Connection: close\r\n\r\n".encode())
        data = bytearray()
        while chunk := sock.recv(65536):
            data += chunk
            time.sleep(max(0.0, started + len(data) / 1_000_000 - time.monotonic()))
    elapsed = time.monotonic() - started

    # Then she gets all of it, though it took longer than the deadline
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and elapsed > 3.0, (head[:40], elapsed)
    assert dechunk(body) == b"a" * BIG


def dechunk(body: bytes) -> bytes:
    """The payload of a chunked transfer-coding body."""
    out, rest = bytearray(), body
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return bytes(out)
        out += rest[:size]
        rest = rest[size + 2:]


# ---- quotas --------------------------------------------------------------------------------------------------------
def test_uploads_and_submissions_past_the_keys_quota_get_429_insufficient_quota_and_store_nothing(
        make_runtime: Callable[..., Runtime], redis_url: str, client: ApiClient, tiny_model: Path) -> None:
    # Given a quota of 2 files and 1000 bytes per key
    runtime = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)], max_files_per_key=2,
                           max_stored_bytes_per_key=1000)
    alice, bob = new_key(runtime, "alice"), new_key(runtime, "bob")
    as_alice, as_bob = client(runtime, alice), client(runtime, bob)
    first = upload(as_alice, b"a" * 600)
    assert first.status_code == 200, first.text

    # When an upload would pass the bytes, Then it is refused and nothing of it is kept
    assert_refused(upload(as_alice, b"a" * 600), 429, "InsufficientQuota", "SWARMBATCH_MAX_STORED_BYTES_PER_KEY")
    assert as_alice.post("/v1/batches", json=batch(tiny_model)).status_code == 200  # its input file: 2 files now
    # When the key keeps 2 files, Then a further upload and a further submission are refused
    refused = upload(as_alice, b"a")
    assert_refused(refused, 429, "InsufficientQuota", "SWARMBATCH_MAX_FILES_PER_KEY")
    assert refused.json()["error"]["code"] == "insufficient_quota"
    assert_refused(as_alice.post("/v1/batches", json=batch(tiny_model)), 429, "InsufficientQuota",
                   "SWARMBATCH_MAX_FILES_PER_KEY")
    assert len(as_alice.get("/v1/files").json()["data"]) == 2 and len(as_alice.get("/v1/batches").json()["data"]) == 1
    with runtime.session() as session:
        assert session.scalar(sql_select(func.count()).select_from(FileChunk)) == 2
    # and bob is not bound by alice's usage
    assert upload(as_bob, b"b" * 900).status_code == 200
    # When alice deletes a file, Then she has room again
    assert as_alice.delete(f"/v1/files/{first.json()['id']}").status_code == 200
    assert upload(as_alice, b"a" * 600).status_code == 200


# ---- retention -----------------------------------------------------------------------------------------------------
def sweep_at(runtime: Runtime, monkeypatch: pytest.MonkeyPatch, at: Any) -> None:
    """One sweep with the clock at `at` (the clock alone is mocked)."""
    monkeypatch.setattr("jobs.worker.sweep.utcnow", lambda: at)
    sweep_store(runtime)


def test_the_sweep_deletes_uploads_and_outputs_once_they_expire_and_nothing_before(
        runtime: Runtime, client: ApiClient, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given an upload that expires in an hour (through the openai SDK), one kept for the default 30 days, and a
    # completed batch whose outputs expire two hours after they were made
    key = new_key(runtime)
    api = client(runtime, key)
    sdk = OpenAI(base_url=f"{api.base_url}/v1", api_key=key, max_retries=0)
    hourly = sdk.files.create(file=("h.jsonl", b"h"), purpose="batch",
                              expires_after={"anchor": "created_at", "seconds": 3600})
    assert hourly.expires_at == hourly.created_at + 3600
    monthly = upload(api, b"m").json()
    assert monthly["expires_at"] == monthly["created_at"] + 30 * 24 * 3600
    job = api.post("/v1/batches", json=batch(tiny_model, "a", "b", output_expires_after={
        "anchor": "created_at", "seconds": 7200})).json()
    complete_every_request(runtime, job["id"], output=lambda index: f"out {index}")
    now = utcnow()
    sweep_at(runtime, monkeypatch, now)  # settles the job: its output file is made now
    done = api.get(f"/v1/batches/{job['id']}").json()
    assert done["status"] == "completed" and done["output_file_id"]
    output = api.get(f"/v1/files/{done['output_file_id']}").json()
    assert output["expires_at"] - output["created_at"] == 7200
    results = api.get(f"/v1/batches/{job['id']}/results").text

    # When the sweep runs an hour later, Then the hourly upload and its bytes are gone, and the rest is kept
    sweep_at(runtime, monkeypatch, now + timedelta(seconds=3601))
    assert api.get(f"/v1/files/{hourly.id}").status_code == 404
    assert api.get(f"/v1/files/{monthly['id']}").status_code == 200
    assert api.get(f"/v1/batches/{job['id']}/results").text == results
    with runtime.session() as session:
        assert session.scalar(sql_select(func.count()).select_from(FileChunk)
                              .where(FileChunk.file_id == hourly.id)) == 0

    # When it runs two hours later, Then the batch's output file is gone, its outputs too (410), its counts stay
    sweep_at(runtime, monkeypatch, now + timedelta(seconds=7201))
    assert api.get(f"/v1/files/{done['output_file_id']}").status_code == 404
    gone = api.get(f"/v1/batches/{job['id']}/results")
    assert gone.status_code == 410 and gone.json()["error"]["type"] == "OutputsExpired"
    assert api.get(f"/v1/batches/{job['id']}/errors").status_code == 410
    after = api.get(f"/v1/batches/{job['id']}").json()
    assert after["request_counts"] == done["request_counts"] and after["usage"] == done["usage"]
    with runtime.session() as session:
        assert [r.output_text for r in session.scalars(sql_select(Request).where(Request.job_id == job["id"]))] \
            == [None, None]

    # When it runs 30 days later, Then the monthly upload and the batch's input are gone too
    sweep_at(runtime, monkeypatch, now + timedelta(days=30, seconds=1))
    assert api.get("/v1/files").json()["data"] == []


@pytest.mark.parametrize("expires_after", [{"anchor": "created_at", "seconds": 60},
                                           {"anchor": "last_active_at", "seconds": 3600},
                                           {"anchor": "created_at", "seconds": 31 * 24 * 3600}])
def test_an_expiry_outside_openais_bounds_is_a_400_naming_it(runtime: Runtime, client: ApiClient,
                                                            tiny_model: Path, expires_after: dict[str, Any]) -> None:
    api = client(runtime, new_key(runtime))
    refused = upload(api, b"x", **{f"expires_after[{k}]": str(v) for k, v in expires_after.items()})
    assert refused.status_code == 400 and refused.json()["error"]["param"].startswith("expires_after"), refused.text
    refused = api.post("/v1/batches", json=batch(tiny_model, output_expires_after=expires_after))
    assert refused.status_code == 400 and refused.json()["error"]["param"].startswith("output_expires_after")
    assert api.get("/v1/files").json()["data"] == [] and api.get("/v1/batches").json()["data"] == []


def test_the_operators_retention_bounds_what_a_key_asks(make_runtime: Callable[..., Runtime], redis_url: str,
                                                         client: ApiClient, tiny_model: Path) -> None:
    runtime = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)], upload_retention_seconds=7200)
    api = client(runtime, new_key(runtime))
    asked = upload(api, b"x", **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "86400"}).json()
    assert asked["expires_at"] == asked["created_at"] + 7200


# ---- revoking a key ------------------------------------------------------------------------------------------------
def test_revoking_a_key_cancels_its_batches_and_the_next_sweep_deletes_its_files_and_outputs(
        runtime: Runtime, client: ApiClient, tiny_model: Path) -> None:
    # Given alice's upload, her completed batch (with an output file) and a pending one; and bob's upload
    alice, bob = new_key(runtime, "alice"), new_key(runtime, "bob")
    as_alice, as_bob = client(runtime, alice), client(runtime, bob)
    upload(as_alice, b"a" * 100)
    done = as_alice.post("/v1/batches", json=batch(tiny_model)).json()["id"]
    complete_every_request(runtime, done, output=lambda index: f"out {index}")
    sweep_store(runtime)
    pending = as_alice.post("/v1/batches", json=batch(tiny_model)).json()["id"]
    bobs = upload(as_bob, b"b").json()["id"]

    # When the operator revokes alice's key
    result = CliRunner().invoke(cli.app, ["keys", "revoke", "alice"])

    # Then her pending batch is cancelled at once, and the next sweep deletes every file of hers
    assert result.exit_code == 0 and "1 unfinished batches cancelled" in result.stdout, result.output
    with runtime.session() as session:
        assert session.get(Job, pending).status == "cancelled"  # type: ignore[union-attr]
    sweep_store(runtime)
    with runtime.session() as session:
        owners = list(session.scalars(sql_select(StoredFile.api_key_id)))
        assert owners and set(owners) == {key_id(runtime, bob)}
        assert session.get(Job, done).outputs_expired_at is not None  # type: ignore[union-attr]
        assert session.scalar(sql_select(func.count()).select_from(FileChunk)) == 1
    assert as_bob.get(f"/v1/files/{bobs}/content").content == b"b"


def key_id(runtime: Runtime, key: str) -> int:
    with runtime.session() as session:
        found = store.find_api_key(session=session, key=key)
        assert found is not None
        return found.id
