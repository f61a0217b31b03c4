"""A server's span times its blocks' few-row product forms at start-up and keeps each row count's fastest."""
from __future__ import annotations

import fcntl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from servers import span_forms
from servers.block_loading import load_span
from servers.config import DType
from servers.span import BlockSpan
from servers.span_forms import ROW_FORMS_ENV, tune_span
from swarmnet.model_spec import ModelSpec
from swarmnet.product_forms import FORMS, PACKED, TIMING_ROUNDS, TUNED_ROWS, FormLinear, packed_available


def span_of(tiny_model: Path, dtype: DType = DType.float32) -> BlockSpan:
    return load_span(ModelSpec.open(tiny_model), 0, 3, dtype=dtype)


def challenger_wins() -> Iterator[float]:
    """A clock under which the second form timed (paired or transposed) takes half F.linear's time."""
    now = 0.0
    while True:
        for seconds in (0.010, 0.005):
            yield now
            now += seconds
            yield now


def scripted(linear: float, challenger: float, packed: float) -> Callable[[], float]:
    """A clock for a span timed with the packed form: each form of each row count takes its seconds, in the order
    tune_span runs them (rows 1..TUNED_ROWS: F.linear, the dense challenger, packed; LAYOUT_ROWS: F.linear, packed)."""
    costs = [linear, challenger, packed] * TIMING_ROUNDS * TUNED_ROWS + [linear, packed] * TIMING_ROUNDS

    def ticks() -> Iterator[float]:
        now = 0.0
        yield now  # tune_span's own start
        for seconds in costs:
            yield now
            now += seconds
            yield now
        while True:
            yield now
    return ticks().__next__


def decode(span: BlockSpan, rows: int) -> torch.Tensor:
    """A 6-token prefill of `rows` rows, then 3 decode steps; the last step's output."""
    generator = torch.Generator().manual_seed(rows)
    caches = span.new_caches(span.start, span.end)
    hidden = span.spec.hidden_size
    span(torch.randn(rows, 6, hidden, generator=generator), torch.ones(rows, 6, dtype=torch.long),
         torch.arange(6).expand(rows, -1), caches)
    out = torch.empty(0)
    for step in range(6, 9):
        out = span(torch.randn(rows, 1, hidden, generator=generator), torch.ones(rows, step + 1, dtype=torch.long),
                   torch.full((rows, 1), step), caches)
    return out


def test_a_span_keeps_each_row_counts_faster_form_and_its_decode_steps_take_it(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a tiny span counted as big enough to tune, a torch without the packed form, and a clock under which the
    # other dense forms are twice as fast
    monkeypatch.setattr(span_forms, "TUNED_MIN_SPAN_WEIGHTS", 0)
    monkeypatch.setattr(span_forms, "packed_available", lambda: False)
    span, plain = span_of(tiny_model), span_of(tiny_model)
    table = tune_span(span, clock=challenger_wins().__next__)
    # Then every row count up to TUNED_ROWS keeps the other form, in every linear layer of the span
    assert table is not None and table.choices == {1: "paired", **{r: "transposed" for r in range(2, TUNED_ROWS + 1)}}
    linears = [m for m in span.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, FormLinear) and m.table is table for m in linears)
    # And decode steps of 1 and 3 rows take those forms, with outputs equal to F.linear's up to float rounding
    taken: list[str] = []
    for name in ("paired", "transposed"):
        form = FORMS[name]
        monkeypatch.setitem(FORMS, name, lambda x, w, form=form, name=name: taken.append(name) or form(x, w))
    for rows in (1, 3):
        assert torch.allclose(decode(span, rows), decode(plain, rows), rtol=1e-4, atol=1e-5)
    assert {"paired", "transposed"} <= set(taken)


needs_packed = pytest.mark.skipif(not packed_available(), reason="this torch build has no oneDNN packed product")


@needs_packed
def test_a_span_whose_packed_steps_take_clearly_less_time_in_all_goes_packed_and_frees_its_dense_weights(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a tiny span counted as big enough to tune, and a clock under which the packed form is the fastest
    monkeypatch.setattr(span_forms, "TUNED_MIN_SPAN_WEIGHTS", 0)
    span, plain = span_of(tiny_model), span_of(tiny_model)
    table = tune_span(span, clock=scripted(0.010, 0.005, 0.004))  # packed 9 x 4 ms against dense 8 x 5 + 10 ms
    # Then every row count takes it, each layer holds only its packed copy, and its steps equal F.linear's
    assert table is not None and table.choices == {} and table.default == PACKED
    linears = [m for m in span.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, FormLinear) and m.packed is not None and not m.weight.numel()
                           for m in linears)
    for rows in (1, 3, 16):
        assert torch.allclose(decode(span, rows), decode(plain, rows), rtol=1e-4, atol=1e-5)


