"""`swarmbatch run FILE.jsonl`: a user's own OpenAI batch file, end to end on the embedded stack (launch.embedded).

It submits the file to the embedded store, starts a local swarm of the model and a worker, follows the job with a
progress bar, writes the results (the results endpoint's lines) and the error lines beside each other, and stops
everything it started. The lines may name any model (say gpt-4o-mini): here it is an alias of the model run.

Resuming: a file's jobs carry an idempotency key `run:<sha256 of model and bytes>:<nonce>`. A run finds the newest
job of the same model and bytes; one still open (an interrupted run) is resumed, keeping its finished lines and
checkpointed tokens; a completed one is not run again, its outputs are written again; one that failed, was
cancelled or expired, or `fresh=True`, gives way to a new job. An edited file is a new job.
"""
from __future__ import annotations

import hashlib
import shlex
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs import store
from jobs.assembly import build_runtime
from jobs.backends import StoreBackend
from jobs.batch_input import batch_model
from jobs.models import JobStatus
from jobs.progress import follow_job
from jobs.runtime import Runtime
from jobs.settings import Settings, get_settings
from jobs.submission import submit_batch
from launch.embedded import describe_spans, embedded_stack, two_spans
from launch.errors import RunInterrupted
from launch.local_worker import require_running
from modelprep import prepare_model
from modelprep.prepare import SMOLLM2_NAME

RESUMABLE = {JobStatus.validating, JobStatus.in_progress, JobStatus.finalizing}
Echo = Callable[[str], None]


@dataclass(frozen=True)
class RunRequest:
    """What the user asked: the input file, the model, where the results go, and whether to start anew."""

    file: Path
    model: str = SMOLLM2_NAME
    output: Path | None = None
    fresh: bool = False

    @property
    def results(self) -> Path:
        """-o, or `<name>.results.jsonl` beside the input."""
        return self.output or self.file.with_name(f"{self.file.stem}.results.jsonl")

    @property
    def errors(self) -> Path:
        """`<name>.errors.jsonl` beside the results."""
        return self.results.with_name(f"{self.results.stem.removesuffix('.results')}.errors.jsonl")

    def command(self) -> str:
        """The command line that runs this request again (the resume hint)."""
        words = ["swarmbatch", "run", str(self.file)]
        words += ["--model", self.model] if self.model != SMOLLM2_NAME else []
        words += ["-o", str(self.output)] if self.output is not None else []
        return shlex.join(words)


@dataclass(frozen=True)
class RunOutcome:
    """The job as it ended, the result and error lines written, and the run's wall time."""

    job: dict[str, Any]
    results: int
    errors: int
    seconds: float


def run_file(request: RunRequest, echo: Echo) -> RunOutcome:
    """Run the file's batch to its end (or resume it); raises RunInterrupted on Ctrl-C, with everything stopped."""
    began = time.perf_counter()
    data = request.file.read_bytes()
    settings = get_settings()
    try:
        echo(f"Preparing {request.model}...")
        model_dir = prepare_model(request.model, cache_dir=settings.models_dir)
    except KeyboardInterrupt:
        raise RunInterrupted(f"interrupted before the job was stored: run '{request.command()}' to start it") from None
    model = request.model if request.model == SMOLLM2_NAME else str(model_dir)
    runtime = build_runtime(with_file_model(settings, data, model, echo))
    job_id: str | None = None
    try:
        client = StoreBackend(runtime)  # migrates the embedded store before the worker opens it
        job_id = job_of_file(runtime, request, data, model, echo)
        job = client.get(job_id)
        if job["status"] != JobStatus.completed:
            job = generate(runtime, client, job_id, model_dir, echo, resume=request.command())
        results, errors = write_outputs(client, job_id, request)
    except KeyboardInterrupt:
        raise interrupted(runtime, job_id, request) from None
    finally:
        runtime.close()
    return RunOutcome(job, results, errors, time.perf_counter() - began)


