"""RPC names and the wire format shared by block servers and the client.

One codec for every message (`encode` / `decode`): a 4-byte header length, a msgpack header
{"meta": {...}, "tensors": [[dtype, shape], ...]}, then each tensor's raw bytes, 16-byte aligned. Decoding
is a bounds check and `torch.frombuffer`, no per-element work: a decode step's hop runs right after a
compute that has flushed the CPU caches, and every line of Python on that path is slow then.

Every RPC is a raw hivemind stream of messages, each an 8-byte length and a frame, written with one write. A
reader refuses a length over its limit having read only those 8 bytes, and a header over MAX_HEADER_BYTES having
read only the 4 bytes more that give its length. Before a session exists (and in `info` and
`forward` requests) a message may be at most OPEN_FRAME_LIMIT; a session's steps at most what its shape allows
(`step_frame_limit`).

- `inference` (one stream = one session): first an OPEN message, no tensors, meta {"open": true, "session_id",
  "start", "end", "batch_size", "max_length"} plus the caller's extra keys (a credential); the server checks it,
  reserves the session's KV cache and answers {"opened": true}. Then one message per step, in both directions,
  meta {"session_id"} (and "keep_rows"). A first step of at most OPEN_FRAME_LIMIT bytes goes right behind the
  open message, without waiting (pipelined: opening costs no round trip; if the open is refused, the server reads
  and refuses that step too, and the stream stays usable); a bigger one waits for {"opened": true}. A last message
  {"session_id", "close": true} asks the server to free the session; it answers {"closed": true} once freed, then
  ends the stream.
- Resume (a relay resets a connection after 128 KiB): a session opened with "resumable": true whose stream is lost
  without a close is kept by the server for its session grace (`serve --session-grace`). A new `inference` stream
  of the same caller (peer id) may take it over with a first message {"resume": true, "session_id"} plus the
  caller's extra keys, answered {"resumed": true, "session_id", "applied", "cache_len"} (steps applied, tokens
  cached); the client then resends the steps from "applied" on (a step applied already is answered again, as any
  duplicate). Another caller's session, an expired one and one never opened are all answered `unknown_session`.
- Push (server to server, issue 18): a session opened with "push": true may get steps carrying "step_id" (the
  step's index in the session) and "route" ([peer id, session id] of the hops after this one). The server answers
  such a step as any other, then pushes its outputs (with the step's mask, positions, keep_rows, step id and the
  rest of the route) to the first hop of the route over a `push` stream: its first message {"attach": true,
  "session_id"} (the downstream session), answered {"attached": true}; then one step per message, each answered
  {"accepted": step_id} or an error. Every pushed step carries "push_proof" (the pusher's signature of the input it
  pushed, for which session: swarmnet/push_proof.py), which the downstream server checks before applying it (an
  unproven push is refused), and every answer of a session opened for push carries "input_digest" (the digest of
  the input it was computed on) and, for a pushed step, the push's "push_proof". The downstream server applies a
  pushed step to that session exactly once (a
  step id already applied is a duplicate: a direct step gets the same answer again, a push is acknowledged and
  dropped; a duplicate is pushed on only where the step's push failed, and the 17th copy of a step ends the stream)
  and writes its answer, with its "step_id", on its client's own stream, unasked. A push that fails is
  reported on the upstream session's stream: {"session_id", "step_id", "push_failed": {"peer", "reason"}}.
- `info`: one request (meta: the caller's extra keys), one answer; then the server ends the stream.
- `forward`: a header (no tensors; meta {"start", "end", "batch_size", "length", "dtype"}, plus the caller's
  keys), answered {"admitted": true} (or an error), then one frame of (hidden, attention_mask, position_ids) no
  larger than the header's shape allows; one answer, then the server ends the stream.

A server ends a stream without reading what the client sent only when the client broke the rules (an oversized
message): p2pd resets such a stream, and the client loses the answers still in flight, so a well-behaved client
never has bytes in flight that the server may refuse to read.

Errors travel in-band as metadata {"error": {"code", "message"}} so that a stream survives a rejected step
and the client can tell "route around this server" from "my request is wrong".
"""
from __future__ import annotations

import asyncio
import math
from enum import Enum
from typing import Any

import msgpack
import torch
from hivemind.utils import MSGPackSerializer

TUPLE_EXT_CODE = MSGPackSerializer._TUPLE_EXT_TYPE_CODE  # how MSGPackSerializer.dumps packs a tuple (0x40)

