"""Annotated dependencies of the routes: the runtime, a session per request, and the caller's API key."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from jobs.models import ApiKey
from jobs.runtime import Runtime
from jobs.store import find_api_key

MISSING_KEY = ("missing API key: send 'Authorization: Bearer KEY'; "
               "create a key with 'swarmbatch keys create NAME'")
UNKNOWN_KEY = "unknown API key; create a key with 'swarmbatch keys create NAME'"

bearer = HTTPBearer(auto_error=False, description="A key made by `swarmbatch keys create NAME`.")


def get_runtime(request: Request) -> Runtime:
    """The runtime that make_app() was given."""
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def get_session(runtime: RuntimeDep) -> Iterator[Session]:
    """A session for this request, closed after the response (streamed ones included) is sent."""
    with runtime.session() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def get_api_key(session: SessionDep,
                credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> ApiKey:
    """The caller's key row; 401 without a Bearer key or with an unknown one."""
    if credentials is None:
        raise _unauthorized(MISSING_KEY)
    key = find_api_key(session=session, key=credentials.credentials)
    if key is None:
        raise _unauthorized(UNKNOWN_KEY)
    return key


def _unauthorized(message: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail=message, headers={"WWW-Authenticate": "Bearer"})


ApiKeyDep = Annotated[ApiKey, Depends(get_api_key)]