def with_file_model(settings: Settings, data: bytes, model: str, echo: Echo) -> Settings:
    """The settings under which the model the file's lines name is an alias of `model` (when they name another)."""
    named = batch_model(data)
    if named is None or named == model:
        return settings
    echo(f"The lines name model {named!r}: running them on {model}")
    return settings.model_copy(update={"api_models": [*dict.fromkeys([*settings.api_models, model])],
                                       "model_aliases": {**settings.model_aliases, named: model}})


def file_key(model: str, data: bytes) -> str:
    """The idempotency-key prefix of this file's jobs on this model."""
    digest = hashlib.sha256(model.encode() + b"\n" + data).hexdigest()
    return f"run:{digest}:"


def job_of_file(runtime: Runtime, request: RunRequest, data: bytes, model: str, echo: Echo) -> str:
    """The id of the job to run: this file's open or completed job, else a new one (validated here, in one line)."""
    key = file_key(model, data)
    with runtime.session() as session:
        earlier = None if request.fresh else store.latest_job_keyed(session=session, key_prefix=key)
        found = (earlier.id, earlier.status) if earlier is not None else None
    if found is not None and found[1] == JobStatus.completed:
        echo(f"This file already ran: job {found[0]} completed; writing its outputs again (--fresh runs it anew)")
        return found[0]
    if found is not None and found[1] in RESUMABLE:
        echo(f"Resuming job {found[0]} of this file ({found[1]})")
        return found[0]
    if found is not None:
        echo(f"Job {found[0]} of this file ended {found[1]}: starting a new one")
    job = submit_batch(runtime, data, model=model, filename=request.file.name, idempotency_key=key + uuid.uuid4().hex[:12])
    echo(f"Job {job.id}: {len(job.line_errors)} bad input lines" if job.line_errors else f"Job {job.id} stored")
    return job.id


def generate(runtime: Runtime, client: StoreBackend, job_id: str, model_dir: Path, echo: Echo, *,
             resume: str) -> dict[str, Any]:
    """Start the embedded stack, follow the job until it ends, stop the stack; returns the job as it ended.
    `resume`: the command that resumes the job if the worker dies."""
    log_dir = runtime.settings.home / "run-logs" / job_id
    echo(f"Starting a DHT node, two block servers ({describe_spans(two_spans(model_dir))}) and a worker on "
         f"127.0.0.1; logs in {log_dir}")
    with embedded_stack(runtime, model_dir, log_dir=log_dir) as worker:
        hint = f"run '{resume}' again to resume it"
        return follow_job(client, job_id, check_alive=lambda: require_running(worker, resume=hint))


def write_outputs(client: StoreBackend, job_id: str, request: RunRequest) -> tuple[int, int]:
    """Write the result lines, and the error lines when there are any; returns how many of each."""
    results = write_lines(request.results, client.results(job_id))
    errors = list(client.errors(job_id))
    if errors:
        write_lines(request.errors, errors)
    else:  # an errors file of an earlier run of this file would contradict "no error lines"
        request.errors.unlink(missing_ok=True)
    return results, len(errors)


def write_lines(path: Path, lines: Iterable[str]) -> int:
    """Write JSONL through a temporary file beside it (a reader never sees half a file); returns the line count."""
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    with tmp.open("w") as out:
        for line in lines:
            out.write(line)
            count += 1
    tmp.replace(path)
    return count


def interrupted(runtime: Runtime, job_id: str | None, request: RunRequest) -> RunInterrupted:
    """The one line saying that Ctrl-C stopped everything this run started, and how to go on."""
    if job_id is None:
        return RunInterrupted(f"interrupted before the job was stored: run '{request.command()}' to start it")
    counts = StoreBackend(runtime).get(job_id)["request_counts"]
    done = counts["completed"] + counts["failed"]
    return RunInterrupted(f"every process this run started is stopped; job {job_id} keeps {done}/"
                          f"{counts['total']} requests done in {runtime.settings.home}: run '{request.command()}' "
                          "again to resume it")