@needs_packed
def test_a_span_whose_packed_steps_are_not_clearly_faster_stays_dense_and_drops_its_packed_copies(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(span_forms, "TUNED_MIN_SPAN_WEIGHTS", 0)
    span = span_of(tiny_model)
    table = tune_span(span, clock=scripted(0.010, 0.005, 0.0051))  # 45.9 ms > MARGIN x 50 ms
    assert table is not None and table.default == "linear"
    assert table.choices == {1: "paired", **{r: "transposed" for r in range(2, TUNED_ROWS + 1)}}
    linears = [m for m in span.modules() if isinstance(m, FormLinear)]
    assert linears and all(m.packed is None and m.weight.numel() for m in linears)


@needs_packed
def test_a_server_with_memory_to_spare_keeps_each_row_counts_fastest_form_of_all_and_both_copies_where_both_are_taken(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a tiny span counted as big enough to tune, and a clock under which the dense challengers beat packed, which
    # beats F.linear (at 16 rows, only F.linear and packed are timed)
    monkeypatch.setattr(span_forms, "TUNED_MIN_SPAN_WEIGHTS", 0)
    span, plain = span_of(tiny_model), span_of(tiny_model)
    weights = sum(m.weight.numel() for m in span.modules() if isinstance(m, torch.nn.Linear))
    # When it is tuned with room for a second float32 copy of its weights
    table = tune_span(span, spare_bytes=4 * weights, clock=scripted(0.010, 0.004, 0.005))
    # Then 1-8 rows keep the dense challenger, more rows take packed, and every layer holds both copies
    assert table is not None and table.default == PACKED
    assert table.choices == {1: "paired", **{r: "transposed" for r in range(2, TUNED_ROWS + 1)}}
    linears = [m for m in span.modules() if isinstance(m, FormLinear)]
    assert linears and all(m.packed is not None and m.weight.numel() for m in linears)
    for rows in (1, 3, 16):
        assert torch.allclose(decode(span, rows), decode(plain, rows), rtol=1e-4, atol=1e-5)
    # And without that room the same timings give the dense layout (packed 45 ms in all against dense 42 ms)
    one_copy = span_of(tiny_model)
    table = tune_span(one_copy, spare_bytes=4 * weights - 1, clock=scripted(0.010, 0.004, 0.005))
    assert table is not None and table.default == "linear"
    assert all(m.packed is None for m in one_copy.modules() if isinstance(m, FormLinear))


def test_a_server_short_of_memory_for_a_packed_copy_to_time_does_not_time_the_packed_form(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Given a tiny span counted as big enough to tune, on a machine with less free memory than twice its packed copy
    monkeypatch.setattr(span_forms, "TUNED_MIN_SPAN_WEIGHTS", 0)
    span = span_of(tiny_model)
    weights = sum(m.weight.numel() for m in span.modules() if isinstance(m, torch.nn.Linear))
    monkeypatch.setattr(span_forms, "free_memory", lambda device: 8 * weights - 1)
    # When it is tuned (the clock of dense forms only: F.linear, then the challenger, twice as fast)
    with caplog.at_level("INFO", logger="servers.span_forms"):
        table = tune_span(span, clock=challenger_wins().__next__)
    # Then it keeps the dense forms, holds no packed copy, and says why
    assert table is not None and table.default == "linear" and table.choices[1] == "paired"
    assert all(m.packed is None and m.weight.numel() for m in span.modules() if isinstance(m, FormLinear))
    assert "the packed form is not timed" in caplog.text


def test_servers_on_one_machine_time_their_forms_one_at_a_time(tiny_model: Path, monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    # Given the machine's timing lock held (by another server, timing its span)
    monkeypatch.setattr(span_forms, "TUNED_MIN_SPAN_WEIGHTS", 0)
    monkeypatch.setattr(span_forms, "TIMING_LOCK", tmp_path / "forms.lock")
    span = span_of(tiny_model)
    tuned: list[object] = []
    with open(tmp_path / "forms.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        # When this span is tuned meanwhile, it waits for the lock
        thread = threading.Thread(target=lambda: tuned.append(tune_span(span)))
        thread.start()
        thread.join(0.5)
        assert thread.is_alive() and not tuned
    # Then once the other server is done, it times its forms
    thread.join(60)
    assert not thread.is_alive() and tuned and tuned[0] is not None


def test_a_span_small_enough_to_stay_in_cache_or_not_float32_is_not_tuned(tiny_model: Path) -> None:
    def no_clock() -> float:
        raise AssertionError("this span must not be timed")
    for span in (span_of(tiny_model), span_of(tiny_model, DType.bfloat16)):
        assert tune_span(span, clock=no_clock) is None
        assert not any(isinstance(m, FormLinear) for m in span.modules())


def test_the_test_table_is_installed_untimed_and_a_malformed_one_is_refused_in_one_line(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ROW_FORMS_ENV, "1:paired,3:transposed")
    table = tune_span(span_of(tiny_model))
    assert table is not None and table.choices == {1: "paired", 3: "transposed"}
    monkeypatch.setenv(ROW_FORMS_ENV, "*:packed,1:paired")
    table = tune_span(span_of(tiny_model))
    assert table is not None and table.default == PACKED and table.choices == {1: "paired"}
    monkeypatch.setenv(ROW_FORMS_ENV, "1:sideways")
    with pytest.raises(ValueError, match=f"{ROW_FORMS_ENV}='1:sideways': expected rows:form pairs"):
        tune_span(span_of(tiny_model))


def test_a_big_span_is_timed_on_its_first_blocks_only(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    span = span_of(tiny_model)
    per_block = sum(m.weight.numel() for m in span.layers[0].modules() if isinstance(m, torch.nn.Linear))
    monkeypatch.setattr(span_forms, "TIMED_SPAN_WEIGHTS", per_block + 1)  # two blocks hold it
    assert span_forms.timed_blocks(span) == (span.start + 2, 2 * per_block)
    monkeypatch.setattr(span_forms, "TIMED_SPAN_WEIGHTS", per_block * 100)  # more than the span holds
    assert span_forms.timed_blocks(span) == (span.end, (span.end - span.start) * per_block)
