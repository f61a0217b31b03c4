"""`/v1/files`: OpenAI's Files API for batches: upload (purpose `batch`), list, inspect, read and delete a key's files.

A job's output and error files (purpose `batch_output`) appear here too once the job ends; their content is its
output or error lines, streamed from the store (jobs.files). Uploads count against the key's quota (jobs.quotas)
and expire (jobs.retention); uploads and downloads in progress are bounded per key (jobs.api.slots).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from starlette.datastructures import UploadFile

from jobs import files
from jobs import retention as retention_rules
from jobs.api.batch_request import form_object
from jobs.api.deps import ApiKeyDep, RuntimeDep, SessionDep
from jobs.api.routes.batches import page
from jobs.api.slots import DownloadSlotDep, UploadSlotDep
from jobs.errors import InvalidJob
from jobs.models import FilePurpose, utcnow
from jobs.quotas import Quota

router = APIRouter(prefix="/v1/files", tags=["files"])

Responses = dict[int | str, dict[str, Any]]
NOT_FOUND: Responses = {404: {"description": "FileNotFound: no such file for this API key."}}
UPLOAD_ERRORS: Responses = {
    400: {"description": "InvalidJob: no `file` field, a purpose other than `batch`, or a bad `expires_after`."},
    408: {"description": "RequestTimeout: the body did not arrive within SWARMBATCH_BODY_DEADLINE_SECONDS."},
    413: {"description": "FileTooLarge / RequestTooLarge: the file is over SWARMBATCH_MAX_FILE_BYTES."},
    429: {"description": "TooManyUploads: SWARMBATCH_MAX_UPLOADS_PER_KEY of this key are in progress; retry after "
                         "Retry-After seconds. InsufficientQuota: the key keeps as many files or bytes as it may."}}
UPLOAD_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary", "description": "A JSONL batch, one request a line."},
                   "purpose": {"type": "string", "enum": ["batch"]},
                   "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                   "expires_after[seconds]": {"type": "integer", "description": "3600 to 2592000: the file is "
                                              "deleted this long after the upload (the operator's retention "
                                              "bounds it)."}}}}}}}


@dataclass(frozen=True)
class UploadForm:
    """The multipart form of an upload: the file (spooled by Starlette, read here in pieces), its purpose, and the
    seconds after which it expires, if it says (OpenAI's `expires_after`)."""

    upload: UploadFile
    purpose: str
    expires_after_s: int | None


async def read_upload_form(request: Request) -> AsyncIterator[UploadForm]:
    """The form, open until the route has stored the file (BodyLimit bounds the body underneath: 413)."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidJob("upload the file as multipart/form-data with fields 'file' and 'purpose'", param="file")
    async with request.form() as form:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise InvalidJob("the form has no 'file' field: attach the JSONL batch as a file named 'file'",
                             param="file")
        if purpose != FilePurpose.batch:
            raise InvalidJob(f"purpose must be 'batch' (got {purpose!r}); this service stores batch inputs only",
                             param="purpose")
        fields = {name: value for name, value in form.items() if isinstance(value, str)}
        asked = retention_rules.asked_seconds(form_object(fields, "expires_after"), "expires_after")
        yield UploadForm(upload, str(purpose), asked)


UploadFormDep = Annotated[UploadForm, Depends(read_upload_form, scope="function")]


@router.post("", openapi_extra=UPLOAD_BODY, responses=UPLOAD_ERRORS)
def create_file(key: ApiKeyDep, _slot: UploadSlotDep, form: UploadFormDep, session: SessionDep,
                runtime: RuntimeDep) -> dict[str, Any]:
    """Upload a batch input file (purpose `batch`); it is checked line by line when a batch is created from it.

    With `expires_after` (`{"anchor": "created_at", "seconds": N}`, as the openai SDK sends it) the file is deleted
    N seconds after the upload; without, after the operator's SWARMBATCH_UPLOAD_RETENTION_SECONDS (the shorter wins).
    """
    reader, settings = form.upload.file, runtime.settings
    kept_s = retention_rules.retention(form.expires_after_s, settings.upload_retention_seconds)
    row = files.store_upload(session=session, pieces=iter(lambda: reader.read(files.CHUNK_BYTES), b""),
                             filename=form.upload.filename or "upload.jsonl", api_key_id=key.id,
                             max_bytes=settings.max_file_bytes, quota=Quota.of(settings),
                             expires_after_s=kept_s)
    session.commit()
    return files.file_public(row)


@router.get("")
def list_files(session: SessionDep, key: ApiKeyDep, limit: int = Query(default=20, ge=1, le=10_000),
               after: str | None = Query(default=None, description="A file id: the page starts after it."),
               purpose: FilePurpose | None = None) -> dict[str, Any]:
    """The key's files, newest first, a page at a time (`after` the last id of the previous page)."""
    rows, has_more = files.list_files(session=session, api_key_id=key.id, limit=limit, after=after,
                                      purpose=purpose)
    return page([files.file_public(row) for row in rows], has_more)


@router.get("/{file_id}", responses=NOT_FOUND)
def get_file(file_id: str, session: SessionDep, key: ApiKeyDep) -> dict[str, Any]:
    """One file object."""
    return files.file_public(files.get_file(session=session, file_id=file_id, api_key_id=key.id))


@router.get("/{file_id}/content", response_class=StreamingResponse,
            responses={**NOT_FOUND, 200: {"content": {"application/octet-stream": {}}}, 429: {
                "description": "TooManyDownloads: SWARMBATCH_MAX_DOWNLOADS_PER_KEY of this key are streaming; "
                               "retry after Retry-After seconds."}})
def get_file_content(file_id: str, session: SessionDep, key: ApiKeyDep, slot: DownloadSlotDep,
                     runtime: RuntimeDep) -> StreamingResponse:
    """The file's bytes, streamed (each piece read in a short session of its own): an upload as stored, or a job's
    output or error lines."""
    row = files.get_file(session=session, file_id=file_id, api_key_id=key.id)
    return slot.stream(files.iter_content(sessions=runtime.session, row=row), media_type="application/octet-stream")


@router.delete("/{file_id}", responses=NOT_FOUND)
def delete_file(file_id: str, session: SessionDep, key: ApiKeyDep) -> dict[str, Any]:
    """Delete a file: an upload (batches made from it keep their requests), or a batch's output or error file (both go,
    with the batch's outputs: its results and errors answer 410 from then on)."""
    row = files.get_file(session=session, file_id=file_id, api_key_id=key.id)
    retention_rules.delete_file(session=session, row=row, now=utcnow())
    session.commit()
    return {"id": file_id, "object": "file", "deleted": True}
