"""Every command answers --help; each serve option and each setting is written once, where its config lives."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

import cli
from commands.config_options import option_fields
from jobs.settings import Settings, get_settings
from servers.config import ServerConfig

runner = CliRunner()
# ServerConfig fields that `serve` builds from its own arguments instead of one option each
BUILT_BY_SERVE = {"model_dir": "MODEL", "initial_peers": "--initial-peers", "blocks": "--blocks",
                  "network": "--host/--port/--announce-host/--identity", "swarm_file": "--swarm-file"}


def command_paths(group: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every leaf command of a click group (typer's vendored click or click's own), as its words."""
    paths: list[tuple[str, ...]] = []
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            paths += command_paths(command, (*prefix, name))
        else:
            paths.append((*prefix, name))
    return paths


def test_every_command_of_the_app_answers_help() -> None:
    paths = command_paths(typer.main.get_command(cli.app))
    assert len(paths) >= 26 and ("serve",) in paths and ("keys", "create") in paths
    for path in paths:
        result = runner.invoke(cli.app, [*path, "--help"])
        assert result.exit_code == 0 and "Usage" in result.stdout, (path, result.stdout, result.stderr)


def serve_options() -> dict[str, Any]:
    serve = typer.main.get_command(cli.app).commands["serve"]  # type: ignore[attr-defined]  # a group's command
    return {param.name: param for param in serve.params if param.name}


def test_each_server_config_field_is_a_serve_option_with_the_same_default_and_help() -> None:
    options = serve_options()
    for field in dataclasses.fields(ServerConfig):
        if field.name in BUILT_BY_SERVE:
            continue
        assert field in option_fields(ServerConfig), f"ServerConfig.{field.name} has no option(...) metadata"
        option = options.get(field.name)
        assert option is not None, f"serve has no --{field.name.replace('_', '-')}"
        assert option.default == field.default, field.name
        assert option.help == field.metadata["help"], field.name


def test_a_serve_option_out_of_its_bounds_is_a_usage_error() -> None:
    result = runner.invoke(cli.app, ["serve", "m", "--initial-peers", "x", "--max-cache-share-per-peer", "1.5"])
    assert result.exit_code == 2 and "max-cache-share-per-peer" in result.stderr


def test_every_setting_has_a_description_and_config_shows_each_with_its_default() -> None:
    missing = [name for name, field in Settings.model_fields.items() if not field.description]
    assert not missing, f"settings without a description: {missing}"
    result = runner.invoke(cli.app, ["config", "--json"])
    assert result.exit_code == 0, result.stderr
    rows = {row["env"]: row for row in json.loads(result.stdout)}
    assert set(rows) == {f"SWARMBATCH_{name.upper()}" for name in Settings.model_fields}
    assert rows["SWARMBATCH_CHECKPOINT_EVERY"]["default"] == 8
    assert rows["SWARMBATCH_LEASE_SECONDS"]["description"] == Settings.model_fields["lease_seconds"].description


def test_config_masks_secrets_and_marks_what_differs_from_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMBATCH_METRICS_TOKEN", "s3cret-token")
    monkeypatch.setenv("SWARMBATCH_CHECKPOINT_EVERY", "16")
    get_settings.cache_clear()
    try:
        result = runner.invoke(cli.app, ["config"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0 and "s3cret-token" not in result.stdout
    assert "SWARMBATCH_CHECKPOINT_EVERY=16  (default: 8)" in result.stdout
