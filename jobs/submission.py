"""Submitting a batch file: validate every line against the model, create the job, enqueue its work."""
from __future__ import annotations

import math
import re
from typing import Any

from jobs.batch_input import BatchFileRejected, InputLimits, parse_batch_file
from jobs.errors import InvalidJob
from jobs.models import Job
from jobs.runtime import Runtime
from jobs.store import create_job
from jobs.worker.celery_app import PROCESS_JOB
from modelprep import ModelPrepError
from swarmclient.errors import ModelDirError

MAX_PARALLEL_TASKS = 8  # tasks in flight per job at submission; each re-enqueues itself while work remains


WINDOW = re.compile(r"(?P<amount>\d{1,7}(?:\.\d{1,6})?)(?P<unit>[hms]?)")
WINDOW_UNITS = {"h": 3600, "m": 60, "s": 1, "": 1}
MAX_WINDOW_SECONDS = 7 * 24 * 3600  # OpenAI accepts 24h; a week is the longest deadline we keep a job for
# the user's metadata, in OpenAI's shape: it is stored and shown back, never read by the service
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def parse_window(value: str) -> int:
    """'24h', '90m', '3600s' or '3600' -> seconds, from 1 s to 7 days; InvalidJob (a 400) otherwise."""
    match = WINDOW.fullmatch(value.strip())
    if match is None:
        raise InvalidJob(f"completion window {value!r} is not a duration like 24h, 90m or 3600s")
    seconds = math.floor(float(match["amount"]) * WINDOW_UNITS[match["unit"]])
    if not 0 < seconds <= MAX_WINDOW_SECONDS:
        raise InvalidJob(f"completion window {value!r} must be between 1s and {MAX_WINDOW_SECONDS // 3600}h (7 days)")
    return seconds


def check_metadata(metadata: object) -> dict[str, str]:
    """The user's metadata as stored: at most 16 pairs of strings, keys up to 64 characters, values up to 512.

    Raises InvalidJob (a 400; nothing is created) with one line naming the first thing wrong.
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise InvalidJob(f"metadata must be an object of string keys and values, not {type(metadata).__name__}")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidJob(f"metadata may hold at most {MAX_METADATA_PAIRS} pairs, not {len(metadata)}")
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise InvalidJob(f"metadata keys must be strings, not {type(key).__name__}")
        if len(key) > MAX_METADATA_KEY:
            raise InvalidJob(f"metadata key {_clip(key)!r} is longer than {MAX_METADATA_KEY} characters")
        if not isinstance(value, str):
            raise InvalidJob(f"metadata value of {key!r} must be a string, not {type(value).__name__}")
        if len(value) > MAX_METADATA_VALUE:
            raise InvalidJob(f"metadata value of {key!r} is longer than {MAX_METADATA_VALUE} characters")
    return dict(metadata)


def _clip(value: object, length: int = 20) -> str:
    text = str(value)
    return text if len(text) <= length else text[:length] + "..."


def submit_batch(runtime: Runtime, data: bytes, *, model: str, filename: str | None = None,
                 api_key_id: int | None = None, completion_window: str = "24h",
                 metadata: dict[str, Any] | None = None, idempotency_key: str | None = None) -> Job:
    """Parse and store a JSONL batch, then enqueue it; raises InvalidJob (nothing created) if anything is refused.

    Refused: a window or metadata out of bounds, an unusable model, a file without one usable line.
    """
    window = parse_window(completion_window)
    metadata = check_metadata(metadata)
    try:
        tokenizer = runtime.tokenizer(model)
        context = runtime_context_length(runtime, model)
    except (ModelPrepError, ModelDirError) as e:
        raise InvalidJob(str(e)) from e
    limits = InputLimits(max_file_bytes=runtime.settings.max_file_bytes, max_lines=runtime.settings.max_lines,
                         max_tokens_cap=runtime.settings.max_tokens_cap, context_length=context)
    try:
        parsed = parse_batch_file(data, tokenizer=tokenizer, model_name=model, limits=limits)
    except BatchFileRejected as e:
        raise InvalidJob(str(e)) from e
    with runtime.session() as session:
        job = create_job(session=session, parsed=parsed, model=model, api_key_id=api_key_id,
                         completion_window_s=window, checkpoint_every=runtime.settings.checkpoint_every,
                         input_filename=filename, metadata=metadata, idempotency_key=idempotency_key)
        session.commit()
    enqueue_job(runtime, job.id, tasks=math.ceil(len(parsed.requests) / runtime.settings.worker_batch_size))
    return job


def runtime_context_length(runtime: Runtime, model: str) -> int:
    """The model's context length, from its config."""
    from swarmclient.model_spec import ModelSpec

    return ModelSpec.open(runtime.model_dir(model)).max_length


def enqueue_job(runtime: Runtime, job_id: str, *, tasks: int = 1, countdown: float = 0.0) -> None:
    """Send `tasks` process_job messages (ids only) for a job."""
    for _ in range(max(1, min(tasks, MAX_PARALLEL_TASKS))):
        runtime.celery.send_task(PROCESS_JOB, args=[job_id], countdown=countdown or None)
