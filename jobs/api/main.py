"""`make_app(runtime)`: the FastAPI app of one API process; errors become HTTP statuses in one place."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from jobs.api.docs import add_docs
from jobs.api.error_body import error_response
from jobs.api.limits import BODY_OVERHEAD_BYTES, ApiRefusal, BodyLimit
from jobs.api.metrics import make_registry
from jobs.api.routes import batches, files, health, models, swarm
from jobs.api.send_deadline import deadline_send
from jobs.api.slots import ApiSlots
from jobs.api.ui import add_ui
from jobs.errors import (
    FileNotFound,
    IdempotencyConflict,
    InsufficientQuota,
    InvalidJob,
    JobNotFound,
    JobsError,
    ModelNotFound,
    OutputsExpired,
    StoreUnavailable,
)
from jobs.files import FileTooLarge
from jobs.runtime import Runtime

logger = logging.getLogger(__name__)

DESCRIPTION = """Batch generation on a private swarm, in the shapes of the OpenAI Batch API.

Authenticate with `Authorization: Bearer KEY`; create a key with `swarmbatch keys create NAME`.
A key sees only its own files and jobs. The official `openai` SDK works with only its `base_url` changed:
`files.create(purpose="batch")`, `batches.create(input_file_id=...)`, `batches.retrieve`, `files.content`,
`models.list`, `models.retrieve`.
Every error answer is OpenAI's `{"error": {"message", "type", "param", "code"}}`.
A web view of the key's jobs and the swarm is at `/ui/`."""

# the first class that matches wins: FileTooLarge is an InvalidJob
STATUS_CODES: dict[type[JobsError], int] = {FileTooLarge: 413, JobNotFound: 404, FileNotFound: 404, ModelNotFound: 404,
                                             InvalidJob: 400,
                                             IdempotencyConflict: 409, InsufficientQuota: 429, OutputsExpired: 410,
                                             StoreUnavailable: 503}
HTTP_KINDS = {401: "Unauthorized", 404: "NotFound", 405: "MethodNotAllowed"}


class ApiApp(FastAPI):
    """The FastAPI app whose every HTTP answer is sent under a deadline (jobs.api.send_deadline): the wrapper sits
    outside all of Starlette's middleware, on the server's own `send`."""

    send_deadline_seconds: float | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Every HTTP request with its `send` under the deadline (make_app sets it)."""
        if scope["type"] == "http" and self.send_deadline_seconds is not None:
            send = deadline_send(scope, send, self.send_deadline_seconds)
        await super().__call__(scope, receive, send)


def make_app(runtime: Runtime) -> FastAPI:
    """The app serving `runtime`'s store; the caller owns the runtime (and closes it)."""
    app = ApiApp(title="swarmbatch", version="0.1.0", description=DESCRIPTION, docs_url=None, redoc_url=None)
    app.send_deadline_seconds = runtime.settings.send_deadline_seconds
    app.state.runtime = runtime
    app.state.metrics_registry = make_registry(runtime)
    app.state.slots = ApiSlots.of(runtime.settings)
    app.add_middleware(BodyLimit, max_bytes=runtime.settings.max_file_bytes + BODY_OVERHEAD_BYTES,
                       deadline=runtime.settings.body_deadline_seconds)
    app.add_exception_handler(JobsError, jobs_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(ApiRefusal, refusal_response)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, http_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, unexpected_error_response)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(models.router)
    app.include_router(health.router)
    app.include_router(swarm.router)
    add_docs(app)
    add_ui(app)
    return app


async def jobs_error_response(request: Request, exc: JobsError) -> JSONResponse:
    """OpenAI's error body with the status of the error's class (500 for unmapped ones)."""
    status = next((code for cls, code in STATUS_CODES.items() if isinstance(exc, cls)), 500)
    if status >= 500:
        logger.warning("%s %s -> %d %s: %s", request.method, request.url.path, status, type(exc).__name__, exc)
    return error_response(status, type(exc).__name__, str(exc), param=getattr(exc, "param", None))


async def http_error_response(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own answers (401 without a key, 404 for an unknown route, 405) in OpenAI's error body."""
    kind = HTTP_KINDS.get(exc.status_code, f"Http{exc.status_code}")
    return error_response(exc.status_code, kind, str(exc.detail), headers=getattr(exc, "headers", None))


async def validation_error_response(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A parameter FastAPI refused (`limit=0`, a missing form field) as a 400 naming it."""
    first = exc.errors()[0] if exc.errors() else {}
    where = [str(part) for part in first.get("loc", ())[1:]]
    param = ".".join(where) or None
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
                        for e in exc.errors())
    return error_response(400, "InvalidRequest", message or "the request is not valid", param=param)


async def unexpected_error_response(request: Request, exc: Exception) -> JSONResponse:
    """Anything else: a 500 in OpenAI's error body (the traceback goes to the log, not to the caller)."""
    logger.exception("%s %s -> 500", request.method, request.url.path)
    return error_response(500, "InternalError", f"the server failed on this request ({type(exc).__name__}); "
                                                "retry, and tell the operator if it persists")


async def refusal_response(request: Request, exc: ApiRefusal) -> JSONResponse:
    """An ApiRefusal (429 and the like) in the same error shape, with its headers."""
    return exc.response()
