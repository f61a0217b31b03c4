"""Waiting on and reading jobs in tests of real workers, reading their logs, and starting `swarmbatch api`."""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from ports import free_port
from sqlalchemy import select

from jobs import ingest, store
from jobs.models import Job, Request, RequestStatus
from jobs.runtime import Runtime
from jobs.worker.job_worker import CLAIMED_FOR_FREED_SLOTS_LOG, CLAIMED_LOG
from launch.local_worker import settings_env
from launch.processes import ManagedProcess, cli_command


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def check_lines(runtime: Runtime, job_id: str) -> None:
    """What a worker does first with a batch submitted over REST: check its lines, storing its requests and line
    errors (jobs.ingest); tests without a worker process call it where the worker would."""
    checked = ingest.check_lines(runtime, job_id)
    assert checked.ran, f"job {job_id} had no lines to check"
    while checked.more:  # slice after slice, as the worker sends the job again
        checked = ingest.check_lines(runtime, job_id)


def complete_every_request(runtime: Runtime, job_id: str, *, output: Callable[[int], str]) -> None:
    """As workers would: check the job's lines, claim its requests and complete each with `output(index)`."""
    check_lines(runtime, job_id)
    while True:
        with runtime.session() as session:
            token, rows = store.claim_requests(session=session, job_id=job_id, worker="test", limit=200,
                                               lease_seconds=60, max_attempts=5)
            for row in rows:
                assert store.finish_request(session=session, request_id=row.id, token=token,
                                            status=RequestStatus.completed, generated=[5, 6], finish_reason="length",
                                            output_text=output(row.index))
            session.commit()
        if not rows:
            return


def job_status(runtime: Runtime, job_id: str) -> str:
    with runtime.session() as session:
        return str(session.scalar(select(Job.status).where(Job.id == job_id)))


def requests_of(runtime: Runtime, job_id: str) -> list[Request]:
    with runtime.session() as session:
        return list(session.scalars(select(Request).where(Request.job_id == job_id).order_by(Request.index)))


def log_pattern(fmt: str) -> re.Pattern[str]:
    """The lines a logger call with the %-format `fmt` wrote (its message ends the line); each %d, %s a group."""
    return re.compile(re.escape(fmt).replace("%d", r"(\d+)").replace("%s", "(.*?)") + "$", re.M)


def claims(log: str) -> list[tuple[list[int], bool]]:
    """Each claim a worker logged, in order: the request ids, and whether they filled freed slots."""
    plain, refill = log_pattern(CLAIMED_LOG), log_pattern(CLAIMED_FOR_FREED_SLOTS_LOG)
    found = []
    for line in log.splitlines():
        if match := plain.search(line) or refill.search(line):
            found.append(([int(i) for i in match.group(3).split(", ")], match.re is refill))
    return found


def start_api(runtime: Runtime, log_dir: Path) -> tuple[ManagedProcess, str]:
    """A `swarmbatch api` process on the runtime's store and broker; returns it and its base URL once it answers."""
    port = free_port()
    api = ManagedProcess(cli_command("api", "--host", "127.0.0.1", "--port", str(port)), name="api",
                         log_dir=log_dir, env=settings_env(runtime.settings))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return api, url
        except httpx.HTTPError:
            pass
        if api.proc.poll() is not None or time.monotonic() > deadline:
            api.terminate()
            raise RuntimeError(f"swarmbatch api did not answer; see {api.log_path}")
        time.sleep(0.2)


ApiClient = Callable[..., httpx.Client]  # the `client` fixture: (runtime, key=None) -> a client of its API
