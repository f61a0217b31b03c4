"""`GET /v1/models` and `GET /v1/models/{id}`: the served models (SWARMBATCH_API_MODELS) and their aliases
(SWARMBATCH_MODEL_ALIASES), in OpenAI's shape `{"id", "object": "model", "created", "owned_by"}`, plus vLLM's
`root`: the served model an id runs."""
from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from jobs.api.deps import ApiKeyDep, RuntimeDep
from jobs.errors import ModelNotFound
from jobs.settings import Settings

router = APIRouter(prefix="/v1/models", tags=["models"])

OWNER = "swarmbatch"
STARTED = int(time.time())  # a model's `created`: the service keeps no date of its own for a model


def model_object(model_id: str, root: str) -> dict[str, Any]:
    """One model object."""
    return {"id": model_id, "object": "model", "created": STARTED, "owned_by": OWNER, "root": root}


def served_models(settings: Settings) -> list[dict[str, Any]]:
    """Every id a batch may name: each served model, followed by its aliases."""
    return [model_object(name, model) for model in settings.api_models
            for name in (model, *settings.aliases_of(model))]


@router.get("")
def list_models(_key: ApiKeyDep, runtime: RuntimeDep) -> dict[str, Any]:
    """The served models and their aliases: `{"object": "list", "data": [model, ...]}`."""
    return {"object": "list", "data": served_models(runtime.settings)}


@router.get("/{model_id:path}", responses={404: {"description": "ModelNotFound: no served model or alias of "
                                                                 "this id."}})
def retrieve_model(model_id: str, _key: ApiKeyDep, runtime: RuntimeDep) -> dict[str, Any]:
    """One served model or alias; 404 in OpenAI's error body for any other id."""
    found = next((model for model in served_models(runtime.settings) if model["id"] == model_id), None)
    if found is None:
        raise ModelNotFound(model_id)
    return found