# /3: an open message starts a session; info and forward are raw streams too (before: unary protobuf calls)
# /4: a push session's answers carry "input_digest", pushed steps a "push_proof" (swarmnet/push_proof.py)
# /5 (inference): a new stream may resume a session whose stream was lost
RPC_INFO = "swarmbatch.info/3"
RPC_FORWARD = "swarmbatch.forward/3"
RPC_INFERENCE = "swarmbatch.inference/5"
RPC_PUSH = "swarmbatch.push/4"  # server to server: a step's outputs straight into the next hop's session

OPEN_FRAME_LIMIT = 1 << 16  # bytes: any message before a session exists, an info request, a forward header
MAX_HEADER_BYTES = OPEN_FRAME_LIMIT  # a frame's msgpack header (meta and tensor specs): a step's is under 1 KiB

DTYPES = {str(dtype).removeprefix("torch."): dtype
          for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool)}
_ALIGN = 16
_LENGTH_BYTES = 8
_HEADER_LENGTH_BYTES = 4  # a frame's first bytes: its msgpack header's length


class ErrorCode(str, Enum):
    """Why a server refused a request; decides what the client does next."""

    INVALID = "invalid_request"      # malformed: a client bug, never retried
    CACHE_FULL = "cache_full"        # no room for the session now: route around this server
    BUSY = "busy"                    # this caller holds its share (sessions, cache, queued forwards): route around
    UNAUTHORIZED = "unauthorized"    # the caller is not a member of this server's swarm: route around
    UNKNOWN_SESSION = "unknown_session"  # a step for a session this stream did not open
    INTERNAL = "internal"            # the server failed: route around

    @property
    def retryable(self) -> bool:
        """Whether another server (or a later try) may succeed."""
        return self not in (ErrorCode.INVALID, ErrorCode.UNKNOWN_SESSION)


class FrameTooLarge(ValueError):
    """A peer announced a message larger than the reader accepts."""


def _padded(size: int) -> int:
    return -size % _ALIGN


def encode(tensors: list[torch.Tensor], meta: dict[str, Any] | None = None) -> bytes:
    """One frame: header length, msgpack header, then each tensor's bytes (aligned)."""
    parts = [_raw_bytes(t) for t in tensors]
    header = MSGPackSerializer.dumps({"meta": meta or {}, "tensors": [
        [str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]})
    chunks = [len(header).to_bytes(4, "big"), header, bytes(_padded(4 + len(header)))]
    for raw in parts:
        chunks += [raw, bytes(_padded(len(raw)))]
    return b"".join(chunks)


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes in C order. A CPU tensor that numpy can view takes one call (the hop path runs cold,
    where every torch call costs tens of microseconds); others (bfloat16, strided, on a GPU) are copied first."""
    if tensor.device.type == "cpu" and tensor.dtype != torch.bfloat16 and not tensor.requires_grad \
            and tensor.is_contiguous():
        return tensor.numpy().tobytes()
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _header(frame: bytes | bytearray) -> tuple[dict[str, Any], int]:
    """A frame's msgpack header and where it ends; raises ValueError."""
    if len(frame) < 4:
        raise ValueError("truncated frame")
    header_end = _HEADER_LENGTH_BYTES + int.from_bytes(frame[:_HEADER_LENGTH_BYTES], "big")
    if header_end - 4 > MAX_HEADER_BYTES:  # before unpacking: a header may hold millions of tiny objects
        raise ValueError(f"frame header of {header_end - 4} bytes (at most {MAX_HEADER_BYTES})")
    if header_end > len(frame):
        raise ValueError("truncated frame header")
    try:
        header = unpack_header(bytes(frame[4:header_end]))
    except (ValueError, RecursionError, msgpack.UnpackException) as e:  # msgpack's own errors are ValueErrors mostly
        raise ValueError(f"undecodable frame header ({type(e).__name__})") from None
    if not isinstance(header, dict) or not isinstance(header.get("meta"), dict) or \
            not isinstance(header.get("tensors"), list):
        raise ValueError("frame header must hold 'meta' (a dict) and 'tensors' (a list)")
    return header, header_end


def unpack_header(data: bytes) -> Any:
    """A frame header, as MSGPackSerializer packed it: tuples are hivemind's ext type 0x40, and any other ext type is
    refused (ValueError) without running or logging anything (hivemind's own hook logs each unknown one, and runs
    its registered types: a stranger's message must cost nothing like that)."""
    return msgpack.unpackb(data, raw=False, ext_hook=_tuples_only)


def _tuples_only(code: int, data: bytes) -> tuple[Any, ...]:
    if code != TUPLE_EXT_CODE:
        raise ValueError(f"msgpack ext type {code} in a frame header")
    return tuple(unpack_header(data))


def decode_meta(frame: bytes | bytearray) -> dict[str, Any]:
    """Only a frame's meta, without touching its tensors (a server checks who is asking first)."""
    return _header(frame)[0]["meta"]  # type: ignore[no-any-return]


def decode(frame: bytes | bytearray) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """(tensors, meta) of a frame; raises ValueError on anything malformed. Tensors share a copy of its bytes."""
    header, header_end = _header(frame)
    buffer = bytearray(frame)  # writable and owned: the tensors outlive the network buffer
    offset = header_end + _padded(header_end)
    tensors = []
    for spec in header["tensors"]:
        dtype, shape = _tensor_spec(spec)
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        if offset + nbytes > len(buffer):
            raise ValueError("frame shorter than its tensors")
        flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset) if count else torch.empty(0, dtype=dtype)
        tensors.append(flat.view(shape))
        offset += nbytes + _padded(nbytes)
    if offset < len(buffer):  # what encode() writes, exactly: nothing may ride along unaccounted
        raise ValueError(f"frame has {len(buffer) - offset} bytes beyond its tensors")
    return tensors, header["meta"]


