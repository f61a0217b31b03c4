"""`make_app(runtime)`: the FastAPI app of one API process; errors become HTTP statuses in one place."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from jobs.api.limits import BODY_OVERHEAD_BYTES, ApiRefusal, BodyLimit, SubmissionSlots
from jobs.api.metrics import make_registry
from jobs.api.routes import batches, health
from jobs.errors import IdempotencyConflict, InvalidJob, JobNotFound, JobsError, StoreUnavailable
from jobs.runtime import Runtime

logger = logging.getLogger(__name__)

DESCRIPTION = """Batch generation on a private swarm, in the shapes of the OpenAI Batch API.

Authenticate with `Authorization: Bearer KEY`; create a key with `swarmbatch keys create NAME`.
A key sees only its own jobs."""

STATUS_CODES: dict[type[JobsError], int] = {JobNotFound: 404, InvalidJob: 400, IdempotencyConflict: 409,
                                             StoreUnavailable: 503}


def make_app(runtime: Runtime) -> FastAPI:
    """The app serving `runtime`'s store; the caller owns the runtime (and closes it)."""
    app = FastAPI(title="swarmbatch", version="0.1.0", description=DESCRIPTION)
    app.state.runtime = runtime
    app.state.metrics_registry = make_registry(runtime)
    app.state.submission_slots = SubmissionSlots(runtime.settings.max_concurrent_submissions)
    app.add_middleware(BodyLimit, max_bytes=runtime.settings.max_file_bytes + BODY_OVERHEAD_BYTES)
    app.add_exception_handler(JobsError, jobs_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(ApiRefusal, refusal_response)  # type: ignore[arg-type]
    app.include_router(batches.router)
    app.include_router(health.router)
    return app


async def jobs_error_response(request: Request, exc: JobsError) -> JSONResponse:
    """`{"error": {"type", "message"}}` with the status of the error's class (500 for unmapped ones)."""
    status = next((code for cls, code in STATUS_CODES.items() if isinstance(exc, cls)), 500)
    if status >= 500:
        logger.warning("%s %s -> %d %s: %s", request.method, request.url.path, status, type(exc).__name__, exc)
    return JSONResponse({"error": {"type": type(exc).__name__, "message": str(exc)}}, status_code=status)


async def refusal_response(request: Request, exc: ApiRefusal) -> JSONResponse:
    """An ApiRefusal (429 and the like) in the same error shape, with its headers."""
    return exc.response()
