"""CLI options made from a config dataclass's fields, so that each default and help text is written once (there).

`with_config_options(ServerConfig)` adds one `--name` option per field that carries `option(...)` metadata
(servers/config.py) to a typer command: the field's type, default, help and bounds. The command receives them as
keyword arguments under the fields' names and passes them on with `config_values(ServerConfig, kwargs)`.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any, TypeVar, get_type_hints

import typer

HELP = "help"  # the metadata key that marks a field as an option (servers.config.HELP)
Command = TypeVar("Command", bound=Callable[..., None])


def option_fields(config: type) -> list[dataclasses.Field[Any]]:
    """The fields of a config dataclass that are CLI options."""
    return [f for f in dataclasses.fields(config) if HELP in f.metadata]


def option_parameter(config: type, field: dataclasses.Field[Any]) -> inspect.Parameter:
    """The typer parameter of one field: its type, its default, its help, its min/max."""
    kind = get_type_hints(config)[field.name]
    bounds = {key: field.metadata[key] for key in ("min", "max") if key in field.metadata}
    info = typer.Option(help=field.metadata[HELP], show_default=True, **bounds)
    return inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[kind, info],
                             default=field.default)


def with_config_options(config: type) -> Callable[[Command], Command]:
    """Add the config's option fields to a command's parameters (after its own)."""
    def decorate(command: Command) -> Command:
        own = inspect.signature(command, eval_str=True)
        kept = [p for p in own.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]  # **tuning: the extras
        extra = [option_parameter(config, f) for f in option_fields(config) if f.name not in own.parameters]

        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            command(*args, **kwargs)

        wrapper.__signature__ = own.replace(parameters=[*kept, *extra])  # type: ignore[attr-defined]
        wrapper.__annotations__ = {**{p.name: p.annotation for p in kept}, **{p.name: p.annotation for p in extra}}
        return wrapper  # type: ignore[return-value]
    return decorate


def config_values(config: type, values: dict[str, Any]) -> dict[str, Any]:
    """The option fields' values out of a command's keyword arguments."""
    return {f.name: values[f.name] for f in option_fields(config) if f.name in values}
