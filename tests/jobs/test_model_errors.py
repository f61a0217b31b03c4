"""A model directory that breaks after submission fails the job's requests with its reason: retrying cannot help."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from jobs_support import job_status, requests_of

from jobs.assembly import build_runtime
from jobs.models import RequestStatus
from jobs.runtime import Runtime
from jobs.submission import submit_batch
from jobs.worker.job_worker import JobWorker, Outcome


def test_a_model_dir_that_lost_its_weights_fails_the_requests_at_once_instead_of_retrying(
        make_runtime: Callable[..., Runtime], tiny_model: Path, tmp_path: Path) -> None:
    # Given a job submitted for a model directory
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    runtime = make_runtime(worker_batch_size=2)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"hello {i}", "max_tokens": 4, "temperature": 0}} for i in range(2)]
    job = submit_batch(runtime, "\n".join(map(json.dumps, lines)).encode(), model=str(model))
    # When its weights disappear before a worker runs it
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    outcome = JobWorker(runtime).process(job.id)
    # Then the worker does not retry: the requests fail, each with the one-line reason, and the job ends failed
    assert outcome.retry is False and outcome == Outcome(more=outcome.more)
    rows = requests_of(runtime, job.id)
    assert [r.status for r in rows] == [RequestStatus.failed] * 2
    assert all("has no *.safetensors weights" in (r.last_error or "") for r in rows)
    assert job_status(runtime, job.id) == "failed"


@pytest.mark.swarm  # the worker joins the (empty) swarm before it reads the tokenizer
def test_an_unexpected_error_in_a_batch_gives_its_requests_back_with_the_reason_until_they_run_out_of_attempts(
        make_runtime: Callable[..., Runtime], tiny_model: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    # Given a job whose tokenizer file is corrupted after submission (a library error the worker does not expect)
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    runtime = make_runtime(worker_batch_size=2, max_attempts=2)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"hello {i}", "max_tokens": 4, "temperature": 0}} for i in range(2)]
    job = submit_batch(runtime, "\n".join(map(json.dumps, lines)).encode(), model=str(model))
    (model / "tokenizer.json").write_text("{not json")
    # When a worker (a process of its own: its own runtime on the same store) runs it
    worker = build_runtime(runtime.settings)
    request.addfinalizer(worker.close)
    outcome = JobWorker(worker).process(job.id)
    # Then the requests go back at once (no lease to wait out), each with the error, and the task retries later
    assert outcome.retry is True
    rows = requests_of(runtime, job.id)
    assert [r.status for r in rows] == [RequestStatus.pending] * 2 and all(r.attempts == 1 for r in rows)
    reasons = {r.last_error for r in rows}
    assert len(reasons) == 1 and reasons != {None}
    # and once they have had their attempts, they fail with that reason, and so does the job
    for _ in range(2):
        JobWorker(worker).process(job.id)
    rows = requests_of(runtime, job.id)
    assert [r.status for r in rows] == [RequestStatus.failed] * 2 and {r.last_error for r in rows} == reasons
    assert job_status(runtime, job.id) == "failed"
