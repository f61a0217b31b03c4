"""Dependencies of the routes: the runtime, a session per request, the caller's API key, and the operator's guards."""
from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from jobs.errors import InvalidJob
from jobs.models import ApiKey
from jobs.runtime import Runtime
from jobs.settings import Settings
from jobs.store import find_api_key

MISSING_KEY = ("missing API key: send 'Authorization: Bearer KEY'; "
               "create a key with 'swarmbatch keys create NAME'")
UNKNOWN_KEY = "unknown API key, or a revoked one; create a key with 'swarmbatch keys create NAME'"
METRICS_TOKEN = "metrics need 'Authorization: Bearer TOKEN' with the API's SWARMBATCH_METRICS_TOKEN"

bearer = HTTPBearer(auto_error=False, description="A key made by `swarmbatch keys create NAME`.")
metrics_bearer = HTTPBearer(auto_error=False, scheme_name="MetricsToken",
                            description="SWARMBATCH_METRICS_TOKEN, where the operator set one.")


def get_runtime(request: Request) -> Runtime:
    """The runtime that make_app() was given."""
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def get_session(runtime: RuntimeDep) -> Iterator[Session]:
    """A session for this request, closed as soon as the route returns: never held while an answer is sent, so a
    client that reads slowly (or not at all) holds no pooled connection. A streamed answer reads its pages in
    sessions of its own (jobs.db.SessionScope)."""
    with runtime.session() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def get_api_key(runtime: RuntimeDep,
                credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> ApiKey:
    """The caller's key row; 401 without a Bearer key or with an unknown or revoked one (read on every request).

    Read in a session of its own, closed at once: a route reading a body that trickles in holds no connection
    meanwhile (the request's session connects at its first query, once the body is in)."""
    if credentials is None:
        raise _unauthorized(MISSING_KEY)
    with runtime.session() as session:
        key = find_api_key(session=session, key=credentials.credentials)
    if key is None:
        raise _unauthorized(UNKNOWN_KEY)
    return key


def _unauthorized(message: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail=message, headers={"WWW-Authenticate": "Bearer"})


ApiKeyDep = Annotated[ApiKey, Depends(get_api_key)]


def require_metrics_token(runtime: RuntimeDep,
                          credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(metrics_bearer)]) -> None:
    """401 unless SWARMBATCH_METRICS_TOKEN is unset or the caller sends it as a Bearer token."""
    token = runtime.settings.metrics_token
    if token is None:
        return
    sent = credentials.credentials if credentials is not None else ""
    # constant time: how long a wrong guess takes says nothing about how much of it was right
    if not hmac.compare_digest(sent.encode(), token.get_secret_value().encode()):
        raise _unauthorized(METRICS_TOKEN)


def require_served_model(settings: Settings, model: str) -> None:
    """InvalidJob (400) unless the operator lists `model` in SWARMBATCH_API_MODELS (an alias is resolved before).

    Called before anything looks the model up, so the answer is the same for an existing path, a missing one
    and an unknown name: a key holder learns nothing about the server's files.
    """
    if model not in settings.api_models:
        raise InvalidJob(f"model {model!r} is not served here; list the models with GET /v1/models, or ask the "
                         f"operator (SWARMBATCH_API_MODELS, SWARMBATCH_MODEL_ALIASES)")
