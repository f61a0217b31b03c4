"""The body of POST /v1/batches: a multipart JSONL upload or a JSON body, read into one `Submission`.

Both forms end as JSONL bytes for jobs.submission.submit_batch, so the two paths validate lines identically
(a JSON body's request i is line i + 1). A malformed body raises InvalidJob (400) with a one-line message.
Both read the body whole: jobs.api.limits.BodyLimit bounds it underneath (413), before and while it is read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from pydantic import BaseModel, Field, Json, ValidationError
from starlette.datastructures import FormData, UploadFile

from jobs.errors import InvalidJob

DEFAULT_WINDOW = "24h"
METADATA = "Yours alone: up to 16 pairs of strings, keys up to 64 characters, values up to 512."


class BatchOptions(BaseModel):
    """What both body forms share."""

    model: str = Field(min_length=1, description="Model name or path; every line's body.model must match it.")
    completion_window: str = Field(default=DEFAULT_WINDOW, description="Deadline, like 24h, 90m or 3600s.")


class BatchCreate(BatchOptions):
    """The JSON body: the requests inline, as OpenAI batch request line objects."""

    requests: list[Any] = Field(description='Objects like {"custom_id", "method": "POST", "url", "body"}.')
    metadata: dict[str, Any] | None = Field(default=None, description=METADATA)


class BatchForm(BatchOptions):
    """The multipart form's text fields (the JSONL itself is the `file` field)."""

    metadata: Json[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Submission:
    """A batch to submit, whichever form it came in."""

    data: bytes
    model: str
    completion_window: str
    metadata: dict[str, Any] | None
    filename: str | None


REQUEST_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": {
        "type": "object", "required": ["file", "model"],
        "properties": {
            "file": {"type": "string", "format": "binary", "description": "The JSONL batch, one request a line."},
            "model": {"type": "string"},
            "completion_window": {"type": "string", "default": DEFAULT_WINDOW},
            "metadata": {"type": "string", "description": f"{METADATA} As JSON text."}}}},
    "application/json": {"schema": BatchCreate.model_json_schema()},
}}}


async def read_submission(request: Request) -> Submission:
    """The submission in the request's body, by its content type."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        async with request.form() as form:
            return await _from_form(form)
    if content_type.startswith("application/json"):
        return _from_json(await request.body())
    raise InvalidJob(f"unsupported content type {content_type or 'none'!r}: upload the JSONL as multipart/form-data "
                     "(fields file, model) or send application/json {\"model\", \"requests\"}")


SubmissionDep = Annotated[Submission, Depends(read_submission)]


def _from_json(body: bytes) -> Submission:
    try:
        batch = BatchCreate.model_validate_json(body)
    except ValidationError as e:
        raise InvalidJob(f"the JSON body is not valid: {_summary(e)}") from None
    data = "\n".join(json.dumps(line) for line in batch.requests).encode()
    return Submission(data, batch.model, batch.completion_window, batch.metadata, filename=None)


async def _from_form(form: FormData) -> Submission:
    fields = {name: value for name, value in form.items() if isinstance(value, str) and value != ""}
    try:
        options = BatchForm.model_validate(fields)
    except ValidationError as e:
        raise InvalidJob(f"the form is not valid: {_summary(e)}") from None
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise InvalidJob("the form has no 'file' field: attach the JSONL batch as a file named 'file'")
    data = await upload.read()
    return Submission(data, options.model, options.completion_window, options.metadata, filename=upload.filename)


def _summary(error: ValidationError) -> str:
    """Pydantic's errors on one line: `field: reason; ...`."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in error.errors())
