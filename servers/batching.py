"""Server-side batching: concurrent decode steps of different sessions on the same blocks run as one forward.

Sessions have caches of different lengths. Where the family's attention goes through transformers' registry (every
family but Falcon), the layers' linear parts run once on all the sessions' rows and the attention runs per session on
its own cache, appended in place (merged_attention.py, `BlockSpan.forward_sessions`): nothing is copied.

Otherwise (Falcon) a merged step left-pads each session's per-layer K/V to the longest, stacks them along the batch,
masks the padding out (zeros in the 2D mask), keeps each session's own position ids, and runs the layers once on a
fresh set of caches; each session then gets back only its new K/V column, so its own cache ends as if it had run
alone. Left-padding keeps every query-to-key distance, so causal and sliding-window masks are unchanged for the real
tokens.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from servers.counters import ServerCounters
from servers.kv_cache import GrowingLayer
from servers.span import BlockSpan, DecodeStep, row_bounds

SpanKey = tuple[int, int]


def layer_kv(cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A one-layer cache's (keys, values), each [b, kv_heads, length, head_dim]; None while it is empty."""
    if cache.get_seq_length() == 0:
        return None
    layer = cache.layers[0]
    # spans cache attention K/V only (DynamicLayer); anything else here is a bug, not a request error
    assert isinstance(layer, DynamicLayer) and layer.keys is not None and layer.values is not None
    return layer.keys, layer.values


def stack_left_padded(tensors: list[torch.Tensor | None], rows: list[int], length: int) -> torch.Tensor:
    """[b_i, heads, len_i, dim] tensors (None = empty), left-padded with zeros to `length`, stacked on the batch,
    plus one free column at the end (the step's, written by GrowingLayer.update in place)."""
    like = next(t for t in tensors if t is not None)
    out = like.new_empty(sum(rows), like.shape[1], length + 1, like.shape[3])
    row = 0
    for tensor, count in zip(tensors, rows, strict=True):
        past = 0 if tensor is None else tensor.shape[2]
        # padding must be finite: masked weights are 0, and 0 * garbage could be NaN
        out[row:row + count, :, :length - past].zero_()
        if tensor is not None:
            out[row:row + count, :, length - past:length].copy_(tensor)
        row += count
    return out


def merged_caches(steps: list[DecodeStep], length: int) -> list[DynamicCache]:
    """Fresh one-layer caches holding every session's K/V, left-padded to `length` and stacked on the batch, with a
    free column for the step's own K/V: the merged past is copied once per step (into the buffer), not twice."""
    rows = [step.rows for step in steps]
    caches = []
    for layer in range(len(steps[0].caches)):
        kvs = [layer_kv(step.caches[layer]) for step in steps]
        cache = DynamicCache()
        if any(kv is not None for kv in kvs):
            keys = stack_left_padded([kv[0] if kv else None for kv in kvs], rows, length)
            values = stack_left_padded([kv[1] if kv else None for kv in kvs], rows, length)
            cache.layers.append(GrowingLayer.over(keys, values, length))
        caches.append(cache)
    return caches


@torch.inference_mode()  # the sessions' caches are inference tensors, appended to in place (kv_cache.py)
def run_merged(span: BlockSpan, steps: list[DecodeStep], start: int, end: int) -> list[torch.Tensor]:
    """Run N sessions' decode steps through blocks [start, end) as one forward; returns each one's output.

    Each session's caches get its new K/V column appended, as a forward of its own would have done.
    """
    if len(steps) == 1:  # nothing to merge: run on the session's own caches, no copy
        step = steps[0]
        return [span(step.hidden, step.mask, step.positions, step.caches, start, end)]
    if span.merges_per_session:  # the attention per session on its own cache: nothing copied
        return span.forward_sessions(steps, start, end)
    pasts = [step.caches[0].get_seq_length() for step in steps]
    length = max(pasts)
    hidden = torch.cat([step.hidden.to(span.compute_dtype) for step in steps])
    mask = torch.cat([F.pad(step.mask, (length - past, 0)) for step, past in zip(steps, pasts, strict=True)])  # 0 = padding
    positions = torch.cat([step.positions for step in steps])
    caches = merged_caches(steps, length)
    output = span(hidden, mask, positions, caches, start, end)
    bounds = row_bounds(steps)
    for layer, cache in enumerate(caches):
        kv = layer_kv(cache)
        assert kv is not None
        new_keys, new_values = kv[0][:, :, -1:], kv[1][:, :, -1:]
        for step, (low, high) in zip(steps, bounds, strict=True):
            step.caches[layer].update(new_keys[low:high], new_values[low:high], 0)
    return [output[low:high] for low, high in bounds]


@dataclass
class _Pending:
    step: DecodeStep
    future: asyncio.Future[tuple[torch.Tensor, int]]


class DecodeBatcher:
    """Gathers concurrent decode steps per span [start, end) for up to `wait_ms`, then runs them as one forward.

    A group runs at once when every open session on its span has a step in it (waiting longer gains nothing),
    or when one more step would take it past `max_rows`. The forward runs on the event loop, like any decode step.
    Where merging copies the caches (Falcon: `span.merges_per_session` is False), a session caching more than
    `max_merge_tokens` (rows x length) runs alone at once: on a CPU copying a big cache costs as much as the weight
    reads the merge saves (docs/swarm.md).
    """

    def __init__(self, span: BlockSpan, *, wait_ms: float, max_rows: int, stats: ServerCounters,
                 max_merge_tokens: int = 2048) -> None:
        self.span, self.wait, self.max_rows, self.stats = span, wait_ms / 1000, max_rows, stats
        self.max_merge_tokens = max_merge_tokens
        self._groups: dict[SpanKey, list[_Pending]] = {}
        self._timers: dict[SpanKey, asyncio.TimerHandle] = {}

    async def run(self, step: DecodeStep, start: int, end: int, *, peers: int) -> tuple[torch.Tensor, int]:
        """(the step's output, how many sessions its forward merged); `peers`: open sessions on [start, end)."""
        key = (start, end)
        if not self.span.merges_per_session and step.cached_tokens > self.max_merge_tokens:
            return run_merged(self.span, [step], start, end)[0], 1
        if sum(p.step.rows for p in self._groups.get(key, [])) + step.rows > self.max_rows:
            self._flush(key)
        loop = asyncio.get_running_loop()
        pending = _Pending(step, loop.create_future())
        group = self._groups.setdefault(key, [])
        group.append(pending)
        if self.wait <= 0 or len(group) >= peers or sum(p.step.rows for p in group) >= self.max_rows:
            self._flush(key)
        elif key not in self._timers:
            self._timers[key] = loop.call_later(self.wait, self._flush, key)
        return await pending.future

    def _flush(self, key: SpanKey) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        group = [p for p in self._groups.pop(key, []) if not p.future.done()]  # done = its stream was cancelled
        if not group:
            return
        try:
            outputs = run_merged(self.span, [p.step for p in group], *key)
        except Exception as e:  # every session of the forward gets the error, in band
            for pending in group:
                pending.future.set_exception(e)
            return
        if len(group) > 1:
            self.stats.record_merge(sessions=len(group), rows=sum(p.step.rows for p in group))
        for pending, output in zip(group, outputs, strict=True):
            pending.future.set_result((output, len(group)))
