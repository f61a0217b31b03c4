"""What every check of a batch line shares (LineProblem, how values are shown), and the chat messages' checks.

Messages, as OpenAI takes them: roles system, developer (OpenAI's newer name for system: rendered as system), user
and assistant; content a string or a list of text parts (`[{"type": "text", "text": ...}]`, joined with newlines,
as vLLM joins them); an optional `name`, given to the chat template (jobs.batch_input refuses it where the template
does not render it). An image, audio or file part is an `unsupported_content` line error naming the part's type.
Nothing in a message is silently ignored: a `tool` message, an assistant's `tool_calls` (tool calling is not
supported by this service) and any other key whose value is not null are `invalid_messages` line errors naming it.
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
MESSAGE_KEYS = ("role", "content", "name")
TOOL_ROLES = ("tool", "function")                            # the answers of tool calls (function: the older name)
TOOL_MESSAGE_KEYS = ("tool_calls", "function_call", "tool_call_id")  # an assistant's calls, a tool answer's call
NO_TOOLS = "tool calling is not supported by this service"
SHOWN_VALUE_CHARS = 60
# the user's metadata, in OpenAI's shape (a batch's, and a chat or responses line's): stored, never read by the service
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


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
    """One chat message: a known role, non-empty content (a string or text parts), an optional name, nothing else."""
    where = f"body.messages[{index}]"
    if not isinstance(message, dict):
        raise LineProblem("invalid_messages", f"messages[{index}] must be an object, not {json_type(message)}",
                          where)
    role, content, name = message.get("role"), message.get("content"), message.get("name")
    if role in TOOL_ROLES:
        raise LineProblem("invalid_messages", f"messages[{index}].role is {show(role)}, the answer of a tool call: "
                                              f"{NO_TOOLS}; send the conversation without tool messages",
                          f"{where}.role")
    if role not in ROLES:
        raise LineProblem("invalid_messages", f"messages[{index}].role must be one of {', '.join(ROLES)} "
                                              f"(got {show(role)})", f"{where}.role")
    _refuse_unknown_message_keys(index, message)
    text = _parts_text(index, content) if isinstance(content, list) else content
    if not isinstance(text, str) or not text:
        raise LineProblem("invalid_messages", f"messages[{index}].content must be a non-empty string or a list "
                                              f"of text parts (got {show(content)})", f"{where}.content")
    if name is not None and (not isinstance(name, str) or not name):
        raise LineProblem("invalid_messages", f"messages[{index}].name must be a non-empty string (got "
                                              f"{show(name)})", f"{where}.name")
    rendered = {"role": TEMPLATE_ROLES.get(str(role), str(role)), "content": text}
    return {**rendered, "name": name} if name is not None else rendered


def _refuse_unknown_message_keys(index: int, message: dict[str, Any]) -> None:
    """A message key other than role, content and name, unless null (an assistant's empty tool_calls too), is a
    line error naming it: tool calls say tool calling is not supported."""
    for key, value in message.items():
        if key in MESSAGE_KEYS or value is None or (key == "tool_calls" and value == []):
            continue
        where = f"body.messages[{index}].{key}"
        if key in TOOL_MESSAGE_KEYS:
            raise LineProblem("invalid_messages", f"messages[{index}].{key} is given ({show(value)}): {NO_TOOLS}; "
                                                  f"send the conversation without tool calls", where)
        raise LineProblem("invalid_messages", f"messages[{index}] has the key {show(key)}, which this service does "
                                              f"not take (a message takes {', '.join(MESSAGE_KEYS)}); remove it",
                          where)


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


def check_kept(body: dict[str, Any]) -> None:
    """The body keys kept without effect on the output (`user`, `safety_identifier`, `prompt_cache_key`,
    `metadata`): strings, and metadata as OpenAI bounds it (16 pairs of strings, keys up to 64 characters, values up
    to 512)."""
    for key in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise invalid(key, "a string", body[key])
    metadata = body.get("metadata")
    if metadata is None:
        return
    rule = (f"an object of at most {MAX_METADATA_PAIRS} pairs of strings, keys up to {MAX_METADATA_KEY} characters "
            f"and values up to {MAX_METADATA_VALUE}")
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS or not all(
            isinstance(v, str) and len(k) <= MAX_METADATA_KEY and len(v) <= MAX_METADATA_VALUE
            for k, v in metadata.items()):
        raise invalid("metadata", rule, metadata)


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
