"""A `/v1/embeddings` batch line, checked: its inputs as token ids, its encoding format and dimensions.

As OpenAI takes them: `input` a non-empty string, a list of up to 2048 of them, a list of token ids, or a list of
such lists; `encoding_format` "float" (the default) or "base64" (the float32 values' little-endian bytes, base64);
`dimensions` only where the model was trained for shorter embeddings (swarmclient.pooling: its Matryoshka sizes),
otherwise a line error; `user` is kept. Each input is tokenized as sentence-transformers does (the tokenizer's
special tokens added; lowercased first where its sentence_bert_config.json says do_lower_case) and must fit the
model's context and its `max_seq_length` (sentence_bert_config.json) when it has one: a longer one is a line error
naming the limit, as at OpenAI (sentence-transformers would truncate it silently).
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


def input_ids(body: dict[str, Any], tokenizer: Any, context_length: int, chars_per_token: int | None,
              pooling: Pooling | None = None) -> list[list[int]]:
    """Each input's token ids; a problem names the input at fault (`body.input[i]`)."""
    limit = _Limit(context_length, pooling or Pooling())
    value = body.get("input")
    if isinstance(value, str) or (isinstance(value, list) and value and all(is_int(t) for t in value)):
        items: list[Any] = [value]
        where = ["body.input"]
    elif isinstance(value, list) and value and len(value) <= MAX_INPUTS:
        items, where = value, [f"body.input[{i}]" for i in range(len(value))]
    else:
        raise LineProblem("invalid_input", f"body.input must be a non-empty string, a list of 1 to {MAX_INPUTS} of "
                                           f"them, or token ids (got {show(value)})", "body.input")
    return [_ids(item, param, tokenizer, limit, chars_per_token) for item, param in zip(items, where, strict=True)]


@dataclass(frozen=True)
class _Limit:
    """The most tokens of one input: the model's context, or its sentence-transformers max_seq_length if lower."""

    context_length: int
    pooling: Pooling

    @property
    def tokens(self) -> int:
        return min(self.context_length, self.pooling.max_seq_length or self.context_length)

    def too_long(self, param: str, size: str) -> LineProblem:
        seq = self.pooling.max_seq_length
        limit = f"this model embeds at most {seq} tokens (max_seq_length in its sentence_bert_config.json)" \
            if seq is not None and seq < self.context_length else f"the model's context is {self.context_length} tokens"
        return LineProblem("context_length_exceeded", f"{param} is {size}, but {limit}; shorten it or split it into "
                                                      f"several inputs", param)


def _ids(item: Any, param: str, tokenizer: Any, limit: _Limit, chars_per_token: int | None) -> list[int]:
    """One input's token ids: a text tokenized, or token ids checked against the vocabulary."""
    if isinstance(item, str) and item:
        # lowercasing never shortens a text, so the bound on its characters holds before it too
        if chars_per_token is not None and math.ceil(len(item) / chars_per_token) > limit.tokens:
            raise limit.too_long(param, f"{len(item)} characters, so more than {limit.tokens} tokens")
        ids = [int(i) for i in tokenizer(item.lower() if limit.pooling.lower_case else item).input_ids]
    elif isinstance(item, list) and item and all(is_int(t) for t in item):
        vocab = len(tokenizer)
        if not all(0 <= t < vocab for t in item):
            raise LineProblem("invalid_input", f"{param} holds token ids outside this model's vocabulary "
                                               f"(0 to {vocab - 1})", param)
        ids = [int(t) for t in item]
    else:
        raise LineProblem("invalid_input", f"{param} must be a non-empty string or a non-empty list of token ids "
                                           f"(got {show(item)})", param)
    if len(ids) > limit.tokens:
        raise limit.too_long(param, f"{len(ids)} tokens")
    return ids


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
