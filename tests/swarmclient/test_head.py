"""The client head's logits: a transposed LM head for a few rows, nn.Linear from FEW_ROWS rows on."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from swarmclient.head import FEW_ROWS, ClientHead
from swarmnet.model_spec import ModelSpec


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
def test_logits_match_the_linear_layer_and_few_rows_use_the_transposed_head(tiny_model: Path, rows: int) -> None:
    head = ClientHead(ModelSpec.open(tiny_model))
    for seed in range(32):  # an input on which the two layouts round differently tells which one ran
        hidden = torch.randn(rows, 1, head.lm_head.in_features, generator=torch.Generator().manual_seed(seed)) * 3
        with torch.inference_mode():
            normed = head.norm(hidden)
            linear = F.linear(normed, head.lm_head.weight)
            got = head.logits(hidden)
            transposed = normed @ head.lm_head.weight.T.contiguous()
        if not torch.equal(linear, transposed):
            break
    assert torch.allclose(got, linear, rtol=1e-5, atol=1e-4)
    assert torch.equal(got.argmax(-1), linear.argmax(-1))
    if torch.equal(linear, transposed):
        pytest.skip(f"this CPU's BLAS rounds both layouts identically for {rows} rows: which one ran is unobservable")
    if rows < FEW_ROWS:
        assert torch.equal(got, transposed) and not torch.equal(got, linear)
    else:
        assert torch.equal(got, linear)
