"""The `swarmbatch` command line: one typer app, one command per verb.

Exit codes: 0 ok, 1 job failed, 2 usage (bad flags, unusable model dir), 3 Redis/DB unreachable,
4 swarm unavailable (DHT unreachable, missing blocks, servers failing).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar

import typer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EXIT_OK, EXIT_JOB_FAILED, EXIT_USAGE, EXIT_STORE_UNREACHABLE, EXIT_SWARM_UNAVAILABLE = 0, 1, 2, 3, 4

app = typer.Typer(help="Batch LLM generation on a private swarm of block servers.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
model_app = typer.Typer(help="Prepare model directories.", no_args_is_help=True)
swarm_app = typer.Typer(help="Inspect the swarm.", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(swarm_app, name="swarm")

T = TypeVar("T")
PeersOption = Annotated[list[str], typer.Option("--initial-peers", envvar="SWARMBATCH_INITIAL_PEERS",
                                                help="DHT multiaddrs to join (from 'swarmbatch dht').")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]
VERBOSE = {"on": False}


@app.callback()
def _root(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logs and tracebacks.")] = False) -> None:
    VERBOSE["on"] = verbose
    setup_logging(logging.DEBUG if verbose else logging.INFO)


def setup_logging(level: int) -> None:
    """Log to stderr; hivemind's chatter only at WARNING and above."""
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("hivemind", "httpx", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING if level > logging.DEBUG else logging.INFO)


def fail(exc: BaseException, code: int) -> None:
    """Print one line for the user, then exit with a documented code."""
    if VERBOSE["on"]:
        logging.getLogger("swarmbatch").exception("Failed")
    typer.echo(f"Error: {type(exc).__name__}: {exc}", err=True)
    raise typer.Exit(code)


def guarded(fn: Callable[[], T]) -> T:
    """Run a command body, turning our error roots into one line and an exit code."""
    from modelprep import ModelPrepError
    from servers.errors import ServerConfigError, ServerError
    from swarmclient.errors import InvalidRequest, ModelDirError, SwarmError

    try:
        return fn()
    except (ModelPrepError, ModelDirError, ServerConfigError, InvalidRequest) as e:
        fail(e, EXIT_USAGE)
    except (SwarmError, ServerError) as e:
        fail(e, EXIT_SWARM_UNAVAILABLE)
    raise AssertionError("unreachable")


def resolve_model(name_or_path: str) -> Path:
    """'smollm2' or a local model dir -> a prepared model directory."""
    from jobs.settings import get_settings
    from modelprep import prepare_model

    return prepare_model(name_or_path, cache_dir=get_settings().models_dir)


def network_options(host: str, port: int, identity: Optional[Path], announce_host: Optional[str] = None) -> Any:
    from swarmclient.network import NetworkOptions

    return NetworkOptions(host=host, port=port, identity_path=str(identity) if identity else None,
                          announce_host=announce_host)


# ---- model -------------------------------------------------------------------------------------------------
@model_app.command("prepare")
def model_prepare(name_or_path: Annotated[str, typer.Argument(help="'smollm2' or a local Hugging Face model dir.")]
                  ) -> None:
    """Make a local model directory (safetensors + tokenizer) and print its path."""
    typer.echo(guarded(lambda: resolve_model(name_or_path)))


@model_app.command("tiny")
def model_tiny(out: Annotated[Path, typer.Argument(help="Directory to write.")],
               layers: Annotated[int, typer.Option(min=1, help="Number of decoder layers.")] = 4,
               arch: Annotated[str, typer.Option(help="llama, mistral or qwen2.")] = "llama",
               seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0) -> None:
    """Write a small random model with a tokenizer (tests, benchmarks)."""
    from modelprep import write_tiny_model

    typer.echo(guarded(lambda: write_tiny_model(out, layers=layers, arch=arch, seed=seed)))


# ---- swarm processes ------------------------------------------------------------------------------------------
@app.command("dht")
def dht(host: Annotated[str, typer.Option(help="Listen address (0.0.0.0 for other machines).")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="TCP port; 0 = any free port.")] = 0,
        identity: Annotated[Optional[Path], typer.Option(help="Key file; keeps the peer id across restarts.")] = None,
        announce_host: Annotated[Optional[str], typer.Option(help="Address other machines dial.")] = None,
        initial_peers: PeersOption = []) -> None:
    """Run a DHT bootstrap node; prints its full multiaddr on one stdout line when ready."""
    from servers.bootstrap import run_bootstrap_node

    def on_ready(maddrs: list[str]) -> None:
        typer.echo(maddrs[0])
        sys.stdout.flush()

    guarded(lambda: run_bootstrap_node(initial_peers, network_options(host, port, identity, announce_host), on_ready))


