"""Request validation: every check runs before any compute, and failures name the offending field."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from servers.errors import RequestRejected
from swarmnet.protocol import ErrorCode

HIDDEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int64, torch.int32, torch.bool)
MAX_SESSION_ID = 64


@dataclass(frozen=True)
class Limits:
    """What a server accepts."""

    span_start: int
    span_end: int
    hidden_size: int
    max_batch_size: int
    max_length: int


def reject(message: str) -> RequestRejected:
    """An INVALID rejection."""
    return RequestRejected(ErrorCode.INVALID, message)


def _int_field(meta: dict[str, Any], name: str, low: int, high: int) -> int:
    value = meta.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise reject(f"'{name}' must be an integer in [{low}, {high}], got {value!r}")
    return value


def validate_span(meta: dict[str, Any], limits: Limits) -> tuple[int, int]:
    """The requested blocks [start, end), inside the served span."""
    start = _int_field(meta, "start", limits.span_start, limits.span_end - 1)
    end = _int_field(meta, "end", start + 1, limits.span_end)
    return start, end


def validate_session_open(meta: dict[str, Any], limits: Limits) -> tuple[str, int, int]:
    """(session_id, batch_size, max_length) of a session's first message."""
    session_id = meta.get("session_id")
    if not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_SESSION_ID:
        raise reject(f"'session_id' must be a string of 1..{MAX_SESSION_ID} characters")
    batch_size = _int_field(meta, "batch_size", 1, limits.max_batch_size)
    max_length = _int_field(meta, "max_length", 1, limits.max_length)
    return session_id, batch_size, max_length


@dataclass(frozen=True)
class ForwardShape:
    """What a `forward` header declares: blocks [start, end) and the shape and dtype of the hidden states to come."""

    start: int
    end: int
    batch_size: int
    length: int
    dtype: torch.dtype


def validate_forward_header(meta: dict[str, Any], limits: Limits, *, max_tokens: int) -> ForwardShape:
    """The shape a forward's tensors must have, at most `max_tokens` tokens (rows x length) in all; checked before
    any of them is read."""
    start, end = validate_span(meta, limits)
    batch_size = _int_field(meta, "batch_size", 1, limits.max_batch_size)
    length = _int_field(meta, "length", 1, limits.max_length)
    if batch_size * length > max_tokens:
        raise reject(f"a forward of {batch_size} x {length} tokens is over this server's {max_tokens} "
                     "(--max-forward-tokens): send fewer rows per forward")
    names = {str(dtype).removeprefix("torch."): dtype for dtype in HIDDEN_DTYPES}
    if meta.get("dtype") not in names:
        raise reject(f"'dtype' must be one of {', '.join(names)}, got {str(meta.get('dtype'))[:32]!r}")
    return ForwardShape(start, end, batch_size, length, names[meta["dtype"]])


def validate_forward(tensors: list[torch.Tensor], shape: ForwardShape, limits: Limits
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A forward's (hidden, mask, positions): a whole sequence of the shape its header declared."""
    hidden, mask, positions = validate_step(tensors, batch_size=shape.batch_size, past=0, max_length=limits.max_length,
                                            hidden_size=limits.hidden_size)
    if hidden.shape[1] != shape.length or hidden.dtype != shape.dtype:
        raise reject(f"hidden states must be the header's {shape.batch_size} x {shape.length} tokens of {shape.dtype}, "
                     f"got {list(hidden.shape)} of {hidden.dtype}")
    return hidden, mask, positions


def validate_keep_rows(value: Any, batch_size: int) -> list[int] | None:
    """The rows a step keeps of the session's batch (sorted, unique, in range), or None to keep them all."""
    if value is None:
        return None
    rows = list(value) if isinstance(value, (list, tuple)) else None
    if not rows or not all(isinstance(i, int) and not isinstance(i, bool) for i in rows) or \
            any(b <= a for a, b in zip(rows, rows[1:], strict=False)) or rows[0] < 0 or rows[-1] >= batch_size:
        raise reject(f"'keep_rows' must be a non-empty sorted list of unique row indices in [0, {batch_size}), "
                     f"got {str(value)[:80]}")
    return rows


def validate_step(tensors: list[torch.Tensor], *, batch_size: int, past: int, max_length: int,
                  hidden_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [B,T,H], mask [B,past+T], positions [B,T]) after checking count, shapes, dtypes and lengths."""
    if len(tensors) != 3:
        raise reject(f"expected 3 tensors (hidden, attention_mask, position_ids), got {len(tensors)}")
    hidden, mask, positions = tensors
    if hidden.dtype not in HIDDEN_DTYPES:
        raise reject(f"hidden states must be float32/bfloat16/float16, got {hidden.dtype}")
    if hidden.ndim != 3 or hidden.shape[2] != hidden_size:
        raise reject(f"hidden states must be [batch, tokens, {hidden_size}], got {list(hidden.shape)}")
    batch, length = hidden.shape[0], hidden.shape[1]
    if batch != batch_size:
        raise reject(f"batch of {batch} rows in a session of {batch_size}")
    if length < 1:
        raise reject("a step needs at least one token")
    if past + length > max_length:
        raise reject(f"too many tokens: {past} cached + {length} new exceeds the session's {max_length}")
    for name, tensor, shape in (("attention_mask", mask, [batch, past + length]), ("position_ids", positions, [batch, length])):
        if tensor.dtype not in INDEX_DTYPES:
            raise reject(f"{name} must be an integer tensor, got {tensor.dtype}")
        if list(tensor.shape) != shape:
            raise reject(f"{name} must be {shape}, got {list(tensor.shape)}")
    # one reduction instead of isfinite + all (a decode step's checks run cold, right after a compute): a NaN or
    # an Inf makes the sum NaN or Inf, and a float64 sum of float32/16 values cannot overflow
    if not math.isfinite(hidden.sum(dtype=torch.float64).item()):
        raise reject("hidden states contain NaN or Inf")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= max_length):
        raise reject(f"position_ids must lie in [0, {max_length})")
    return hidden, mask.long(), positions.long()


MAX_ROUTE = 64  # hops a step may name after this one
MAX_PEER_ID = 128


def validate_step_id(value: Any) -> int | None:
    """A step's id (its index in the session: what makes a repeated step a duplicate), or None for no id."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 40:
        raise reject(f"'step_id' must be a non-negative integer, got {str(value)[:40]}")
    return value


def validate_route(value: Any) -> list[tuple[str, str]]:
    """Where a step's outputs go next: [(peer id, session id)] of the following hops, the next one first."""
    if value is None:
        return []
    hops = list(value) if isinstance(value, (list, tuple)) else None
    if hops is None or len(hops) > MAX_ROUTE or not all(
            isinstance(hop, (list, tuple)) and len(hop) == 2 and isinstance(hop[0], str) and isinstance(hop[1], str)
            and 0 < len(hop[0]) <= MAX_PEER_ID and 0 < len(hop[1]) <= MAX_SESSION_ID for hop in hops):
        raise reject(f"'route' must be a list of at most {MAX_ROUTE} [peer id, session id] pairs, got {str(value)[:80]}")
    return [(str(peer), str(session)) for peer, session in hops]
