"""`GET /v1/swarm`: what the workers last saw of the served models' swarms (the API never joins the swarm)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from jobs import snapshots
from jobs.api.deps import ApiKeyDep, RuntimeDep, SessionDep

router = APIRouter(prefix="/v1/swarm", tags=["swarm"])


@router.get("", responses={401: {"description": "No API key, or an unknown one."}})
def get_swarm(session: SessionDep, key: ApiKeyDep, runtime: RuntimeDep) -> dict[str, Any]:
    """Per served model (SWARMBATCH_API_MODELS) that a worker has looked at: the coverage map of its blocks as the
    worker saw it `age_seconds` ago: each block's servers with their state, announced throughput, free cache tokens and
    the round trip the worker measured; and the block ranges no server holds (`missing`).

    Workers publish it while they run jobs, at most every SWARMBATCH_SWARM_SNAPSHOT_SECONDS; a model no worker has
    run a job of since the store was made is not listed.
    """
    models = list(runtime.settings.api_models)
    return {"object": "list", "models": models, "data": snapshots.read_snapshots(session=session, models=models)}
