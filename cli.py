"""The `swarmbatch` command line: one typer app composed from the command modules of `commands/`.

Exit codes: see commands.errors.ExitCode, where they are defined and explained once. An error of ours prints one
line, `Error: <Type>: <message>`, on stderr; --verbose adds its traceback.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Annotated

import typer

from commands import admin, batch, swarm
from commands.errors import ErrorBoundary
from commands.options import VerboseOption
from swarmnet.allocator import keep_freed_memory

# before any command body imports a Hugging Face library (the command modules import none at the top)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

app = typer.Typer(cls=ErrorBoundary, help="Batch LLM generation on a private swarm of block servers.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
app.add_typer(swarm.app)  # dht, serve, generate, demo
app.add_typer(batch.app)  # submit, status, results, cancel, jobs, run
app.add_typer(admin.app)  # worker, beat, api
app.add_typer(swarm.model_app, name="model")
app.add_typer(swarm.swarm_app, name="swarm")
app.add_typer(admin.db_app, name="db")
app.add_typer(admin.keys_app, name="keys")
app.add_typer(admin.schedules_app, name="schedules")


def show_version(value: bool) -> None:
    """--version: the installed package's version, then exit."""
    if value:
        typer.echo(f"swarmbatch {package_version()}")
        raise typer.Exit()


def package_version() -> str:
    """The version in the installed package's metadata (pyproject.toml's, when it was installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("swarmbatch")
    except PackageNotFoundError:
        return "unknown (not installed: run 'pip install -e .' in the repository)"


@app.callback()
def root(verbose: VerboseOption = False,
         _version: Annotated[bool, typer.Option("--version", callback=show_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """Options of every command: logging (the error boundary reads --verbose from the context); glibc keeps freed
    tensor memory for the next step (swarmnet/allocator.py)."""
    setup_logging(logging.DEBUG if verbose else logging.INFO)
    keep_freed_memory()


def setup_logging(level: int) -> None:
    """Log to stderr; hivemind's chatter only at WARNING and above."""
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("hivemind", "httpx", "asyncio", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING if level > logging.DEBUG else logging.INFO)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
