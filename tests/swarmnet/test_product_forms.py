"""A few rows' product x · Wᵀ in its equal forms, the fastest one kept by a clock, and FormLinear taking it."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from swarmnet.product_forms import (
    FORMS,
    MARGIN,
    PACKED,
    TIMING_ROUNDS,
    FormLinear,
    FormTable,
    candidates,
    fastest,
    install,
    packed_available,
    settle_weights,
)


def spent(seconds: dict[str, float], order: list[str]) -> Callable[[], float]:
    """A clock under which each form, run in `order` round after round, takes its `seconds`."""
    def ticks() -> Iterator[float]:
        now = 0.0
        while True:
            for name in order:
                yield now
                now += seconds[name]
                yield now
    return ticks().__next__


@pytest.mark.parametrize("rows", range(1, 10))
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_a_form_linear_takes_its_tables_form_for_its_row_count_and_computes_nn_linears_product(
        rows: int, bias: bool) -> None:
    layer = nn.Linear(96, 160, bias=bias)
    want_layer = nn.Linear(96, 160, bias=bias)
    want_layer.load_state_dict(layer.state_dict())
    table = FormTable({rows: candidates(rows)[1]})
    assert install(layer, table) == 96 * 160
    assert isinstance(layer, FormLinear)
    x = torch.randn(rows, 1, 96, generator=torch.Generator().manual_seed(rows))  # a decode step: [rows, 1, H]
    got, want = layer(x), want_layer(x)
    assert got.shape == want.shape == (rows, 1, 160) and got.is_contiguous()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_row_count_the_table_does_not_hold_takes_f_linear_bit_for_bit() -> None:
    layer = nn.Linear(64, 64)
    install(layer, FormTable({1: "paired"}))
    x = torch.randn(3, 5, 64)  # 15 rows: a prefill
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_install_takes_only_plain_float32_linear_layers() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.LayerNorm(8))
    assert install(model, FormTable()) == 64
    assert [type(m) for m in model] == [FormLinear, nn.Linear, nn.LayerNorm]


def test_the_paired_form_is_a_candidate_for_one_row_and_the_transposed_form_for_more() -> None:
    assert candidates(1) == ("linear", "paired") and candidates(4) == ("linear", "transposed")
    assert set(candidates(1)) | set(candidates(2)) == set(FORMS)


def test_fastest_keeps_another_form_only_when_clearly_faster() -> None:
    runs: list[str] = []

    def run(name: str) -> str:
        runs.append(name)
        return name
    order = ["linear", "paired"]
    assert fastest(run, ("linear", "paired"), spent({"linear": 0.010, "paired": 0.006}, order)) == ("paired", "paired")
    assert runs == order * TIMING_ROUNDS  # in turn, round after round
    almost = 0.010 * (MARGIN + 0.05)  # within timing noise: F.linear stays
    assert fastest(run, ("linear", "paired"), spent({"linear": 0.010, "paired": almost}, order))[0] == "linear"


def test_a_table_describes_its_forms_by_runs_of_row_counts() -> None:
    table = FormTable({1: "paired", 2: "transposed", 3: "transposed", 4: "transposed", 5: "linear", 7: "transposed"})
    assert table.describe() == "1 paired, 2-4 transposed, 7 transposed; others linear"
    assert FormTable({1: "linear"}).describe() == "all linear"
    assert FormTable(default=PACKED).describe() == "all packed"
    assert FormTable({1: "paired"}, default=PACKED).describe() == "1 paired; others packed"


needs_packed = pytest.mark.skipif(not packed_available(), reason="this torch build has no oneDNN packed product")


@needs_packed
@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (16, 1), (2, 7)], ids=["1-row", "3-rows", "16-rows", "prefill"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_a_packed_layer_holds_one_copy_of_its_weight_and_computes_nn_linears_product(
        shape: tuple[int, int], bias: bool) -> None:
    layer = nn.Linear(96, 160, bias=bias)
    want_layer = nn.Linear(96, 160, bias=bias)
    want_layer.load_state_dict(layer.state_dict())
    assert install(layer, FormTable(default=PACKED)) == 96 * 160
    # its dense weight is freed: the packed copy alone serves every row count
    assert isinstance(layer, FormLinear) and layer.weight.numel() == 0 and layer.packed is not None
    x = torch.randn(*shape, 96, generator=torch.Generator().manual_seed(shape[0]))
    got, want = layer(x), want_layer(x)
    assert got.shape == want.shape == (*shape, 160)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    # And a table that takes a dense form again cannot be settled on it: one line says what to do
    layer.table.choices[1] = "paired"
    with pytest.raises(ValueError, match="load the span again"):
        settle_weights(layer)


@needs_packed
def test_a_table_with_a_packed_row_count_keeps_both_copies_and_a_dense_one_drops_the_packed() -> None:
    layer = nn.Linear(32, 48)
    table = FormTable({2: PACKED})
    install(layer, table)
    assert layer.weight.numel() == 32 * 48 and layer.packed is not None
    x = torch.randn(2, 32)
    assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    table.choices.clear()
    settle_weights(layer)
    assert layer.packed is None and layer.weight.numel() == 32 * 48
