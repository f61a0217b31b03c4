"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, for every 4xx and 5xx of the API.

`type` is the name of our error (`InvalidJob`, `JobNotFound`, `RequestTooLarge`…), `code` the same in snake case
(`invalid_job`), `param` the request parameter at fault where one is (else null), so the `openai` SDK's exceptions
carry our message (`err.message`, `err.body`, `err.code`, `err.param`).
"""
from __future__ import annotations

import re

from fastapi.responses import JSONResponse

_WORD_START = re.compile(r"(?<!^)(?=[A-Z])")


def snake_case(name: str) -> str:
    """`InvalidJob` -> `invalid_job`."""
    return _WORD_START.sub("_", name).lower()


def error_body(kind: str, message: str, *, param: str | None = None) -> dict[str, dict[str, str | None]]:
    """The body of an error answer."""
    return {"error": {"message": message, "type": kind, "param": param, "code": snake_case(kind)}}


def error_response(status: int, kind: str, message: str, *, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """An error answer with OpenAI's body."""
    return JSONResponse(error_body(kind, message, param=param), status_code=status, headers=headers)
