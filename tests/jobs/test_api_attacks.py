"""One key cannot take the API down: a real `swarmbatch api` process on PostgreSQL, attacked over real sockets.

The attacker holds downloads open without reading them and trickles submission bodies; meanwhile anyone's
`/healthz`, another key's list and another key's submission must answer within a second (issue 28, N3 + N8).
Nor can a caller forge lines in the logs: what it sends is logged escaped (N11).
"""
from __future__ import annotations

import json
import logging
import select
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from factories import new_key
from jobs_support import ApiClient, check_lines, start_api
from sqlalchemy import text
from tiers import process_fixture

from jobs import store
from jobs.models import RequestStatus
from jobs.runtime import Runtime

pytestmark = pytest.mark.alone  # it measures time against a bound: run after the parallel phase, alone

PROBE_TIMEOUT = 5.0  # seconds; before the fix a probe waited 30 s for a pooled connection, then got a 500
FILE_BYTES = 8 * 1024 * 1024  # far more than the kernel's socket buffers hold: the stream stalls on the server
STALLED_DOWNLOADS = 20
TRICKLING_SUBMISSIONS = 2


@pytest.fixture(params=["per-key-limit", "no-per-key-limit"])
def attacked_runtime(request: pytest.FixtureRequest, make_runtime: Callable[..., Runtime], postgres_url: str,
                     redis_url: str, tiny_model: Path) -> Runtime:
    """PostgreSQL (its default pool: 5 + 10 connections) and Redis; downloads capped per key at the default (2),
    or not capped (50), to show that streaming alone no longer holds a connection."""
    downloads = {"per-key-limit": {}, "no-per-key-limit": {"max_downloads_per_key": 50}}[request.param]
    return make_runtime(database_url=postgres_url, broker_url=redis_url, api_models=[str(tiny_model)], **downloads)


@process_fixture()
def api_url(attacked_runtime: Runtime, tmp_path: Path) -> Iterator[str]:
    """A `swarmbatch api` process serving the runtime's store, stopped by its PID after the test."""
    api, url = start_api(attacked_runtime, tmp_path)
    try:
        yield url
    finally:
        api.terminate()


