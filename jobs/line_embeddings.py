"""A `/v1/embeddings` batch line, checked: its inputs as token ids, its encoding format and dimensions.

As OpenAI takes them: `input` a non-empty string, a list of up to 2048 of them, a list of token ids, or a list of
such lists; `encoding_format` "float" (the default) or "base64" (the float32 values' little-endian bytes, base64);
`dimensions` only where the model was trained for shorter embeddings (swarmclient.pooling: its Matryoshka sizes),
otherwise a line error; `user` is kept. Each input is tokenized as sentence-transformers does (the tokenizer's
special tokens added) and must fit the model's context: a longer one is a line error (no silent truncation).
A line of k inputs becomes k requests (one per input, like `n` choices), embedded and stored each on its own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from jobs.line_checks import LineProblem, invalid, is_int, show
from swarmclient.pooling import Pooling

MAX_INPUTS = 2048  # OpenAI's limit of inputs in one embeddings request
ENCODING_FORMATS = ("float", "base64")
BODY_KEYS = {"model", "input", "encoding_format", "dimensions", "user"}


@dataclass(frozen=True)
class EmbeddingModel:
    """What embedding lines are checked against: the model's hidden size and how it pools (its Matryoshka sizes)."""

    hidden_size: int = 0  # 0: unknown, `dimensions` is refused
    pooling: Pooling = field(default_factory=Pooling)


def input_ids(body: dict[str, Any], tokenizer: Any, context_length: int, chars_per_token: int | None
              ) -> list[list[int]]:
    """Each input's token ids; a problem names the input at fault (`body.input[i]`)."""
    value = body.get("input")
    if isinstance(value, str) or (isinstance(value, list) and value and all(is_int(t) for t in value)):
        items: list[Any] = [value]
        where = ["body.input"]
    elif isinstance(value, list) and value and len(value) <= MAX_INPUTS:
        items, where = value, [f"body.input[{i}]" for i in range(len(value))]
    else:
        raise LineProblem("invalid_input", f"body.input must be a non-empty string, a list of 1 to {MAX_INPUTS} of "
                                           f"them, or token ids (got {show(value)})", "body.input")
    return [_ids(item, param, tokenizer, context_length, chars_per_token) for item, param in zip(items, where,
                                                                                                strict=True)]


def _ids(item: Any, param: str, tokenizer: Any, context_length: int, chars_per_token: int | None) -> list[int]:
    """One input's token ids: a text tokenized, or token ids checked against the vocabulary."""
    if isinstance(item, str) and item:
        if chars_per_token is not None and math.ceil(len(item) / chars_per_token) > context_length:
            raise _too_long(param, f"{len(item)} characters, so more than {context_length} tokens", context_length)
        ids = [int(i) for i in tokenizer(item).input_ids]
    elif isinstance(item, list) and item and all(is_int(t) for t in item):
        vocab = len(tokenizer)
        if not all(0 <= t < vocab for t in item):
            raise LineProblem("invalid_input", f"{param} holds token ids outside this model's vocabulary "
                                               f"(0 to {vocab - 1})", param)
        ids = [int(t) for t in item]
    else:
        raise LineProblem("invalid_input", f"{param} must be a non-empty string or a non-empty list of token ids "
                                           f"(got {show(item)})", param)
    if len(ids) > context_length:
        raise _too_long(param, f"{len(ids)} tokens", context_length)
    return ids


def _too_long(param: str, size: str, context_length: int) -> LineProblem:
    return LineProblem("context_length_exceeded", f"{param} is {size}, but the model's context is {context_length} "
                                                  f"tokens; shorten it or split it into several inputs", param)


def check_options(body: dict[str, Any], model: EmbeddingModel) -> None:
    """encoding_format and dimensions: what the model can give."""
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in ENCODING_FORMATS:
        raise invalid("encoding_format", " or ".join(f'"{f}"' for f in ENCODING_FORMATS), encoding)
    dimensions = body.get("dimensions")
    if dimensions is None:
        return
    if not is_int(dimensions) or dimensions < 1:
        raise invalid("dimensions", "an integer >= 1", dimensions)
    problem = model.pooling.dimensions_problem(dimensions, model.hidden_size) if model.hidden_size else \
        "this model's embedding size is unknown here"
    if problem is not None:
        raise LineProblem("unsupported_parameter", f"body.dimensions is {dimensions}, but {problem}",
                          "body.dimensions")
