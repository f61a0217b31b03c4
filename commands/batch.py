"""Batch-job commands: submit, status, results, cancel, jobs, on the store (default) or the REST API (--api); and
run, a file end to end on the embedded stack."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from commands.errors import ExitCode
from commands.options import JsonOption

app = typer.Typer()  # top-level verbs: submit, status, results, cancel, jobs, run
ApiOption = Annotated[str | None, typer.Option("--api", envvar="SWARMBATCH_API_URL",
                                                  help="Talk to this REST API instead of the store.")]
KeyOption = Annotated[str | None, typer.Option("--key", envvar="SWARMBATCH_API_KEY", help="API key for --api.")]


def jobs_client(api: str | None, key: str | None) -> Any:
    """The store (default) or the REST API."""
    from jobs.assembly import get_runtime
    from jobs.backends import ApiBackend, StoreBackend

    return ApiBackend(api, key) if api else StoreBackend(get_runtime())


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
    client = jobs_client(api, key)
    job = client.submit(file, model=model, completion_window=completion_window)
    if not wait:
        typer.echo(json.dumps(job) if as_json else job["id"])
        return
    watch(client, job["id"], as_json)


def watch(client: Any, job_id: str, as_json: bool) -> None:
    """A progress bar until the job ends, then the job; exits JOB_FAILED unless it completed."""
    from jobs.progress import follow_job

    final = follow_job(client, job_id)
    print_job(final, as_json)
    if final["status"] != "completed":
        raise typer.Exit(ExitCode.JOB_FAILED)


@app.command("status")
def status(job_id: str, as_json: JsonOption = False, api: ApiOption = None, key: KeyOption = None,
           watch_: Annotated[bool, typer.Option("--watch", help="Show progress until the job ends; exit 0 only if "
                                                               "it completed.")] = False) -> None:
    """A job's status, request counts, tokens generated and what blocks it."""
    if watch_:
        watch(jobs_client(api, key), job_id, as_json)
        return
    print_job(jobs_client(api, key).get(job_id), as_json)


@app.command("results")
def results(job_id: str, output: Annotated[Path | None, typer.Option("-o", "--output", help="Write to a file.")] = None,
            errors: Annotated[bool, typer.Option("--errors", help="The error lines instead.")] = False,
            api: ApiOption = None, key: KeyOption = None) -> None:
    """The output JSONL, in input order (partial while the job runs)."""
    client = jobs_client(api, key)
    lines = list(client.errors(job_id) if errors else client.results(job_id))
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
    print_job(jobs_client(api, key).cancel(job_id), as_json)


@app.command("jobs")
def jobs(as_json: JsonOption = False, api: ApiOption = None, key: KeyOption = None) -> None:
    """Recent jobs, newest first."""
    listed = jobs_client(api, key).list()
    if as_json:
        typer.echo(json.dumps({"object": "list", "data": listed}))
        return
    for job in listed:
        print_job(job, False)


@app.command("run")
def run(file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="OpenAI batch JSONL.")],
        model: Annotated[str, typer.Option(help="'smollm2' or a local model dir.")] = "smollm2",
        output: Annotated[Path | None, typer.Option("-o", "--output", help="Results file (default: "
                                                    "<name>.results.jsonl beside the input).")] = None,
        fresh: Annotated[bool, typer.Option(help="Start a new job even if this file ran or was interrupted "
                                                 "before.")] = False) -> None:
    """Run a batch file end to end on this machine: a local swarm and worker, a progress bar, the results file.

    Ctrl-C stops everything it started and keeps the job: the same command again resumes it.
    """
    from launch.batch_run import RunRequest, run_file
    from launch.processes import exit_on_sigterm

    exit_on_sigterm()
    request = RunRequest(file=file, model=model, output=output, fresh=fresh)
    outcome = run_file(request, echo=typer.echo)
    job = outcome.job
    typer.echo(f"{outcome.results} results written to {request.results}")
    typer.echo(f"{outcome.errors} error lines written to {request.errors}" if outcome.errors else "No error lines.")
    typer.echo(f"Job {job['id']} {job['status']}: {job['tokens_generated']} tokens; wall time {outcome.seconds:.1f} s. "
               "Every process this run started is stopped.")
    if job["status"] != "completed":
        raise typer.Exit(ExitCode.JOB_FAILED)
