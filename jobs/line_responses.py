"""A `/v1/responses` batch line, run as the chat line it amounts to.

What a batch user of the Responses API sends: `input` (a string, or message items `{"role", "content"}` with
optional `"type": "message"`, content a string or `input_text` / `output_text` parts), `instructions` (rendered as
a system message before the input), `max_output_tokens`, `temperature`, `top_p`, `text.format` and `metadata`.
The line is translated into chat's body (messages, max_tokens, and `text.format` json_object / json_schema into
chat's `response_format`) and checked by the chat path itself, so every chat rule holds; a problem it finds is
reported under the Responses' names (body.input, body.max_output_tokens, body.text.format). Other item types (tool
calls, reasoning, references) and image, file or audio parts are line errors naming the item or part.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, TypeVar

from jobs.line_checks import MEDIA_PARTS, RESPONSES_URL, ROLES, LineProblem, invalid, json_type, show
from jobs.line_sampling import EXTRAS


class DataclassInstance(Protocol):
    """Any dataclass instance (what `dataclasses.replace` takes)."""
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


Parsed = TypeVar("Parsed", bound=DataclassInstance)  # jobs.batch_input.ParsedRequest (which imports this module)

# body keys honoured; the ones echoed in the response object are stored with the line
BODY_KEYS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "metadata", "user",
             "safety_identifier", "prompt_cache_key", "seed", "logit_bias", *EXTRAS}
ECHOED = ("instructions", "max_output_tokens", "text", "metadata")
PASSED = ("model", "temperature", "top_p", "user", "seed", "logit_bias", *EXTRAS)  # the same in a chat body
TEXT_PARTS = ("input_text", "output_text")
INPUT_MEDIA = ("input_image", "input_file", "input_audio", *MEDIA_PARTS)
# chat's names for what the Responses API names otherwise, in the problems the chat path reports (in this order: a
# json_schema's keys sit directly in text.format)
RENAMED = (("body.max_tokens", "body.max_output_tokens"), ("max_tokens", "max_output_tokens"),
           ("body.response_format.json_schema", "body.text.format"), ("response_format.json_schema", "text.format"),
           ("body.response_format", "body.text.format"), ("response_format", "text.format"),
           ("body.messages", "body.input"))


def as_responses(body: dict[str, Any], parse_chat: Callable[[dict[str, Any]], Parsed]) -> Parsed:
    """The request of a responses line: its chat translation parsed by `parse_chat`, stored with the fields the
    response object echoes."""
    chat = as_chat(body)
    try:
        parsed = parse_chat(chat)
    except LineProblem as problem:
        raise renamed(problem) from None
    stored = {**chat, **{key: body[key] for key in ECHOED if body.get(key) is not None}}
    return dataclasses.replace(parsed, url=RESPONSES_URL, body=stored)


def as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body a responses body amounts to."""
    chat: dict[str, Any] = {key: body[key] for key in PASSED if key in body}
    chat["messages"] = _instructions(body.get("instructions")) + _input_messages(body.get("input"))
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def renamed(problem: LineProblem) -> LineProblem:
    """A problem the chat path found, in the Responses' names."""
    message, param = problem.message, problem.param
    for chat_name, name in RENAMED:
        message = message.replace(chat_name, name)
        param = param.replace(chat_name, name) if param and param.startswith(chat_name) else param
    return LineProblem(problem.code, message, param)


def _instructions(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, str) or not value:
        raise invalid("instructions", "a non-empty string (rendered as a system message)", value)
    return [{"role": "system", "content": value}]


def _input_messages(value: Any) -> list[dict[str, Any]]:
    """The input as chat messages: a string is the user's message; items are messages."""
    if isinstance(value, str) and value:
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise LineProblem("missing_input", f"body.input must be a non-empty string or a non-empty list of message "
                                           f"items for {RESPONSES_URL} (got {show(value)})", "body.input")
    return [_item(index, item) for index, item in enumerate(value)]


def _item(index: int, item: Any) -> dict[str, Any]:
    """One input item: a message, its content a string or text parts (as chat's text parts)."""
    where = f"body.input[{index}]"
    if not isinstance(item, dict):
        raise LineProblem("invalid_input", f"{where} must be a message item, not {json_type(item)}", where)
    kind = item.get("type", "message")
    if kind != "message":
        raise LineProblem("unsupported_content", f"{where} is an item of type {show(kind)}; this service answers "
                                                 f"message items only (no tools, reasoning or references)",
                          f"{where}.type")
    role, content = item.get("role"), item.get("content")
    if role not in ROLES:
        raise LineProblem("invalid_input", f"{where}.role must be one of {', '.join(ROLES)} (got {show(role)})",
                          f"{where}.role")
    if isinstance(content, list):
        content = [_part(f"{where}.content[{number}]", part) for number, part in enumerate(content)]
    if not content or not isinstance(content, str | list):
        raise LineProblem("invalid_input", f"{where}.content must be a non-empty string or a list of text parts "
                                           f"(got {show(item.get('content'))})", f"{where}.content")
    return {"role": role, "content": content}


def _part(where: str, part: Any) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in INPUT_MEDIA:
        raise LineProblem("unsupported_content", f"{where} is a part of type {kind!r}; this service runs text-only "
                                                 f"models: send input_text parts only", f"{where}.type")
    if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
        raise LineProblem("invalid_input", f'{where} must be a text part {{"type": "input_text", "text": "..."}} '
                                           f"(got {show(part)})", where)
    return {"type": "text", "text": part["text"]}


def _response_format(text: Any) -> dict[str, Any] | None:
    """chat's response_format for `text.format` (None for plain text): json_object as is, json_schema with its
    name, schema, strict and description moved under `json_schema` as chat has them."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format"}:
        raise invalid("text", 'an object {"format": {...}}', text)
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise LineProblem("invalid_parameter", f'body.text.format must be {{"type": "text"}}, "json_object" or '
                                               f'"json_schema" (got {show(fmt)})', "body.text.format")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {key: value for key, value in fmt.items() if key != "type"}}
