"""A session's KV cache grows in place (servers/kv_cache.py): the same outputs as transformers' concatenating cache,
bit for bit, for every family; a decode step writes into the buffer without copying the past; the buffer stays
within max_length; dropping rows (keep_rows) starts a new buffer from the rows kept."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from modelprep.tiny import TINY_ARCHS, write_tiny_model
from servers.block_loading import load_span
from servers.kv_cache import GROW_MIN_TOKENS, GrowingLayer, session_caches
from servers.span import BlockSpan
from swarmnet.model_spec import ModelSpec

BATCH, PROMPT, STEPS = 4, 11, 40


@pytest.fixture(scope="module", params=TINY_ARCHS)
def span(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> BlockSpan:
    model = write_tiny_model(tmp_path_factory.mktemp("kv") / request.param, layers=3, arch=request.param, seed=3)
    return load_span(ModelSpec.open(model), 0, 3)


def padded_prompt(span: BlockSpan, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A left-padded prompt step (row r has r pads)."""
    mask = torch.ones(BATCH, PROMPT, dtype=torch.long)
    for row in range(BATCH):
        mask[row, :row] = 0
    hidden = torch.randn(BATCH, PROMPT, span.spec.hidden_size, generator=generator)
    return hidden, mask, (mask.cumsum(1) - 1).clamp(min=0)


def decode(span: BlockSpan, caches: list[DynamicCache], *, keep_at: int | None = None) -> torch.Tensor:
    """A prompt and STEPS decode steps on `caches` (the same random inputs every call); at step `keep_at` the
    session keeps rows 1 and 3 only (as keep_rows does). Every output, concatenated along the tokens."""
    generator = torch.Generator().manual_seed(0)
    hidden, mask, positions = padded_prompt(span, generator)
    outputs = [span(hidden, mask, positions, caches)]
    for step in range(STEPS):
        if step == keep_at:
            kept = torch.tensor([1, 3])
            for cache in caches:
                cache.batch_select_indices(kept)
                layer = cache.layers[0]
                if isinstance(layer, GrowingLayer):  # the buffer of all rows is let go at once
                    assert layer.capacity == 0 and layer.keys is not None and layer.keys.shape[0] == 2
            mask, positions, outputs = mask[kept], positions[:, -1:][kept], [o[kept] for o in outputs]
        positions = positions[:, -1:] + 1
        mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=torch.long)], 1)
        outputs.append(span(torch.randn(mask.shape[0], 1, span.spec.hidden_size, generator=generator), mask,
                            positions, caches))
    return torch.cat(outputs, 1)


def concatenating(span: BlockSpan) -> list[DynamicCache]:
    """transformers' own caches: the reference."""
    return [DynamicCache() for _ in range(span.start, span.end)]


def test_outputs_equal_the_concatenating_cache_bit_for_bit(span: BlockSpan) -> None:
    caches = span.new_caches(span.start, span.end, PROMPT + STEPS)
    assert all(isinstance(cache.layers[0], GrowingLayer) for cache in caches)
    assert torch.equal(decode(span, caches), decode(span, concatenating(span)))


def test_dropping_rows_starts_a_new_buffer_from_the_rows_kept(span: BlockSpan) -> None:
    caches = span.new_caches(span.start, span.end, PROMPT + STEPS)
    grown = decode(span, caches, keep_at=STEPS // 2)
    assert torch.equal(grown, decode(span, concatenating(span), keep_at=STEPS // 2))
    layer = caches[0].layers[0]
    assert layer.keys is not None and layer.keys.shape[0] == 2 and layer.get_seq_length() == PROMPT + STEPS


def test_a_decode_step_writes_in_place_and_the_buffer_grows_rarely() -> None:
    layer = GrowingLayer()
    keys, values = torch.randn(2, 3, 100, 8), torch.randn(2, 3, 100, 8)
    layer.update(keys, values)
    assert layer.capacity == 100 + 100 // 4
    capacities, in_place = [layer.capacity], 0
    for _ in range(200):
        before = layer.keys.data_ptr()
        new_keys, new_values = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8)
        out_keys, out_values = layer.update(new_keys, new_values)
        keys, values = torch.cat([keys, new_keys], 2), torch.cat([values, new_values], 2)
        assert torch.equal(out_keys, keys) and torch.equal(out_values, values)
        if layer.capacity == capacities[-1]:
            in_place += out_keys.data_ptr() == before
        else:
            capacities.append(layer.capacity)
    assert capacities == [125, 157, 197, 247, 310]  # a quarter more each time: 4 copies of the past in 200 steps
    assert in_place == 200 - 4
    assert layer.get_seq_length() == 300


def test_the_buffer_never_holds_more_than_max_length() -> None:
    layer = GrowingLayer(max_length=30)
    layer.update(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4))
    assert layer.capacity == 10 + GROW_MIN_TOKENS
    for _ in range(20):
        layer.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    assert layer.capacity == 30 and layer.get_seq_length() == 30


def test_a_cropped_cache_writes_over_its_dropped_tokens() -> None:
    layer = GrowingLayer()
    keys = torch.randn(1, 2, 6, 4)
    layer.update(keys, keys)
    layer.crop(-2)
    new = torch.randn(1, 2, 1, 4)
    out_keys, _ = layer.update(new, new)
    assert torch.equal(out_keys, torch.cat([keys[:, :, :4], new], 2))


def test_a_layer_over_a_buffer_writes_the_next_token_into_its_free_column() -> None:
    """What a merged decode step runs on (batching.py): a padded past of 5 tokens and one free column."""
    keys, values = torch.randn(3, 2, 6, 4), torch.randn(3, 2, 6, 4)
    layer = GrowingLayer.over(keys, values, 5)
    assert layer.get_seq_length() == 5 and layer.capacity == 6
    new_keys, new_values = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
    out_keys, out_values = layer.update(new_keys, new_values)
    assert out_keys.data_ptr() == keys.data_ptr() and torch.equal(keys[:, :, 5:], new_keys)
    assert torch.equal(out_values, values) and layer.get_seq_length() == 6


def test_session_caches_are_one_growing_layer_per_block() -> None:
    caches = session_caches(3, max_length=50)
    assert len(caches) == 3 and all(len(c.layers) == 1 and c.layers[0].max_length == 50 for c in caches)
    assert all(c.get_seq_length() == 0 for c in caches)


def test_a_session_opened_on_a_server_gets_growing_caches(tmp_path: Path) -> None:
    """What handler.py opens a session with: the span's caches bounded by the session's max_length."""
    model = write_tiny_model(tmp_path / "m", layers=2, seed=4)
    span = load_span(ModelSpec.open(model), 0, 2)
    caches = span.new_caches(0, 2, 64)
    assert [type(c.layers[0]) for c in caches] == [GrowingLayer, GrowingLayer]
    assert all(c.layers[0].max_length == 64 for c in caches)
