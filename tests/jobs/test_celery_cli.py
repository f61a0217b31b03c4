"""`celery -A jobs ...` finds the worker's app (jobs.celery): a real worker on the real Redis answers `inspect ping`,
and Flower, run the way docs/monitoring.md says, sees it online from its heartbeat events."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from ports import free_port
from tiers import process_fixture

from jobs.runtime import Runtime
from launch.local_worker import settings_env, start_local_worker
from launch.processes import ManagedProcess


@process_fixture()
def worker_env(make_runtime: Callable[..., Runtime], redis_url: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    """A `swarmbatch worker` on Redis (and an embedded SQLite store); the environment that names the same app."""
    runtime = make_runtime(broker_url=redis_url)
    env = settings_env(runtime.settings)
    worker = start_local_worker(runtime.settings, log_dir=tmp_path)
    try:
        yield env
    finally:
        worker.terminate()


def celery(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`celery -A jobs ARGS` with the worker's settings."""
    return subprocess.run([sys.executable, "-m", "celery", "-A", "jobs", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})


def ping_until_answered(env: dict[str, str], within: float = 120) -> str:
    """`celery -A jobs inspect ping` until a worker answers (it starts within seconds); its output."""
    deadline = time.monotonic() + within
    while True:
        proc = celery(env, "inspect", "ping", "--timeout", "3")
        if proc.returncode == 0 or time.monotonic() > deadline:
            assert proc.returncode == 0, f"no worker answered within {within:.0f} s: {proc.stdout}{proc.stderr}"
            return proc.stdout
        time.sleep(1)


def worker_name(ping: str) -> str:
    """The node that answered pong in `inspect ping`'s output."""
    found = re.search(r"->\s+(swarmbatch-\d+@\S+): OK\s+pong", ping)
    assert found, ping
    return found.group(1)


def test_celery_finds_the_app_and_the_worker_answers_inspect_ping(worker_env: dict[str, str]) -> None:
    assert worker_name(ping_until_answered(worker_env))
    report = celery(worker_env, "report")
    assert report.returncode == 0 and "transport:redis" in report.stdout
    assert "worker_send_task_events: True" in report.stdout and "task_send_sent_event: True" in report.stdout


def test_flower_shows_the_worker_online(worker_env: dict[str, str], tmp_path: Path) -> None:
    if importlib.util.find_spec("flower") is None:
        pytest.fail("flower is not installed: pip install -e '.[test]' (scripts/setup.sh does)", pytrace=False)
    worker = worker_name(ping_until_answered(worker_env))
    port = free_port()
    flower = ManagedProcess([sys.executable, "-m", "celery", "-A", "jobs", "flower", "--address=127.0.0.1",
                             f"--port={port}"], name="flower", log_dir=tmp_path, env=worker_env)
    try:
        deadline, online = time.monotonic() + 60, ""
        while f'flower_worker_online{{worker="{worker}"}} 1.0' not in online:
            assert time.monotonic() < deadline and flower.proc.poll() is None, f"{online[-2000:]} {flower.log_path}"
            time.sleep(0.5)
            online = metrics_text(f"http://127.0.0.1:{port}")
        assert httpx.get(f"http://127.0.0.1:{port}/healthcheck", timeout=5).text == "OK"
    finally:
        flower.terminate()


def metrics_text(url: str) -> str:
    """Flower's /metrics, or '' while it is starting."""
    try:
        return httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return ""
