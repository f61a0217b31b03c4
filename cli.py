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
    for noisy in ("hivemind", "httpx", "asyncio", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING if level > logging.DEBUG else logging.INFO)


def fail(exc: BaseException, code: int) -> None:
    """Print one line for the user, then exit with a documented code."""
    if VERBOSE["on"]:
        logging.getLogger("swarmbatch").exception("Failed")
    typer.echo(f"Error: {type(exc).__name__}: {exc}", err=True)
    raise typer.Exit(code)


def guarded(fn: Callable[[], T]) -> T:
    """Run a command body, turning our error roots into one line and an exit code."""
    from jobs.errors import InvalidJob, JobNotFound, StoreUnavailable
    from modelprep import ModelPrepError
    from servers.errors import ServerConfigError, ServerError
    from swarmclient.errors import InvalidRequest, ModelDirError, SwarmError

    try:
        return fn()
    except (ModelPrepError, ModelDirError, ServerConfigError, InvalidRequest, InvalidJob, JobNotFound) as e:
        fail(e, EXIT_USAGE)
    except StoreUnavailable as e:
        fail(e, EXIT_STORE_UNREACHABLE)
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
               seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
               context: Annotated[int, typer.Option(min=16, help="Context length (max_position_embeddings).")] = 2048
               ) -> None:
    """Write a small random model with a tokenizer (tests, benchmarks)."""
    from modelprep import write_tiny_model

    typer.echo(guarded(lambda: write_tiny_model(out, layers=layers, arch=arch, seed=seed, context=context)))


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
          num_threads: Annotated[Optional[int], typer.Option(min=1, help="torch threads.")] = None,
          batch_wait_ms: Annotated[float, typer.Option(
              min=0, help="Wait up to this many ms to merge concurrent sessions' decode steps into one forward "
                          "(at most --max-batch-size rows); 0 = no merging.")] = 2.0,
          max_merge_tokens: Annotated[int, typer.Option(
              min=0, help="Sessions caching more tokens (rows x length) than this run alone: merging copies "
                          "their caches.")] = 2048,
          metrics_port: Annotated[int, typer.Option(min=0, max=65535,
                                                    help="Serve Prometheus /metrics on this port; 0 = off.")] = 0,
          metrics_host: Annotated[str, typer.Option(help="Listen address of /metrics.")] = "127.0.0.1") -> None:
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
            announce_period=announce_period, session_timeout=session_timeout, num_threads=num_threads,
            batch_wait_ms=batch_wait_ms, max_merge_tokens=max_merge_tokens,
            metrics_port=metrics_port, metrics_host=metrics_host)
        run_server(config, _print_ready)

    guarded(run)


def _print_ready(status: Any, maddrs: list[str]) -> None:
    span = status.loaded_span()
    typer.echo(f"Serving blocks {span.start}:{span.end} of {status.model_id} "
               f"as {status.peer_id} at {' '.join(maddrs)}")
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
    from launch.demo import run_demo
    from launch.processes import exit_on_sigterm

    exit_on_sigterm()
    guarded(lambda: run_demo(echo=typer.echo))


# ---- batch jobs ----------------------------------------------------------------------------------------------------
ApiOption = Annotated[Optional[str], typer.Option("--api", envvar="SWARMBATCH_API_URL",
                                                  help="Talk to this REST API instead of the store.")]
