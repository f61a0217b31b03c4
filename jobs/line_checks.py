"""What every check of a batch line shares (LineProblem, how values are shown), and the chat messages' checks.

Messages, as OpenAI takes them: roles system, developer (OpenAI's newer name for system: rendered as system), user
and assistant; content a string or a list of text parts (`[{"type": "text", "text": ...}]`, joined with newlines,
as vLLM joins them). An image, audio or file part is an `unsupported_content` line error naming the part's type.
"""
from __future__ import annotations

import json
from typing import Any

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
EMBEDDINGS_URL = "/v1/embeddings"
RESPONSES_URL = "/v1/responses"
ROLES = ("system", "developer", "user", "assistant")
TEMPLATE_ROLES = {"developer": "system"}  # roles chat templates do not know, as the role they render as
MEDIA_PARTS = ("image_url", "input_audio", "file", "image", "audio")  # parts of models that see or hear
SHOWN_VALUE_CHARS = 60


class LineProblem(Exception):
    """Raised inside the line checks: a stable code and a one-line reason."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """The chat messages, reduced to a role the chat template knows and string content."""
    value = body.get("messages")
    if value is None or value == []:
        raise LineProblem("missing_messages", f"body.messages must be a non-empty list of "
                                              f"{{role, content}} for {CHAT_URL}", "body.messages")
    if not isinstance(value, list):
        raise LineProblem("invalid_messages", f"body.messages must be a list, not {json_type(value)}",
                          "body.messages")
    return [_message(index, message) for index, message in enumerate(value)]


def _message(index: int, message: Any) -> dict[str, str]:
    """One chat message: a known role and non-empty content (a string or text parts)."""
    where = f"body.messages[{index}]"
    if not isinstance(message, dict):
        raise LineProblem("invalid_messages", f"messages[{index}] must be an object, not {json_type(message)}",
                          where)
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise LineProblem("invalid_messages", f"messages[{index}].role must be one of {', '.join(ROLES)} "
                                              f"(got {show(role)})", f"{where}.role")
    text = _parts_text(index, content) if isinstance(content, list) else content
    if not isinstance(text, str) or not text:
        raise LineProblem("invalid_messages", f"messages[{index}].content must be a non-empty string or a list "
                                              f"of text parts (got {show(content)})", f"{where}.content")
    return {"role": TEMPLATE_ROLES.get(str(role), str(role)), "content": text}


def _parts_text(index: int, parts: list[Any]) -> str:
    """The text of a content given as parts, joined with newlines; a part that is not text is refused."""
    texts = []
    for number, part in enumerate(parts):
        where = f"body.messages[{index}].content[{number}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise LineProblem("unsupported_content", f"messages[{index}].content[{number}] is a part of type "
                                                     f"{kind!r}; this service runs text-only models: send text "
                                                     f"parts only",
                              f"{where}.type")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise LineProblem("invalid_messages", f"messages[{index}].content[{number}] must be a text part "
                                                  f'{{"type": "text", "text": "..."}} (got {show(part)})', where)
        texts.append(part["text"])
    return "\n".join(texts)


def invalid(name: str, rule: str, value: Any) -> LineProblem:
    """The invalid_parameter problem for one body parameter."""
    return LineProblem("invalid_parameter", f"body.{name} must be {rule} (got {show(value)})", f"body.{name}")


def is_int(value: Any) -> bool:
    """A JSON integer (booleans are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A JSON number (booleans are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type."""
    names = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "an array", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def show(value: Any) -> str:
    """A value as short one-line JSON, for messages."""
    text = json.dumps(value) if value is not None else "nothing"
    return text if len(text) <= SHOWN_VALUE_CHARS else text[:SHOWN_VALUE_CHARS - 3] + "..."


def one_line(exc: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(exc).split())[:200] or type(exc).__name__
