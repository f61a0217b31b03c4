"""`GET /healthz` and `GET /metrics` (no API key; SWARMBATCH_METRICS_TOKEN where set): store liveness, Prometheus."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from jobs.api.deps import RuntimeDep, require_metrics_token

router = APIRouter(tags=["health"])


@router.get("/healthz", responses={503: {"description": "The database is unreachable or not migrated."}})
def healthz(runtime: RuntimeDep) -> dict[str, str]:
    """200 when the database answers and is migrated; 503 (StoreUnavailable) otherwise."""
    runtime.check_store()
    return {"status": "ok"}


@router.get("/metrics", response_class=Response, dependencies=[Depends(require_metrics_token)],
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}},
                       401: {"description": "SWARMBATCH_METRICS_TOKEN is set and the Bearer token is not it."},
                       503: {"description": "The database is unreachable or not migrated."}})
def metrics(request: Request) -> Response:
    """Job and request counts by status and generated tokens, in the Prometheus text format (reused for a few s)."""
    registry: CollectorRegistry = request.app.state.metrics_registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