def parse_blocks(value: Optional[str]) -> Optional[tuple[int, int]]:
    """'A:B' -> (A, B)."""
    if value is None:
        return None
    try:
        start, end = (int(part) for part in value.split(":"))
    except ValueError:
        raise typer.BadParameter("expected START:END, e.g. 0:15", param_hint="--blocks") from None
    if not 0 <= start < end:
        raise typer.BadParameter(f"empty or negative span {value}", param_hint="--blocks")
    return start, end


@app.command("serve")
def serve(model: Annotated[str, typer.Argument(help="'smollm2' or a local model dir.")],
          initial_peers: PeersOption,
          blocks: Annotated[Optional[str], typer.Option(help="Serve blocks START:END.")] = None,
          num_blocks: Annotated[Optional[int], typer.Option(min=1, help="Serve N blocks where coverage is weakest.")] = None,
          host: Annotated[str, typer.Option(help="Listen address.")] = "127.0.0.1",
          port: Annotated[int, typer.Option(help="TCP port; 0 = any free port.")] = 0,
          announce_host: Annotated[Optional[str], typer.Option(help="Address other machines dial.")] = None,
          identity: Annotated[Optional[Path], typer.Option(help="Key file; keeps the peer id.")] = None,
          dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
          quant: Annotated[str, typer.Option(help="none, int8 or nf4 (bitsandbytes).")] = "none",
          attn_cache_tokens: Annotated[int, typer.Option(min=1, help="KV-cache tokens per block, all sessions.")] = 16384,
          max_batch_size: Annotated[int, typer.Option(min=1, help="Largest batch accepted.")] = 64,
          announce_period: Annotated[float, typer.Option(help="Seconds between DHT announcements.")] = 15.0,
          session_timeout: Annotated[float, typer.Option(help="Idle seconds before a session is closed.")] = 300.0,
          num_threads: Annotated[Optional[int], typer.Option(min=1, help="torch threads.")] = None) -> None:
    """Run a block server for a span of the model's blocks."""
    from servers.block_loading import DType, Quant
    from servers.server import ServerConfig, run_server

    if not initial_peers:
        raise typer.BadParameter("a block server needs at least one DHT multiaddr (run 'swarmbatch dht')",
                                 param_hint="--initial-peers")
    try:
        dtype_choice, quant_choice = DType(dtype), Quant(quant)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--dtype/--quant") from None

    def run() -> None:
        config = ServerConfig(
            model_dir=str(resolve_model(model)), initial_peers=initial_peers, blocks=parse_blocks(blocks),
            num_blocks=num_blocks, network=network_options(host, port, identity, announce_host), dtype=dtype_choice,
            quant=quant_choice, attn_cache_tokens=attn_cache_tokens, max_batch_size=max_batch_size,
            announce_period=announce_period, session_timeout=session_timeout, num_threads=num_threads)
        run_server(config, lambda server, maddrs: _print_ready(server, maddrs))

    guarded(run)


def _print_ready(server: Any, maddrs: list[str]) -> None:
    typer.echo(f"Serving blocks {server.start_block}:{server.end_block} of {server.spec.model_id} "
               f"as {server.peer_id} at {' '.join(maddrs)}")
    sys.stdout.flush()


# ---- swarm client -----------------------------------------------------------------------------------------------
@swarm_app.command("status")
def swarm_status(model: Annotated[str, typer.Argument(help="'smollm2' or a local model dir.")],
                 initial_peers: PeersOption, as_json: JsonOption = False) -> None:
    """Coverage map: which servers hold each block, their state, and which blocks are missing."""
    from swarmclient.coverage import read_coverage, render_coverage

    report = guarded(lambda: read_coverage(resolve_model(model), initial_peers))
    typer.echo(json.dumps(report, indent=2) if as_json else render_coverage(report))


@app.command("generate")
def generate(model: Annotated[str, typer.Argument(help="'smollm2' or a local model dir.")],
             prompts: Annotated[list[str], typer.Argument(help="One or more prompts.")],
             initial_peers: PeersOption,
             max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate per prompt.")] = 32,
             temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
             top_p: Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling mass.")] = 1.0,
             seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
             chat: Annotated[bool, typer.Option(help="Wrap each prompt in the model's chat template.")] = False,
             as_json: JsonOption = False) -> None:
    """One-off generation through the swarm."""
    from swarmclient.textgen import generate_texts

    def run() -> list[dict[str, Any]]:
        return generate_texts(resolve_model(model), prompts, initial_peers=initial_peers, chat=chat,
                              max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)

    began = time.perf_counter()
    outputs = guarded(run)
    if as_json:
        typer.echo(json.dumps({"outputs": outputs}))
        return
    for item in outputs:
        typer.echo(f"--- {item['prompt']!r}\n{item['text']}")
    tokens = sum(len(item["token_ids"]) for item in outputs)
    typer.echo(f"{tokens} tokens in {time.perf_counter() - began:.1f} s", err=True)


@app.command("demo")
def demo() -> None:
    """The main job, embedded: a local DHT and two block servers, SmolLM2 generating summaries."""
    from jobs.demo import run_demo

    guarded(lambda: run_demo(echo=typer.echo))


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
