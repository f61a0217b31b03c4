"""The body of POST /v1/batches, as one Submission: OpenAI's JSON `{"input_file_id", "endpoint",
"completion_window", "metadata"}` (a file uploaded to /v1/files), or ours: a multipart JSONL upload or a JSON body
with the requests inline.

Every form ends as a JSONL file for jobs.submission.submit_unchecked, so a worker checks all lines alike (a JSON
body's request i is line i + 1). A malformed body raises InvalidJob (400) with a one-line message naming the
parameter. jobs.api.limits.BodyLimit bounds bodies underneath (413), before and while they are read. A multipart
upload is spooled to disk by Starlette and read from there in pieces, never whole; a JSON body is parsed whole (it
is meant for small batches: upload a big one as a file).
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from pydantic import BaseModel, Field, Json, ValidationError
from starlette.datastructures import FormData, UploadFile

from jobs.batch_input import URLS
from jobs.errors import InvalidJob
from jobs.files import CHUNK_BYTES
from jobs.submission import Pieces

DEFAULT_WINDOW = "24h"
METADATA = "Yours alone: up to 16 pairs of strings, keys up to 64 characters, values up to 512."
EXPIRES = ('OpenAI\'s {"anchor": "created_at", "seconds": 3600 to 2592000}: the output and error files (and the '
           "outputs in the store) are deleted this long after they are made; the operator's retention bounds it.")


class BatchOptions(BaseModel):
    """What both body forms share."""

    model: str = Field(min_length=1, description="Model name or path; every line's body.model must match it.")
    completion_window: str = Field(default=DEFAULT_WINDOW, description="Deadline, like 24h, 90m or 3600s.")


class BatchCreate(BatchOptions):
    """The JSON body: the requests inline, as OpenAI batch request line objects."""

    requests: list[Any] = Field(description='Objects like {"custom_id", "method": "POST", "url", "body"}.')
    metadata: dict[str, Any] | None = Field(default=None, description=METADATA)
    output_expires_after: dict[str, Any] | None = Field(default=None, description=EXPIRES)


class BatchFromFile(BaseModel):
    """OpenAI's batches.create body: the batch is a file uploaded with purpose `batch`; the model is its lines'."""

    input_file_id: str = Field(min_length=1, description="A file of yours uploaded to /v1/files (purpose batch).")
    endpoint: str = Field(description=f"One of {', '.join(URLS)}; every line's url must be it.")
    completion_window: str = Field(default=DEFAULT_WINDOW, description="24h (OpenAI's), or a duration like 90m.")
    metadata: dict[str, Any] | None = Field(default=None, description=METADATA)
    output_expires_after: dict[str, Any] | None = Field(default=None, description=EXPIRES)


class BatchForm(BatchOptions):
    """The multipart form's text fields (the JSONL itself is the `file` field)."""

    metadata: Json[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Submission:
    """A batch to submit, whichever form it came in: its bytes (in pieces) and model, or (OpenAI's form) the file
    they are in."""

    pieces: Pieces | None
    model: str | None
    completion_window: str
    metadata: dict[str, Any] | None
    filename: str | None
    input_file_id: str | None = None
    endpoint: str | None = None
    output_expires_after: dict[str, Any] | None = None


REQUEST_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": {
        "type": "object", "required": ["file", "model"],
        "properties": {
            "file": {"type": "string", "format": "binary", "description": "The JSONL batch, one request a line."},
            "model": {"type": "string"},
            "completion_window": {"type": "string", "default": DEFAULT_WINDOW},
            "metadata": {"type": "string", "description": f"{METADATA} As JSON text."},
            "output_expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
            "output_expires_after[seconds]": {"type": "integer", "description": EXPIRES}}}},
    "application/json": {"schema": {"oneOf": [BatchFromFile.model_json_schema(), BatchCreate.model_json_schema()]}},
}}}


async def read_submission(request: Request) -> AsyncIterator[Submission]:
    """The submission in the request's body, by its content type (an uploaded file open until the route returns)."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        async with request.form() as form:
            yield _from_form(form)
        return
    if content_type.startswith("application/json"):
        yield _from_json(await request.body())
        return
    raise InvalidJob(f"unsupported content type {content_type or 'none'!r}: upload the JSONL as multipart/form-data "
                     "(fields file, model) or send application/json {\"input_file_id\", \"endpoint\"} or "
                     "{\"model\", \"requests\"}")


SubmissionDep = Annotated[Submission, Depends(read_submission, scope="function")]


def _from_json(body: bytes) -> Submission:
    try:
        if b'"input_file_id"' in body:
            return _from_file(BatchFromFile.model_validate_json(body))
        batch = BatchCreate.model_validate_json(body)
    except ValidationError as e:
        raise InvalidJob(f"the JSON body is not valid: {_summary(e)}", param=_param(e)) from None
    data = "\n".join(json.dumps(line) for line in batch.requests).encode()
    return Submission(lambda: [data], batch.model, batch.completion_window, batch.metadata, filename=None,
                      output_expires_after=batch.output_expires_after)


def _from_form(form: FormData) -> Submission:
    fields = {name: value for name, value in form.items() if isinstance(value, str) and value != ""}
    try:
        options = BatchForm.model_validate(fields)
    except ValidationError as e:
        raise InvalidJob(f"the form is not valid: {_summary(e)}", param=_param(e)) from None
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise InvalidJob("the form has no 'file' field: attach the JSONL batch as a file named 'file'", param="file")
    return Submission(_pieces_of(upload), options.model, options.completion_window, options.metadata, filename=upload.filename,
                      output_expires_after=form_object(fields, "output_expires_after"))


def _pieces_of(upload: UploadFile) -> Pieces:
    """The spooled upload's bytes, read from its start in pieces at each call."""
    def pieces() -> Iterator[bytes]:
        upload.file.seek(0)
        return iter(lambda: upload.file.read(CHUNK_BYTES), b"")
    return pieces


def _from_file(batch: BatchFromFile) -> Submission:
    if batch.endpoint not in URLS:
        raise InvalidJob(f"endpoint must be {' or '.join(URLS)} (got {batch.endpoint!r}); this service runs no "
                         f"other endpoint", param="endpoint")
    return Submission(None, None, batch.completion_window, batch.metadata, filename=None,
                      input_file_id=batch.input_file_id, endpoint=batch.endpoint,
                      output_expires_after=batch.output_expires_after)


def form_object(fields: dict[str, str], name: str) -> dict[str, Any] | None:
    """An object sent in a form as `name[key]` fields (how the openai SDK sends one), or as JSON text in `name`;
    None when absent."""
    if name in fields:
        try:
            value = json.loads(fields[name])
        except json.JSONDecodeError:
            raise InvalidJob(f"{name} must be a JSON object or {name}[key] fields", param=name) from None
        return value if isinstance(value, dict) else {"": value}
    prefix = f"{name}["
    found = {key[len(prefix):-1]: value for key, value in fields.items() if key.startswith(prefix) and key.endswith("]")}
    return found or None


def _param(error: ValidationError) -> str | None:
    """The first field pydantic refused, dotted."""
    first = error.errors()[0] if error.errors() else None
    return (".".join(str(p) for p in first["loc"]) or None) if first else None


def _summary(error: ValidationError) -> str:
    """Pydantic's errors on one line: `field: reason; ...`."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in error.errors())
