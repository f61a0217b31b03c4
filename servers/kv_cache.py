"""A session's KV cache: one `DynamicCache` per block whose layer grows in place (`GrowingLayer`).

transformers' `DynamicLayer` appends a step's keys and values with `torch.cat`, which copies the whole cached past of
the layer at every step: at batch 8 and 60–100 cached tokens the copies took 35 % of a decode step of the WAN
bench's tiny model (torch.profiler), and a decode step of 15 SmolLM2 blocks at batch 8 and 2048 cached tokens took
1.61x as long as with this cache (bench/kv_cache.py). `GrowingLayer` keeps them in a buffer with room to spare (a
quarter of what it holds, at least GROW_MIN_TOKENS, never past the session's max_length) and writes each step into the
free columns; it copies the past only when the buffer is full, so a decode step copies O(1) tokens on average instead
of the past. The cached keys and values it hands the attention are views of the buffer's filled columns: the same
values as the concatenated ones, and the attention computes bit-identical outputs from them
(tests/servers/test_kv_cache.py).

Dropping rows (`batch_select_indices`, keep_rows) drops the buffer at once, and the next step starts a new one from
the rows kept; anything else that replaces its tensors leaves the buffer behind, and the next step sees that too.
Memory stays within the session's reservation (servers/memory.py counts batch x max_length): a buffer never holds more
than max_length tokens.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GROW_MIN_TOKENS = 16  # a full buffer grows by a quarter of what it holds, and by at least this many tokens


class GrowingLayer(DynamicLayer):
    """A one-layer KV cache that appends in place into a buffer [batch, heads, capacity, head_dim]."""

    def __init__(self, max_length: int | None = None) -> None:
        super().__init__()
        self.max_length = max_length
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    @classmethod
    def over(cls, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int) -> GrowingLayer:
        """A layer holding the first `length` tokens of these buffers, their other columns free (a merged decode step's
        padded past and its one free column: batching.py)."""
        layer = cls(max_length=key_buffer.shape[2])
        layer.lazy_initialization(key_buffer, value_buffer)
        layer._key_buffer, layer._value_buffer = key_buffer, value_buffer
        layer.keys, layer.values = key_buffer[:, :, :length], value_buffer[:, :, :length]
        return layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the step's keys and values [batch, heads, T, dim]; returns every cached one (views of the buffer)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        past = self.get_seq_length()
        length = past + key_states.shape[-2]
        if not self._has_room(key_states, value_states, past, length):
            self._regrow(key_states, value_states, past, length)
        keys, values = self._key_buffer, self._value_buffer
        assert keys is not None and values is not None
        keys[:, :, past:length] = key_states
        values[:, :, past:length] = value_states
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only these rows; the buffer of all rows is let go now (the session's reservation has just shrunk)."""
        super().batch_select_indices(indices)
        self._key_buffer = self._value_buffer = None

    def _has_room(self, key_states: torch.Tensor, value_states: torch.Tensor, past: int, length: int) -> bool:
        """Whether the buffer holds the cached past (nothing replaced it) and has room for `length` tokens of this
        step's shape and dtype."""
        keys, values = self._key_buffer, self._value_buffer
        if keys is None or values is None or length > keys.shape[2]:
            return False
        if keys.shape[:2] != key_states.shape[:2] or keys.dtype != key_states.dtype or \
                values.shape[:2] != value_states.shape[:2] or values.shape[3] != value_states.shape[3]:
            return False
        cached = self.keys
        return past == 0 or (cached is not None and cached.data_ptr() == keys.data_ptr()
                             and cached.stride() == keys.stride())

    def _regrow(self, key_states: torch.Tensor, value_states: torch.Tensor, past: int, length: int) -> None:
        """A new buffer with room for `length` tokens and a quarter more, holding the cached past."""
        capacity = length + max(length // 4, GROW_MIN_TOKENS)
        if self.max_length is not None:
            capacity = max(length, min(capacity, self.max_length))
        batch, heads = key_states.shape[:2]
        key_buffer = key_states.new_empty(batch, heads, capacity, key_states.shape[3])
        value_buffer = value_states.new_empty(batch, value_states.shape[1], capacity, value_states.shape[3])
        if past:
            assert self.keys is not None and self.values is not None
            key_buffer[:, :, :past] = self.keys
            value_buffer[:, :, :past] = self.values
        self._key_buffer, self._value_buffer = key_buffer, value_buffer

    @property
    def capacity(self) -> int:
        """Tokens the buffer has room for (0 before the first step)."""
        return 0 if self._key_buffer is None else self._key_buffer.shape[2]


def session_caches(count: int, max_length: int | None = None) -> list[DynamicCache]:
    """Empty KV caches for `count` blocks, one layer each, growing in place up to `max_length` tokens."""
    caches = []
    for _ in range(count):
        cache = DynamicCache()
        cache.layers.append(GrowingLayer(max_length))  # (each block's attention has layer index 0 in its cache)
        caches.append(cache)
    return caches
