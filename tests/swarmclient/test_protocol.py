"""The wire format: every dtype and shape survives a round trip; anything malformed is a ValueError."""
from __future__ import annotations

import asyncio

import pytest
import torch

from swarmclient import protocol


@pytest.mark.parametrize("dtype", list(protocol.DTYPES.values()), ids=list(protocol.DTYPES))
def test_a_frame_round_trips_every_supported_dtype(dtype: torch.dtype) -> None:
    source = (torch.randn(2, 3, 5) * 100).to(dtype)
    tensors, meta = protocol.decode(protocol.encode([source, torch.arange(7)[None]], {"step": 3, "rows": [0, 2]}))
    assert meta == {"step": 3, "rows": [0, 2]}
    assert tensors[0].dtype == dtype and torch.equal(tensors[0], source)
    assert torch.equal(tensors[1], torch.arange(7)[None])


def test_empty_and_strided_tensors_round_trip() -> None:
    strided = torch.arange(24, dtype=torch.float32).view(4, 6)[:, ::2]  # not contiguous
    tensors, meta = protocol.decode(protocol.encode([torch.empty(0, 4), strided]))
    assert meta == {} and tensors[0].shape == (0, 4) and torch.equal(tensors[1], strided)


def test_decoded_tensors_are_writable_and_do_not_share_the_frame() -> None:
    frame = protocol.encode([torch.zeros(3)])
    (tensor,), _ = protocol.decode(frame)
    tensor += 1  # would fail (or corrupt the network buffer) on a read-only view of the frame
    assert protocol.decode(frame)[0][0].sum() == 0


@pytest.mark.parametrize("frame, message", [
    (b"", "truncated frame"),
    (b"\x00\x00\x00\x09abc", "truncated frame header"),
    (protocol.encode([torch.zeros(64)])[:-40], "shorter than its tensors"),
    (b"\x00\x00\x00\x01\x01", "must hold 'meta'"),
    (protocol.encode([torch.zeros(2)]).replace(b"float32", b"float99"), "bad tensor description"),
])
def test_a_malformed_frame_is_a_value_error(frame: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        protocol.decode(frame)


def test_a_stream_message_over_the_readers_limit_is_refused_before_it_is_read() -> None:
    async def read(limit: int) -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data((1 << 40).to_bytes(8, "big"))  # announces a terabyte; none of it follows
        return await protocol.read_frame(reader, limit)

    with pytest.raises(protocol.FrameTooLarge, match="exceeds the limit"):
        asyncio.run(read(1 << 20))


def test_stream_messages_are_length_prefixed_frames() -> None:
    async def round_trip() -> list[bytes]:
        reader = asyncio.StreamReader()
        for frame in (protocol.encode([torch.ones(2)], {"a": 1}), protocol.encode([], {"b": 2})):
            reader.feed_data(len(frame).to_bytes(8, "big") + frame)
        reader.feed_eof()
        frames = [await protocol.read_frame(reader, 1 << 20) for _ in range(2)]
        with pytest.raises(asyncio.IncompleteReadError):
            await protocol.read_frame(reader, 1 << 20)
        return frames

    first, second = asyncio.run(round_trip())
    assert protocol.decode(first)[1] == {"a": 1} and protocol.decode(second)[1] == {"b": 2}
