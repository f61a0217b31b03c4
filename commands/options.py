"""Options that several command modules share, and the root's --verbose flag."""
from __future__ import annotations

from typing import Annotated

import typer

PeersOption = Annotated[list[str], typer.Option("--initial-peers", envvar="SWARMBATCH_INITIAL_PEERS",
                                                help="DHT multiaddrs to join (from 'swarmbatch dht').")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]
VerboseOption = Annotated[bool, typer.Option("--verbose", "-v", help="Debug logs and tracebacks.")]
VERBOSE = "verbose"  # the root callback's parameter name for VerboseOption


def verbose_requested(ctx: typer.Context) -> bool:
    """Whether the root command got --verbose (read from the context: no global state to reset in tests)."""
    return bool(ctx.find_root().params.get(VERBOSE))
