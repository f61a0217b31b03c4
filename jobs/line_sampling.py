"""A batch line's sampling parameters, checked: OpenAI's, with OpenAI's defaults, and vLLM's extensions.

Omitted (or null): temperature 1 and top_p 1 (OpenAI's), seed drawn at random at submission and stored with the
request (so a resumed request samples as it would have, and two identical lines sample differently), stop [], n 1,
no logprobs, no penalties. `frequency_penalty` and `presence_penalty` in [-2, 2] and `logit_bias` (token id ->
bias in [-100, 100]) as OpenAI's; `top_k` (-1 or 0: all), `min_p` in [0, 1] and `repetition_penalty` > 0 as vLLM's.
The worker reads the penalties back from the stored body (`sampling_extras`): no column holds them.
"""
from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from jobs.line_checks import COMPLETIONS_URL, LineProblem, invalid, is_int, is_number, show

MAX_STOP_SEQUENCES = 4
MAX_CHOICES = 16  # n: each choice is a request of its own, generated (and resumed) on its own
MAX_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS = 20, 5  # OpenAI's bounds: chat top_logprobs, completions logprobs
SEED_LIMIT = 2**63
MAX_LOGIT_BIAS = 100
# body keys of the penalties and extensions, and the value of each that changes nothing
EXTRAS = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "top_k": 0, "min_p": 0.0}


def temperature(body: dict[str, Any]) -> float:
    """temperature in [0, 2]; 1.0 when omitted (OpenAI's default; 0 is greedy)."""
    return _number(body, "temperature", 1.0, lambda v: 0 <= v <= 2, "a number from 0 to 2")


def top_p(body: dict[str, Any]) -> float:
    """top_p in (0, 1]; 1.0 when omitted."""
    return _number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "a number greater than 0 and at most 1")


def _number(body: dict[str, Any], name: str, default: float, valid: Callable[[float], bool], rule: str) -> float:
    """A numeric body parameter, checked by `valid`."""
    value = body.get(name)
    if value is None:
        return default
    if not is_number(value) or not valid(value):
        raise invalid(name, rule, value)
    return float(value)


def seed(body: dict[str, Any]) -> int:
    """seed: an integer in [0, 2**63); drawn at random when omitted (the caller stores it with the request)."""
    value = body.get("seed")
    if value is None:
        return secrets.randbelow(SEED_LIMIT)
    if not is_int(value) or not 0 <= value < SEED_LIMIT:
        raise invalid("seed", "an integer from 0 to 2**63 - 1", value)
    return int(value)


def stop(body: dict[str, Any]) -> list[str]:
    """stop: a string or a list of up to 4 non-empty strings; [] when omitted."""
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    valid = isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)
    if not valid or len(stops) > MAX_STOP_SEQUENCES:
        raise invalid("stop", f"a non-empty string or a list of up to {MAX_STOP_SEQUENCES} non-empty strings", value)
    return list(stops)


def choices(body: dict[str, Any]) -> int:
    """n: how many choices to generate, 1 to MAX_CHOICES; 1 when omitted."""
    value = body.get("n")
    if value is None:
        return 1
    if not is_int(value) or not 1 <= value <= MAX_CHOICES:
        raise invalid("n", f"an integer from 1 to {MAX_CHOICES}", value)
    return int(value)


def top_logprobs(body: dict[str, Any], url: str) -> int | None:
    """The logprobs asked, as OpenAI takes them: chat `logprobs: true` with `top_logprobs` 0 to 20; completions
    `logprobs` 0 to 5 (the chosen token's and that many likely tokens'). None when not asked."""
    if url == COMPLETIONS_URL:
        value = body.get("logprobs")
        if value is not None and (not is_int(value) or not 0 <= value <= MAX_COMPLETION_LOGPROBS):
            raise invalid("logprobs", f"an integer from 0 to {MAX_COMPLETION_LOGPROBS}", value)
        return value
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise invalid("logprobs", "true or false", asked)
    if top is not None and (not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise invalid("top_logprobs", f"an integer from 0 to {MAX_TOP_LOGPROBS}", top)
    if top is not None and not asked:
        raise LineProblem("invalid_parameter", "body.top_logprobs needs body.logprobs set to true",
                          "body.top_logprobs")
    return (top or 0) if asked else None


def check_extras(body: dict[str, Any], vocab_size: int) -> None:
    """Check the penalties, logit_bias and vLLM's extensions of a line (token ids below `vocab_size`)."""
    _number(body, "frequency_penalty", 0.0, lambda v: -2 <= v <= 2, "a number from -2 to 2")
    _number(body, "presence_penalty", 0.0, lambda v: -2 <= v <= 2, "a number from -2 to 2")
    _number(body, "repetition_penalty", 1.0, lambda v: 0 < v, "a number greater than 0 (1: no penalty)")
    _number(body, "min_p", 0.0, lambda v: 0 <= v <= 1, "a number from 0 to 1")
    top_k = body.get("top_k")
    if top_k is not None and (not is_int(top_k) or top_k < -1):
        raise invalid("top_k", "an integer >= 1, or -1 or 0 for all tokens", top_k)
    _logit_bias(body.get("logit_bias"), vocab_size)


def _logit_bias(value: Any, vocab_size: int) -> None:
    """logit_bias: an object of token ids (as strings) to numbers in [-100, 100]."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise invalid("logit_bias", "an object mapping token ids to biases from -100 to 100", value)
    for key, bias in value.items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise LineProblem("invalid_parameter", f"body.logit_bias names token {show(key)}, which is not a token "
                                                   f"id of this model (0 to {vocab_size - 1})", "body.logit_bias")
        if not is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise LineProblem("invalid_parameter", f"body.logit_bias[{show(key)}] must be a number from "
                                                   f"-{MAX_LOGIT_BIAS} to {MAX_LOGIT_BIAS} (got {show(bias)})",
                              "body.logit_bias")


def sampling_extras(body: dict[str, Any]) -> dict[str, Any]:
    """The penalties and extensions of a stored (checked) body, the defaults for those omitted: EXTRAS' keys, and
    `logit_bias` as ((token id, bias), ...) in token order."""
    extras: dict[str, Any] = {name: type(default)(body[name]) if body.get(name) is not None else default
                              for name, default in EXTRAS.items()}
    bias = body.get("logit_bias") or {}
    extras["logit_bias"] = tuple(sorted((int(token), float(value)) for token, value in bias.items()))
    return extras
