"""TEST-ONLY fault injection: SWARMBATCH_FAULT_INJECTION=noise:STD makes a span's outputs wrong, and nothing else does."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from servers.errors import ServerConfigError
from servers.faults import FAULT_INJECTION_ENV, inject_faults, noise_std


def test_without_the_variable_a_span_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_INJECTION_ENV, raising=False)
    span = nn.Identity()
    inject_faults(span)
    x = torch.randn(2, 3, 8)
    assert torch.equal(span(x), x)


def test_noise_makes_every_output_wrong_and_says_so_loudly(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(FAULT_INJECTION_ENV, "noise:0.5")
    span = nn.Identity()
    with caplog.at_level(logging.WARNING, logger="servers.faults"):
        inject_faults(span)
    x = torch.zeros(4, 16, 64)
    noise = span(x) - x
    assert 0.45 < float(noise.std()) < 0.55
    assert not torch.equal(span(x), span(x))  # fresh noise every call
    assert "TEST-ONLY FAULT INJECTION IS ON" in caplog.text and "0.5" in caplog.text


@pytest.mark.parametrize("value", ["noise", "noise:", "noise:-1", "noise:0", "flip:0.5", "noise:abc"])
def test_a_malformed_value_is_one_clear_error(value: str) -> None:
    with pytest.raises(ServerConfigError, match=rf"{FAULT_INJECTION_ENV}=.*noise:STD.*tests only"):
        noise_std(value)
