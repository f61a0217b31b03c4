"""Service processes and administration: worker, beat, api, db upgrade, keys create / list / revoke, schedules."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from commands.errors import ExitCode
from commands.options import JsonOption, MemberKeyOption, PeersOption, SwarmFileOption, verbose_requested

if TYPE_CHECKING:
    from jobs.models import ApiKey

app = typer.Typer()  # top-level verbs: worker, beat, api
db_app = typer.Typer(help="Database administration.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys.", no_args_is_help=True)
schedules_app = typer.Typer(help="Nightly summarization schedules (SWARMBATCH_SCHEDULES).", no_args_is_help=True)
SchedulesOption = Annotated[Path | None, typer.Option(
    "--file", help="Schedules TOML file (default: SWARMBATCH_SCHEDULES).")]


# ---- service processes ---------------------------------------------------------------------------------------------
@app.command("worker")
def worker(ctx: typer.Context,
           concurrency: Annotated[int, typer.Option(min=1, help="Pool processes.")] = 1,
           pool: Annotated[str, typer.Option(help="prefork, solo or threads.")] = "prefork",
           beat: Annotated[bool, typer.Option(
               help="Also run beat in this process, for the schedules of SWARMBATCH_SCHEDULES.")] = False,
           initial_peers: PeersOption = [],  # noqa: B006 - typer reads the default; nothing mutates it
           loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "info",
           swarm_file: SwarmFileOption = None, identity: MemberKeyOption = None) -> None:
    """Run a Celery worker that generates jobs through the swarm."""
    from jobs.assembly import get_runtime

    if initial_peers:
        os.environ["SWARMBATCH_INITIAL_PEERS"] = " ".join(initial_peers)
    for name, value in (("SWARMBATCH_SWARM_FILE", swarm_file), ("SWARMBATCH_IDENTITY", identity)):
        if value is not None:  # the pool processes read the settings from the environment
            os.environ[name] = str(value)
    runtime = get_runtime()
    runtime.access  # noqa: B018 - a bad swarm file or a missing member key fails here, in one line, not per job
    runtime.ensure_store()
    level = "debug" if verbose_requested(ctx) else loglevel  # celery resets the root level to its own
    args = ["worker", f"--concurrency={concurrency}", f"--pool={pool}", f"--loglevel={level}",
            "--without-gossip", "--without-mingle", "-n", f"swarmbatch-{os.getpid()}@%h"]
    runtime.celery.worker_main(args + (["--beat", f"--schedule={runtime.settings.home / 'beat-schedule'}"] if beat else []))


@app.command("beat")
def beat(loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "info") -> None:
    """Run Celery beat: the schedules of SWARMBATCH_SCHEDULES (workers recover lost work by themselves)."""
    from jobs.assembly import get_runtime

    runtime = get_runtime()
    runtime.settings.home.mkdir(parents=True, exist_ok=True)
    runtime.ensure_store()  # beat never reads the store itself, but every task it sends does: fail here, in one line
    runtime.celery.start(["beat", f"--loglevel={loglevel}", f"--schedule={runtime.settings.home / 'beat-schedule'}"])


@app.command("api")
def api_server(host: Annotated[str, typer.Option(help="Listen address.")] = "127.0.0.1",
               port: Annotated[int, typer.Option(help="TCP port.")] = 8000) -> None:
    """Serve the REST API (OpenAPI at /docs)."""
    import uvicorn

    from jobs.api.main import make_app
    from jobs.assembly import get_runtime

    runtime = get_runtime()
    runtime.ensure_store()
    uvicorn.run(make_app(runtime), host=host, port=port)


@app.command("config")
def config(as_json: JsonOption = False) -> None:
    """Every setting (a SWARMBATCH_* variable): its value here, its default and what it does."""
    from jobs.settings import get_settings, settings_reference

    rows = settings_reference(get_settings())
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for row in rows:
        changed = "" if row["value"] == row["default"] else f"  (default: {row['default']})"
        typer.echo(f"{row['env']}={'' if row['value'] is None else row['value']}{changed}\n    {row['description']}")


# ---- database and keys ---------------------------------------------------------------------------------------------
@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument(help="Target revision.")] = "head") -> None:
    """Migrate the database (SWARMBATCH_DATABASE_URL, or the embedded SQLite) to the latest schema."""
    from jobs.migrate import upgrade
    from jobs.settings import get_settings

    settings = get_settings()
    settings.home.mkdir(parents=True, exist_ok=True)
    upgrade(settings.resolved_database_url, revision)  # the boundary tells an unknown revision from no database
    typer.echo(f"database at {revision}")


@keys_app.command("create")
def keys_create(name: Annotated[str, typer.Argument(help="Who the key is for.")]) -> None:
    """Create an API key; prints it once (only its hash is stored)."""
    from jobs import store
    from jobs.assembly import get_runtime

    runtime = get_runtime()
    runtime.ensure_store()
    with runtime.session() as session:
        _, plain = store.create_api_key(session=session, name=name)
        session.commit()
    typer.echo(plain)


@keys_app.command("list")
def keys_list(as_json: JsonOption = False) -> None:
    """Every key: id, name, created, revoked (never the key or its hash)."""
    from jobs import store
    from jobs.assembly import get_runtime

    runtime = get_runtime()
    runtime.ensure_store()
    with runtime.session() as session:
        rows = [key_row(key) for key in store.list_api_keys(session=session)]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    if not rows:
        typer.echo("no API keys; create one with 'swarmbatch keys create NAME'")
    for row in rows:
        typer.echo(f"{row['id']:>5}  {row['name']:<24} created {row['created_at']}  "
                   f"{'revoked ' + row['revoked_at'] if row['revoked_at'] else 'live'}")


@keys_app.command("revoke")
def keys_revoke(name_or_id: Annotated[str, typer.Argument(
        metavar="NAME_OR_ID", help="The key's id (from 'keys list'), or its name if one live key has it.")]) -> None:
    """Revoke a key: every request with it gets 401 from then on, its unfinished batches are cancelled, and the
    workers' next sweep deletes its files and its batches' outputs."""
    from jobs import store
    from jobs.assembly import get_runtime

    runtime = get_runtime()
    runtime.ensure_store()
    with runtime.session() as session:
        key = store.revoke_api_key(session=session, name_or_id=name_or_id)  # the boundary reports an unknown one
        cancelled = [runtime.lifecycle.cancel(session, job_id).id
                     for job_id in store.active_job_ids(session=session, api_key_id=key.id)]
        session.commit()
        row = key_row(key)
    typer.echo(f"key {row['id']} ({row['name']}) revoked at {row['revoked_at']}; {len(cancelled)} unfinished "
               f"batches cancelled; the workers' next sweep deletes its files and outputs")


def key_row(key: ApiKey) -> dict[str, Any]:
    """An ApiKey as the CLI shows it: no hash."""
    return {"id": key.id, "name": key.name, "created_at": key.created_at.isoformat(timespec="seconds"),
            "revoked_at": key.revoked_at.isoformat(timespec="seconds") if key.revoked_at else None}


# ---- schedules -----------------------------------------------------------------------------------------------------
def load_schedule_file(path: Path | None) -> list[Any]:
    """The schedules of --file or SWARMBATCH_SCHEDULES; exit 2 with one line if neither is set."""
    from jobs.settings import get_settings
    from jobs.summaries.schedule_file import load_schedules

    path = path or get_settings().schedules
    if path is None:
        typer.echo("error: no schedules file; pass --file or set SWARMBATCH_SCHEDULES", err=True)
        raise typer.Exit(ExitCode.USAGE)
    return load_schedules(Path(path))


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
    from jobs.assembly import get_runtime
    from jobs.summaries.firing import fire_now
    from jobs.summaries.schedule_file import find_schedule

    schedule = find_schedule(load_schedule_file(file), name)
    runtime = get_runtime()
    runtime.ensure_store()
    firing = fire_now(runtime, schedule)
    if as_json:
        typer.echo(json.dumps(firing.__dict__))
    elif firing.job_id is None:
        typer.echo(f"{name}: already fired this minute ({firing.period}); nothing created")
    else:
        typer.echo(f"{firing.job_id}  {firing.summarize} documents to summarize, {firing.skipped} unchanged skipped")
