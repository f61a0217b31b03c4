"""RPC names and message encoding shared by block servers and the client.

Every message is a hivemind `ExpertRequest`/`ExpertResponse`: tensors serialized without compression, and a
msgpack metadata dict. Errors travel in-band as metadata {"error": {"code", "message"}} so that a stream
survives a rejected step and the client can tell "route around this server" from "my request is wrong".
"""
from __future__ import annotations

from enum import Enum
from typing import Any

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

RPC_INFO = "swarmbatch.info"
RPC_FORWARD = "swarmbatch.forward"
RPC_INFERENCE = "swarmbatch.inference"

# hivemind's persistent connections cap unary messages at 4 MiB; keep requests well under it
MAX_UNARY_BYTES = 3 << 20


class ErrorCode(str, Enum):
    """Why a server refused a request; decides what the client does next."""

    INVALID = "invalid_request"      # malformed: a client bug, never retried
    CACHE_FULL = "cache_full"        # no room for the session now: route around this server
    BUSY = "busy"                    # too many sessions: route around
    UNKNOWN_SESSION = "unknown_session"  # a step for a session this stream did not open
    INTERNAL = "internal"            # the server failed: route around

    @property
    def retryable(self) -> bool:
        """Whether another server (or a later try) may succeed."""
        return self not in (ErrorCode.INVALID, ErrorCode.UNKNOWN_SESSION)


def make_request(tensors: list[torch.Tensor], meta: dict[str, Any]) -> runtime_pb2.ExpertRequest:
    """Pack tensors and metadata into a request."""
    return runtime_pb2.ExpertRequest(
        tensors=[serialize_torch_tensor(t) for t in tensors], metadata=MSGPackSerializer.dumps(meta)
    )


def make_response(tensors: list[torch.Tensor], meta: dict[str, Any] | None = None) -> runtime_pb2.ExpertResponse:
    """Pack tensors and metadata into a response."""
    return runtime_pb2.ExpertResponse(
        tensors=[serialize_torch_tensor(t) for t in tensors], metadata=MSGPackSerializer.dumps(meta or {})
    )


def make_error(code: ErrorCode, message: str) -> runtime_pb2.ExpertResponse:
    """A response that carries only an error."""
    return runtime_pb2.ExpertResponse(
        metadata=MSGPackSerializer.dumps({"error": {"code": code.value, "message": message}})
    )


def read_message(msg: runtime_pb2.ExpertRequest | runtime_pb2.ExpertResponse) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Unpack tensors and metadata; raises ValueError on garbage."""
    meta = MSGPackSerializer.loads(msg.metadata) if msg.metadata else {}
    if not isinstance(meta, dict):
        raise ValueError("metadata is not a dict")
    return [deserialize_torch_tensor(t) for t in msg.tensors], meta


def response_error(meta: dict[str, Any]) -> tuple[ErrorCode, str] | None:
    """The (code, message) carried by a response, if it is an error."""
    err = meta.get("error")
    if not err:
        return None
    try:
        return ErrorCode(err.get("code")), str(err.get("message"))
    except ValueError:
        return ErrorCode.INTERNAL, str(err)
