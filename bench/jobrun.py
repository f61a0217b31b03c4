"""What the job benchmarks share: running one job to completion with the worker's own code path, in process."""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from sqlalchemy import select

from jobs.models import Request
from jobs.runtime import Runtime
from jobs.store import job_counts
from jobs.submission import submit_batch
from jobs.worker.job_worker import JobWorker
from modelprep import prepare_model, write_tiny_model


def job_bench_parser(description: str, *, requests: int, max_tokens: int, batch_size: int, reps: int
                     ) -> argparse.ArgumentParser:
    """The options every job benchmark takes, with its own defaults."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--batch-size", type=int, default=batch_size, help="requests a worker claims at once")
    parser.add_argument("--reps", type=int, default=reps)
    return parser


def bench_setup(model: str) -> tuple[Path, Path]:
    """(a fresh home folder, the prepared model dir: "tiny" is a 6-layer random model written there); one torch
    thread in this (client) process."""
    torch.set_num_threads(1)
    home = Path(tempfile.mkdtemp(prefix="swarmbatch-bench-"))
    if model == "tiny":
        return home, write_tiny_model(home / "tiny", layers=6, seed=1)
    cache = Path(os.environ.get("SWARMBATCH_HOME", Path.home() / ".swarmbatch")) / "models"
    return home, prepare_model(model, cache_dir=cache)


def run_job(runtime: Runtime, model: str, data: bytes) -> tuple[float, int, dict[str, str]]:
    """(seconds, generated tokens, output text by custom_id) of one job, claimed batch after batch, no Celery."""
    job = submit_batch(runtime, data, model=model)
    began = time.perf_counter()
    worker = JobWorker(runtime)
    while worker.process(job.id).more:
        pass
    seconds = time.perf_counter() - began
    with runtime.session() as session:
        counts = job_counts(session=session, job_id=job.id)
        texts = {r.custom_id: r.output_text or ""
                 for r in session.scalars(select(Request).where(Request.job_id == job.id))}
    assert counts.completed == counts.total, counts
    return seconds, counts.tokens, texts