def _tensor_spec(spec: Any) -> tuple[torch.dtype, list[int]]:
    if not (isinstance(spec, list) and len(spec) == 2 and spec[0] in DTYPES and isinstance(spec[1], list)
            and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 1 << 31 for s in spec[1])
            and len(spec[1]) <= 8):
        raise ValueError(f"bad tensor description {str(spec)[:80]} (dtypes: {', '.join(DTYPES)})")
    return DTYPES[spec[0]], spec[1]


# ---- streams: an 8-byte length, then the frame --------------------------------------------------------------

def length_prefixed(frame: bytes) -> bytes:
    """One stream message: the frame's length in 8 bytes (big-endian), then the frame."""
    return len(frame).to_bytes(_LENGTH_BYTES, "big") + frame


def write_frame(writer: asyncio.StreamWriter, frame: bytes) -> None:
    """Queue one message with a single write (one packet through p2pd for small frames)."""
    writer.write(length_prefixed(frame))


def write_frames(writer: asyncio.StreamWriter, frames: list[bytes]) -> None:
    """Queue several messages back to back with a single write (pipelined: no answer is awaited in between)."""
    writer.write(b"".join(length_prefixed(frame) for frame in frames))


def step_frame_limit(*, batch: int, tokens: int, mask_length: int, hidden_size: int, itemsize: int = 4) -> int:
    """The largest message carrying `tokens` new tokens of `batch` rows: hidden states (`itemsize` bytes, float32 at
    most), the attention mask over `mask_length` and the position ids (int64 at most), and a header (meta, padding)."""
    return batch * (tokens * (hidden_size * itemsize + 8) + mask_length * 8 + 16) + OPEN_FRAME_LIMIT


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    """The next message; IncompleteReadError at the end of the stream, FrameTooLarge over `max_bytes` (having read
    only the 8-byte length) or with a header over MAX_HEADER_BYTES (having read only the 4 bytes more that say so)."""
    length = int.from_bytes(await reader.readexactly(_LENGTH_BYTES), "big")
    if length > max_bytes:
        raise FrameTooLarge(f"message of {length} bytes exceeds the limit of {max_bytes}")
    if length < _HEADER_LENGTH_BYTES:
        return await reader.readexactly(length)  # too short for a frame: decode() says so
    head = await reader.readexactly(_HEADER_LENGTH_BYTES)
    header_bytes = int.from_bytes(head, "big")
    if header_bytes > MAX_HEADER_BYTES:  # before reading the rest: a step's frame may be megabytes
        raise FrameTooLarge(f"frame header of {header_bytes} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    return head + await reader.readexactly(length - _HEADER_LENGTH_BYTES)


# ---- answers -------------------------------------------------------------------------------------------

def encode_error(code: ErrorCode, message: str) -> bytes:
    """A frame that carries only an error."""
    return encode([], {"error": {"code": code.value, "message": message}})


def response_error(meta: dict[str, Any]) -> tuple[ErrorCode, str] | None:
    """The (code, message) carried by a response, if it is an error."""
    err = meta.get("error")
    if not err:
        return None
    try:
        return ErrorCode(err.get("code")), str(err.get("message"))
    except (ValueError, AttributeError):
        return ErrorCode.INTERNAL, str(err)