KeyOption = Annotated[Optional[str], typer.Option("--key", envvar="SWARMBATCH_API_KEY", help="API key for --api.")]
db_app = typer.Typer(help="Database administration.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
schedules_app = typer.Typer(help="Nightly summarization schedules (SWARMBATCH_SCHEDULES).", no_args_is_help=True)
app.add_typer(schedules_app, name="schedules")
SchedulesOption = Annotated[Optional[Path], typer.Option(
    "--file", help="Schedules TOML file (default: SWARMBATCH_SCHEDULES).")]


def jobs_client(api: Optional[str], key: Optional[str]) -> Any:
    """The store (default) or the REST API."""
    from jobs.client import ApiClient, StoreClient
    from jobs.runtime import get_runtime

    return ApiClient(api, key) if api else StoreClient(get_runtime())


def print_job(job: dict[str, Any], as_json: bool) -> None:
    """A job object as JSON or one readable line."""
    from jobs.progress import describe_job

    typer.echo(json.dumps(job) if as_json else describe_job(job))


@app.command("submit")
def submit(file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="OpenAI batch JSONL.")],
           model: Annotated[str, typer.Option(help="'smollm2' or a local model dir.")] = "smollm2",
           completion_window: Annotated[str, typer.Option(help="Deadline, e.g. 24h or 90m.")] = "24h",
           wait: Annotated[bool, typer.Option(help="Show progress until the job ends.")] = False,
           as_json: JsonOption = False, api: ApiOption = None, key: KeyOption = None) -> None:
    """Submit a batch; prints the job id (or the job object with --json)."""
    client = guarded(lambda: jobs_client(api, key))
    job = guarded(lambda: client.submit(file, model=model, completion_window=completion_window))
    if not wait:
        typer.echo(json.dumps(job) if as_json else job["id"])
        return
    from jobs.progress import follow_job

    final = guarded(lambda: follow_job(client, job["id"]))
    print_job(final, as_json)
    if final["status"] != "completed":
        raise typer.Exit(EXIT_JOB_FAILED)


@app.command("status")
def status(job_id: str, as_json: JsonOption = False, api: ApiOption = None, key: KeyOption = None) -> None:
    """A job's status, request counts, tokens generated and what blocks it."""
    client = guarded(lambda: jobs_client(api, key))
    print_job(guarded(lambda: client.get(job_id)), as_json)


@app.command("results")
def results(job_id: str, output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Write to a file.")] = None,
            errors: Annotated[bool, typer.Option("--errors", help="The error lines instead.")] = False,
            api: ApiOption = None, key: KeyOption = None) -> None:
    """The output JSONL, in input order (partial while the job runs)."""
    client = guarded(lambda: jobs_client(api, key))
    lines = guarded(lambda: list(client.errors(job_id) if errors else client.results(job_id)))
    if output is None:
        typer.echo("".join(lines), nl=False)
        return
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text("".join(lines))
    tmp.replace(output)
    typer.echo(f"{len(lines)} lines written to {output}", err=True)


@app.command("cancel")
def cancel(job_id: str, as_json: JsonOption = False, api: ApiOption = None, key: KeyOption = None) -> None:
    """Cancel a job; finished and partial outputs are kept."""
    client = guarded(lambda: jobs_client(api, key))
    print_job(guarded(lambda: client.cancel(job_id)), as_json)


@app.command("jobs")
def jobs(as_json: JsonOption = False, api: ApiOption = None, key: KeyOption = None) -> None:
    """Recent jobs, newest first."""
    client = guarded(lambda: jobs_client(api, key))
    listed = guarded(lambda: client.list())
    if as_json:
        typer.echo(json.dumps({"object": "list", "data": listed}))
        return
    for job in listed:
        print_job(job, False)


@app.command("worker")
def worker(concurrency: Annotated[int, typer.Option(min=1, help="Pool processes.")] = 1,
           pool: Annotated[str, typer.Option(help="prefork, solo or threads.")] = "prefork",
           beat: Annotated[bool, typer.Option(help="Also run the periodic sweep (embedded beat).")] = False,
           initial_peers: PeersOption = [],
           loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "info") -> None:
    """Run a Celery worker that generates jobs through the swarm."""
    from jobs.runtime import get_runtime

    if initial_peers:
        os.environ["SWARMBATCH_INITIAL_PEERS"] = " ".join(initial_peers)
    runtime = get_runtime()
    guarded(runtime.ensure_store)
    level = "debug" if VERBOSE["on"] else loglevel  # celery resets the root level to its own
    args = ["worker", f"--concurrency={concurrency}", f"--pool={pool}", f"--loglevel={level}",
            "--without-gossip", "--without-mingle", "-n", f"swarmbatch-{os.getpid()}@%h"]
    runtime.celery.worker_main(args + (["--beat", f"--schedule={runtime.settings.home / 'beat-schedule'}"] if beat else []))