def raw_socket(url: str) -> socket.socket:
    """A connection to the API whose receive buffer is 4 KiB, so that the server's sends stall once it is full."""
    parsed = httpx.URL(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((parsed.host, parsed.port))
    return sock


def stalled_download(url: str, key: str, file_id: str) -> tuple[socket.socket, int | str]:
    """GET the file's content, read the first bytes of the answer and then nothing more; returns the socket and
    the answer's status ("no answer" when none came within a second)."""
    sock = raw_socket(url)
    sock.sendall(f"GET /v1/files/{file_id}/content HTTP/1.1\r\nHost: api\r\nAuthorization: Bearer {key}\r\n\r\n"
                 .encode())
    sock.settimeout(1.0)
    try:
        return sock, int(sock.recv(64).split()[1])
    except TimeoutError:
        return sock, "no answer"


def trickling_submission(url: str, key: str) -> socket.socket:
    """POST /v1/batches declaring a 1 MB JSON body, of which it sends 45 bytes and then nothing."""
    sock = raw_socket(url)
    sock.sendall(f"POST /v1/batches HTTP/1.1\r\nHost: api\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n".encode())
    sock.sendall(b'{"model": "x", "requests": [{"custom_id": "a",')
    return sock


def timed(call: Callable[[], httpx.Response]) -> tuple[int | str, float]:
    """The status of a call and its seconds ("timeout" when it had no answer within PROBE_TIMEOUT)."""
    started = time.monotonic()
    try:
        status: int | str = call().status_code
    except httpx.TimeoutException:
        status = "timeout"
    return status, time.monotonic() - started


def test_stalled_downloads_and_trickling_submissions_of_one_key_leave_the_api_answering_others(
        attacked_runtime: Runtime, api_url: str, tiny_model: Path) -> None:
    # Given alice's 8 MB file, and bob, who has submitted a batch before (the API has loaded the tokenizer)
    alice, bob = new_key(attacked_runtime, "alice"), new_key(attacked_runtime, "bob")
    batch = {"model": str(tiny_model), "requests": [{"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                                     "body": {"prompt": "Hi", "max_tokens": 2}}]}
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {alice}"}, timeout=60) as as_alice:
        uploaded = as_alice.post("/v1/files", files={"file": ("big.jsonl", b"a" * FILE_BYTES)},
                                 data={"purpose": "batch"})
        assert uploaded.status_code == 200, uploaded.text
    with ExitStack() as held, httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {bob}"},
                                           timeout=PROBE_TIMEOUT) as as_bob:
        assert as_bob.post("/v1/batches", json=batch, timeout=60).status_code == 200

        # When alice opens 20 downloads of it and reads none past their first bytes, and trickles two submissions
        statuses = []
        for _ in range(STALLED_DOWNLOADS):
            sock, status = stalled_download(api_url, alice, uploaded.json()["id"])
            held.enter_context(sock)
            statuses.append(status)
        trickling = [held.enter_context(trickling_submission(api_url, alice)) for _ in range(TRICKLING_SUBMISSIONS)]
        time.sleep(0.5)  # the trickling bodies have reached the routes

        # Then /healthz, bob's list of batches and bob's submission each answer 200 within a second
        probes = {"healthz": timed(lambda: httpx.get(f"{api_url}/healthz", timeout=PROBE_TIMEOUT)),
                  "bob's list": timed(lambda: as_bob.get("/v1/batches")),
                  "bob's submission": timed(lambda: as_bob.post("/v1/batches", json=batch))}
        print(f"alice's downloads: {statuses}; probes under attack: "
              + ", ".join(f"{name} {status} in {seconds:.3f} s" for name, (status, seconds) in probes.items()))
        assert all(status == 200 and seconds < 1.0 for status, seconds in probes.values()), probes
        # and alice's downloads beyond her limit were refused, not queued (each of the others streams)
        assert set(statuses) <= {200, 429} and statuses.count(200) == min(
            STALLED_DOWNLOADS, attacked_runtime.settings.model_dump().get("max_downloads_per_key", STALLED_DOWNLOADS))
        # and one of her trickling submissions was refused (one per key), the other still waits for its body
        answered, _, _ = select.select(trickling, [], [], 1.0)
        assert len(answered) == 1 and answered[0].recv(64).startswith(b"HTTP/1.1 429")
        # and no database connection is held in a transaction by all that
        assert idle_in_transaction(attacked_runtime) == 0
    assert json.loads(httpx.get(f"{api_url}/healthz", timeout=10).text)


def idle_in_transaction(runtime: Runtime) -> int:
    """PostgreSQL connections to the runtime's database that sit in an open transaction."""
    with runtime.engine.connect() as connection:
        return int(connection.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND state = 'idle in transaction'")).scalar_one())


def test_a_custom_id_with_a_line_break_reaches_the_workers_log_escaped(
        make_runtime: Callable[..., Runtime], redis_url: str, client: ApiClient, tiny_model: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # Given a batch whose line's custom_id carries a line break and a forged log line
    runtime = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)])
    api = client(runtime, new_key(runtime))
    forged = "a\nINFO jobs.store: FORGED line: API key 1 (alice) revoked"
    created = api.post("/v1/batches", json={"model": str(tiny_model), "requests": [
        {"custom_id": forged, "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 2}}]})
    assert created.status_code == 200, created.text

    # When a worker checks its lines, claims the request and ends it (the store logs each request that ends)
    caplog.set_level(logging.INFO)
    check_lines(runtime, created.json()["id"])
    with runtime.session() as session:
        token, [row] = store.claim_requests(session=session, job_id=created.json()["id"], worker="test", limit=1,
                                            lease_seconds=60, max_attempts=5)
        assert store.finish_request(session=session, request_id=row.id, token=token, status=RequestStatus.completed,
                                    generated=[5], finish_reason="length", output_text="x")
        session.commit()

    # Then the custom_id is in the log escaped, on the line of its request, and no line of the log is forged
    [ended] = [r.getMessage() for r in caplog.records if "in_progress -> completed" in r.getMessage()]
    assert repr(forged) in ended and "\n" not in ended, ended
    assert not [r for r in caplog.records if "\nINFO" in r.getMessage()], caplog.text
