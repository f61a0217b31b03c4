"""The wire format: every dtype and shape survives a round trip; anything malformed is a ValueError."""
from __future__ import annotations

import asyncio

import pytest
import torch

from swarmnet import protocol


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
    (protocol.encode([torch.zeros(2)]) + b"\x00" * 16, "16 bytes beyond its tensors"),
    # a header of 1.5 M empty msgpack arrays took seconds and hundreds of MiB to unpack: refused by its length
    ((1 << 20).to_bytes(4, "big") + b"\x90" * (1 << 20), "frame header of 1048576 bytes"),
    # an ext type other than the tuples hivemind packs: refused, never run
    (b"\x00\x00\x00\x03\xd4\x51\x80", "undecodable frame header"),
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


def test_messages_written_back_to_back_are_read_one_by_one() -> None:
    class Sink:
        def __init__(self) -> None:
            self.writes: list[bytes] = []

        def write(self, data: bytes) -> None:
            self.writes.append(data)

    async def round_trip() -> list[dict]:
        sink = Sink()
        protocol.write_frames(sink, [protocol.encode([], {"open": True}), protocol.encode([torch.ones(3)], {"s": 1})])  # type: ignore[arg-type]
        assert len(sink.writes) == 1  # one write: the open message and the first step leave together
        reader = asyncio.StreamReader()
        reader.feed_data(sink.writes[0])
        return [protocol.decode(await protocol.read_frame(reader, 1 << 16))[1] for _ in range(2)]

    assert asyncio.run(round_trip()) == [{"open": True}, {"s": 1}]


@pytest.mark.parametrize("batch, tokens, past", [(1, 1, 0), (1, 1, 2047), (3, 17, 100), (8, 512, 0)])
def test_the_step_limit_admits_the_largest_step_of_a_shape_and_not_a_token_more(batch: int, tokens: int,
                                                                              past: int) -> None:
    hidden_size, max_length = 64, past + tokens

    def step(length: int) -> bytes:
        return protocol.encode([torch.zeros(batch, length, hidden_size), torch.ones(batch, past + length, dtype=torch.long),
                                torch.zeros(batch, length, dtype=torch.long)],
                               {"session_id": "f" * 32, "keep_rows": list(range(batch))})

    limit = protocol.step_frame_limit(batch=batch, tokens=tokens, mask_length=max_length, hidden_size=hidden_size)
    assert len(step(tokens)) <= limit
    # the slack is one small frame: a step of 300 more tokens' hidden states does not fit
    assert len(step(tokens + 300)) > limit


def test_nothing_before_a_session_may_exceed_the_open_limit() -> None:
    async def read(length: int) -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(length.to_bytes(8, "big") + bytes(16))
        return await protocol.read_frame(reader, protocol.OPEN_FRAME_LIMIT)

    with pytest.raises(protocol.FrameTooLarge, match="exceeds the limit of 65536"):
        asyncio.run(read(2 << 30))
