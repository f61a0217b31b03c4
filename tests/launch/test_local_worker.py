"""A caller that follows a job on a worker it started (the demo) learns at once when that worker dies."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from jobs.backends import StoreBackend
from jobs.errors import WorkerGone
from jobs.progress import follow_job
from jobs.runtime import Runtime
from jobs.submission import submit_batch
from launch.local_worker import require_running, start_local_worker


@pytest.mark.swarm
def test_following_a_job_whose_worker_was_killed_fails_with_one_line_instead_of_waiting_forever(
        make_runtime: Callable[..., Runtime], tiny_model: Path, tmp_path: Path) -> None:
    # Given a job on the embedded store, and the worker process that would run it
    runtime = make_runtime()
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 4}}
    job = submit_batch(runtime, json.dumps(line).encode() + b"\n", model=str(tiny_model))
    worker = start_local_worker(runtime.settings, log_dir=tmp_path)
    try:
        # When the worker is killed (no swarm is up, so the job cannot have ended)
        worker.kill()
        began = time.monotonic()

        # Then following the job raises WorkerGone at the next poll, naming the exit code and the log
        with pytest.raises(WorkerGone, match=r"exited with code -9 .*swarmbatch worker.* Log: "):
            follow_job(StoreBackend(runtime), job.id, interval=0.1, check_alive=lambda: require_running(worker))
        assert time.monotonic() - began < 5
    finally:
        worker.terminate()
