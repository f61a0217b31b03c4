"""`swarmbatch demo`: the main job, embedded — SQLite store, SQLite broker, a local swarm, one worker.

It summarizes the sample documents shipped in `launch/sample_documents/` (package data, so also found in a
non-editable install, e.g. the Docker image; `samples/documents` links there) through the whole product: a batch job
in the OpenAI format, a Celery worker generating through two block servers, checkpoints in SQL. The processes are
launch.embedded's stack, which `swarmbatch run` starts for a user's own file.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from jobs.assembly import build_runtime
from jobs.backends import StoreBackend
from jobs.progress import follow_job
from jobs.settings import get_settings
from jobs.submission import submit_batch
from launch.embedded import describe_spans, embedded_stack, two_spans
from launch.local_worker import require_running
from modelprep import prepare_model

SAMPLES = Path(__file__).resolve().parent / "sample_documents"
PROMPT = "Summarize the following text in one sentence.\n\n{text}"
MODEL = "smollm2"


def sample_documents() -> list[Path]:
    """The documents shipped with the repository."""
    return sorted(SAMPLES.glob("*.txt"))


def summarization_batch(docs: list[Path], *, max_tokens: int) -> bytes:
    """One chat request per document, in the OpenAI batch format."""
    lines = [json.dumps({"custom_id": doc.name, "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": PROMPT.format(text=doc.read_text().strip())}],
                                  "max_tokens": max_tokens, "temperature": 0}}) for doc in docs]
    return ("\n".join(lines) + "\n").encode()


def run_demo(echo: Callable[[str], None], *, max_tokens: int = 64) -> None:
    """Prepare SmolLM2, start a DHT, two servers (15 blocks each) and a worker, run the job, stop everything."""
    settings = get_settings()
    began = time.perf_counter()
    echo("Preparing SmolLM2-135M-Instruct (converted once from its PyPI wheel, then cached)...")
    model_dir = prepare_model(MODEL, cache_dir=settings.models_dir)
    runtime = build_runtime(settings)
    client = StoreBackend(runtime)  # migrates the embedded store before the worker opens it
    log_dir = settings.home / "demo-logs"
    echo(f"Starting a DHT node and two block servers ({describe_spans(two_spans(model_dir))}) on 127.0.0.1...")
    try:
        with embedded_stack(runtime, model_dir, log_dir=log_dir) as worker:
            docs = sample_documents()
            job = submit_batch(runtime, summarization_batch(docs, max_tokens=max_tokens), model=MODEL,
                               filename="samples/documents")
            echo(f"Swarm ready in {time.perf_counter() - began:.1f} s. Job {job.id}: {len(docs)} documents")
            job_began = time.perf_counter()
            final = follow_job(client, job.id, check_alive=lambda: require_running(worker))
            seconds = time.perf_counter() - job_began
            results = [json.loads(line) for line in client.results(job.id)]
    finally:
        runtime.close()
    for line in results:
        echo(f"\n{line['custom_id']}:\n  {line['response']['body']['choices'][0]['message']['content'].strip()}")
    echo(f"\nJob {final['status']}: {final['tokens_generated']} tokens in {seconds:.1f} s = "
         f"{final['tokens_generated'] / seconds:.1f} tokens/s; total wall time {time.perf_counter() - began:.1f} s. "
         f"All processes stopped. Logs: {log_dir}")
