"""TEST-ONLY fault injection: SWARMBATCH_FAULT_INJECTION=noise:STD makes a span's outputs wrong, and nothing else does."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import cli
from servers.errors import ServerConfigError
from servers.faults import FAULT_INJECTION_ENV, fault_noise, inject_faults, noise_std, noisy, push_fault_noise

runner = CliRunner()


def test_without_the_variable_a_span_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_INJECTION_ENV, raising=False)
    span = nn.Identity()
    inject_faults(span, fault_noise(private=False))
    x = torch.randn(2, 3, 8)
    assert torch.equal(span(x), x)


def test_noise_makes_every_output_wrong_and_says_so_loudly(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(FAULT_INJECTION_ENV, "noise:0.5")
    span = nn.Identity()
    with caplog.at_level(logging.WARNING, logger="servers.faults"):
        inject_faults(span, fault_noise(private=False))
    x = torch.zeros(4, 16, 64)
    noise = span(x) - x
    assert 0.45 < float(noise.std()) < 0.55
    assert not torch.equal(span(x), span(x))  # fresh noise every call
    assert "TEST-ONLY FAULT INJECTION IS ON" in caplog.text and "0.5" in caplog.text


@pytest.mark.parametrize("value", ["noise", "noise:", "noise:-1", "noise:0", "flip:0.5", "noise:abc"])
def test_a_malformed_value_is_one_clear_error(value: str) -> None:
    with pytest.raises(ServerConfigError, match=rf"{FAULT_INJECTION_ENV}=.*noise:STD.*tests only"):
        noise_std(value)


def test_a_server_of_a_private_swarm_refuses_fault_injection_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_INJECTION_ENV, "noise:0.5")
    with pytest.raises(ServerConfigError, match=rf"^{FAULT_INJECTION_ENV} is set, .* private swarm .*; unset it$"):
        fault_noise(private=True)


def test_serve_in_a_private_swarm_with_fault_injection_exits_2_before_loading(
        monkeypatch: pytest.MonkeyPatch, tiny_model: Path, tmp_path: Path) -> None:
    # Given a private swarm's file and a member key
    swarm_file, key = tmp_path / "swarm.json", tmp_path / "server.key"
    for args in (["swarm", "init", str(swarm_file)], ["swarm", "new-key", str(key)],
                 ["swarm", "add-member", str(swarm_file), str(key)]):
        assert runner.invoke(cli.app, args).exit_code == 0, args
    # When a server of it starts with the test-only fault injection set, then it refuses in one line, exit 2
    monkeypatch.setenv(FAULT_INJECTION_ENV, "noise:0.5")
    result = runner.invoke(cli.app, ["serve", str(tiny_model), "--blocks", "0:3", "--initial-peers",
                                     "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWCxbSVdL8unKt3Y4pzF1KX9GJLuq7DiGtDJwP5HhSaFRP",
                                     "--swarm-file", str(swarm_file), "--identity", str(key)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: ServerConfigError: {FAULT_INJECTION_ENV} is set")
    assert len(result.stderr.strip().splitlines()) == 1


def test_push_noise_leaves_the_span_and_answers_alone_and_is_refused_in_a_private_swarm(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(FAULT_INJECTION_ENV, "push-noise:0.5")
    assert fault_noise(private=False) is None  # the span's outputs (its answers) stay honest
    with caplog.at_level(logging.WARNING, logger="servers.faults"):
        assert push_fault_noise(private=False) == 0.5
    assert "TEST-ONLY FAULT INJECTION IS ON" in caplog.text and "its answers stay honest" in caplog.text
    x = torch.zeros(4, 16, 64)
    assert noisy(x, None) is x and 0.45 < float(noisy(x, 0.5).std()) < 0.55
    with pytest.raises(ServerConfigError, match=rf"^{FAULT_INJECTION_ENV} is set, .* private swarm .*; unset it$"):
        push_fault_noise(private=True)
