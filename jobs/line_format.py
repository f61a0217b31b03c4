"""A chat line's `response_format`, checked, and the grammar its output is decoded under (structured outputs).

As OpenAI takes it:
- `{"type": "text"}` (or omitted): free text.
- `{"type": "json_object"}` (JSON mode): the output is a JSON object.
- `{"type": "json_schema", "json_schema": {"name", "description", "schema", "strict"}}`: the output is JSON that
  validates against `schema` (omitted: any JSON object). With `strict: true` every keyword of the schema is enforced,
  and a schema using one the decoder cannot enforce (`not`, `if`/`then`, an unknown `format`...) is a line error
  naming it. With `strict` false or omitted (OpenAI's default, where the schema is only followed as well as the
  model can), what can be enforced still is, and the keywords that cannot are ignored.
The output is compact JSON (no whitespace between tokens), decoded under the grammar (swarmclient.constraints); a
max_tokens that cuts it short ends it with finish_reason "length", as at OpenAI. The worker rebuilds the grammar from
the stored body (`output_grammar`): no column holds it.
"""
from __future__ import annotations

import re
from typing import Any

from jobs.line_checks import LineProblem, invalid, one_line, show
from swarmclient.constraints import grammar_error, grammar_tokenizer, json_grammar

PARAM = "response_format"
FORMATS = ("text", "json_object", "json_schema")
FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
SCHEMA_KEYS = {"name", "description", "schema", "strict"}
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name


def check_response_format(body: dict[str, Any], tokenizer: Any) -> None:
    """Refuse a response_format that is malformed, or whose schema does not compile for this tokenizer."""
    value = body.get(PARAM)
    if value is None:
        return
    if not isinstance(value, dict) or value.get("type") not in FORMATS:
        raise invalid(PARAM, 'an object whose type is "text", "json_object" or "json_schema"', value)
    _refuse_unknown_keys(value, FORMAT_KEYS[value["type"]], PARAM)
    if value["type"] == "json_schema":
        _check_json_schema(value.get("json_schema"))
    grammar = output_grammar(body)
    error = grammar_error(grammar, grammar_tokenizer(tokenizer)) if grammar is not None else None
    if error is not None:
        raise _uncompilable(error, value)


def output_grammar(body: dict[str, Any]) -> str | None:
    """The grammar of a checked body's output (None for free text)."""
    value = body.get(PARAM) or {"type": "text"}
    if value["type"] == "text":
        return None
    spec = value.get("json_schema") or {}
    return json_grammar(spec.get("schema"), lenient=not spec.get("strict"))


def _check_json_schema(spec: Any) -> None:
    """json_schema: a name, an optional description, an optional schema object and an optional strict flag."""
    where = f"{PARAM}.json_schema"
    if not isinstance(spec, dict):
        raise invalid(where, 'an object {"name", "schema", "strict"}', spec)
    _refuse_unknown_keys(spec, SCHEMA_KEYS, where)
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise invalid(f"{where}.name", "1 to 64 letters, digits, underscores or dashes", name)
    for key, kind, rule in (("description", str, "a string"), ("schema", dict, "a JSON Schema object"),
                            ("strict", bool, "true or false")):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise invalid(f"{where}.{key}", rule, spec[key])


def _refuse_unknown_keys(value: dict[str, Any], known: set[str], where: str) -> None:
    for key in value:
        if key not in known:
            raise LineProblem("invalid_parameter", f"body.{where} has no key {show(key)} (it takes "
                                                   f"{', '.join(sorted(known))}); remove it", f"body.{where}.{key}")


def _uncompilable(error: str, value: dict[str, Any]) -> LineProblem:
    """The line error of a schema the decoder cannot use (json_object always compiles), naming what to do."""
    strict = bool((value.get("json_schema") or {}).get("strict"))
    unenforceable = "Unimplemented" in error or "Unknown format" in error
    advice = "remove those keywords, or set strict to false to have them ignored" if strict and unenforceable \
        else "fix the schema"
    return LineProblem("invalid_parameter", f"body.{PARAM}.json_schema.schema cannot be enforced: "
                                            f"{one_line(ValueError(error))}; {advice}",
                       f"body.{PARAM}.json_schema.schema")