@app.command("beat")
def beat(loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "info") -> None:
    """Run Celery beat: the periodic sweep for lost work, and the schedules of SWARMBATCH_SCHEDULES."""
    from jobs.runtime import get_runtime

    runtime = get_runtime()
    runtime.settings.home.mkdir(parents=True, exist_ok=True)
    runtime.celery.start(["beat", f"--loglevel={loglevel}", f"--schedule={runtime.settings.home / 'beat-schedule'}"])


def load_schedule_file(path: Optional[Path]) -> list[Any]:
    """The schedules of --file or SWARMBATCH_SCHEDULES; exit 2 with one line if neither is set."""
    from jobs.summaries.schedule_file import load_schedules
    from jobs.settings import get_settings

    path = path or get_settings().schedules
    if path is None:
        typer.echo("error: no schedules file; pass --file or set SWARMBATCH_SCHEDULES", err=True)
        raise typer.Exit(2)
    return guarded(lambda: load_schedules(Path(path)))


@schedules_app.command("list")
def schedules_list(file: SchedulesOption = None, as_json: JsonOption = False) -> None:
    """Each schedule with its cron, timezone and next run."""
    from jobs.summaries.firing import next_runs

    schedules = load_schedule_file(file)
    runs = next_runs(schedules)
    rows = [{"name": s.name, "cron": s.cron, "timezone": s.timezone, "next_run": runs[s.name].isoformat(),
             "source": s.source, "model": s.model, "output": str(s.output_dir)} for s in schedules]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for row in rows:
        typer.echo(f"{row['name']:<24} {row['cron']:<16} {row['timezone']:<18} next {row['next_run']}  "
                   f"{row['source']} -> {row['output']}")


@schedules_app.command("run")
def schedules_run(name: str, file: SchedulesOption = None, as_json: JsonOption = False) -> None:
    """Fire one schedule now (changed and new documents only); prints the job id."""
    from jobs.runtime import get_runtime
    from jobs.summaries.schedule_file import find_schedule
    from jobs.summaries.firing import fire_now

    schedule = guarded(lambda: find_schedule(load_schedule_file(file), name))
    runtime = get_runtime()
    guarded(runtime.ensure_store)
    firing = guarded(lambda: fire_now(runtime, schedule))
    if as_json:
        typer.echo(json.dumps(firing.__dict__))
    elif firing.job_id is None:
        typer.echo(f"{name}: already fired this minute ({firing.period}); nothing created")
    else:
        typer.echo(f"{firing.job_id}  {firing.summarize} documents to summarize, {firing.skipped} unchanged skipped")


@app.command("api")
def api_server(host: Annotated[str, typer.Option(help="Listen address.")] = "127.0.0.1",
               port: Annotated[int, typer.Option(help="TCP port.")] = 8000) -> None:
    """Serve the REST API (OpenAPI at /docs)."""
    import uvicorn

    from jobs.api.main import make_app
    from jobs.runtime import get_runtime

    runtime = get_runtime()
    guarded(runtime.ensure_store)
    uvicorn.run(make_app(runtime), host=host, port=port)


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument(help="Target revision.")] = "head") -> None:
    """Migrate the database (SWARMBATCH_DATABASE_URL, or the embedded SQLite) to the latest schema."""
    from jobs.errors import StoreUnavailable
    from jobs.migrate import upgrade
    from jobs.settings import get_settings

    settings = get_settings()
    settings.home.mkdir(parents=True, exist_ok=True)

    def run() -> None:
        try:
            upgrade(settings.resolved_database_url, revision)
        except Exception as e:  # SQLAlchemy OperationalError and friends: the database is not reachable
            raise StoreUnavailable(f"cannot migrate {settings.resolved_database_url.split('@')[-1]}: "
                                   f"{str(e).splitlines()[0]}") from e

    guarded(run)
    typer.echo(f"database at {revision}")


@keys_app.command("create")
def keys_create(name: Annotated[str, typer.Argument(help="Who the key is for.")]) -> None:
    """Create an API key; prints it once (only its hash is stored)."""
    from jobs import store
    from jobs.runtime import get_runtime

    runtime = get_runtime()
    guarded(runtime.ensure_store)
    with runtime.session() as session:
        _, plain = store.create_api_key(session=session, name=name)
        session.commit()
    typer.echo(plain)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
