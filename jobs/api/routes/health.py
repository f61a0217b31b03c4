"""`GET /healthz` and `GET /metrics`: liveness of the store and Prometheus metrics, without an API key."""
from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from jobs.api.deps import RuntimeDep

router = APIRouter(tags=["health"])


@router.get("/healthz", responses={503: {"description": "The database is unreachable or not migrated."}})
def healthz(runtime: RuntimeDep) -> dict[str, str]:
    """200 when the database answers and is migrated; 503 (StoreUnavailable) otherwise."""
    runtime.check_store()
    return {"status": "ok"}


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
def metrics(request: Request, runtime: RuntimeDep) -> Response:
    """Job and request counts by status and generated tokens, in the Prometheus text format."""
    runtime.check_store()  # a clean 503 rather than a failed scrape when the database is down
    registry: CollectorRegistry = request.app.state.metrics_registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
