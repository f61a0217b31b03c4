"""Exit codes, and the CLI's one error boundary: an error of ours becomes one line on stderr and a documented code.

The boundary matches errors by the qualified names of their classes along the raised error's MRO (the most
derived match wins). Importing the classes instead would load SQLAlchemy, kombu, Alembic and every package of ours
into every command, even `--help`; and an error whose module was never imported cannot have been raised.
An error the table does not name is a bug: its traceback is shown as Python shows it.
"""
from __future__ import annotations

import traceback
from enum import IntEnum
from typing import Any

import typer
from typer.core import TyperGroup

from commands.options import verbose_requested


class ExitCode(IntEnum):
    """The exit status of every `swarmbatch` command."""

    OK = 0  # the command did what it was asked
    JOB_FAILED = 1  # `submit --wait`: the job ended other than completed (or another job error reached the top)
    USAGE = 2  # fix the command: bad flags (click's own code), an unusable model dir or key file, an unknown job, key or revision
    STORE_UNREACHABLE = 3  # the database or the broker (Redis) does not answer, or is not migrated: start it
    SWARM_UNAVAILABLE = 4  # the DHT is unreachable, blocks are missing or servers fail: start or check the swarm
    INTERRUPTED = 130  # `run`: Ctrl-C (128 + SIGINT); everything it started is stopped, the job kept to resume


DATABASE_ERROR = "sqlalchemy.exc.DBAPIError"  # any driver error reaching the top: unreachable, not migrated
BROKER_ERROR = "kombu.exceptions.OperationalError"  # the broker refused connections through Celery's retries

EXIT_CODES: dict[str, ExitCode] = {
    "jobs.errors.InvalidJob": ExitCode.USAGE,
    "jobs.errors.JobNotFound": ExitCode.USAGE,
    "jobs.errors.IdempotencyConflict": ExitCode.USAGE,
    "jobs.errors.ApiKeyNotFound": ExitCode.USAGE,
    "jobs.errors.StoreUnavailable": ExitCode.STORE_UNREACHABLE,
    "jobs.errors.JobsError": ExitCode.JOB_FAILED,
    "swarmnet.errors.ModelDirError": ExitCode.USAGE,
    "swarmclient.errors.InvalidRequest": ExitCode.USAGE,
    "swarmnet.errors.NetworkConfigError": ExitCode.USAGE,
    "swarmnet.membership.MembershipError": ExitCode.USAGE,  # a bad swarm file or key; not a member of the swarm
    "swarmnet.identity.IdentityError": ExitCode.USAGE,
    "swarmnet.errors.SwarmError": ExitCode.SWARM_UNAVAILABLE,
    "servers.errors.ServerConfigError": ExitCode.USAGE,
    "servers.errors.ServerError": ExitCode.SWARM_UNAVAILABLE,
    "modelprep.errors.ModelPrepError": ExitCode.USAGE,
    "launch.errors.RunInterrupted": ExitCode.INTERRUPTED,
    "launch.errors.LaunchError": ExitCode.SWARM_UNAVAILABLE,  # a local DHT, server or worker did not come up
    # Alembic's own errors: an unknown revision (`db upgrade nosuchrev`); a database it cannot reach is a DBAPIError
    "alembic.util.exc.CommandError": ExitCode.USAGE,
    DATABASE_ERROR: ExitCode.STORE_UNREACHABLE,
    BROKER_ERROR: ExitCode.STORE_UNREACHABLE,
}


class ErrorBoundary(TyperGroup):
    """The root command group: an error of ours from any command becomes one line on stderr and its exit code."""

    # ctx is typer's own click Context (vendored since typer 0.2x) or click's, by typer version: hence Any
    def invoke(self, ctx: Any) -> Any:
        """Run the command; turn an error named in EXIT_CODES into `Error: <Type>: <message>` and typer.Exit."""
        try:
            return super().invoke(ctx)
        except Exception as error:
            code = exit_code_for(error)
            if code is None:
                raise
            report(error, with_traceback=verbose_requested(ctx))
            raise typer.Exit(code) from None


def exit_code_for(error: BaseException) -> ExitCode | None:
    """The documented exit code of an error, or None for one that is not ours."""
    for name in class_names(error):
        if name in EXIT_CODES:
            return EXIT_CODES[name]
    return None


def class_names(error: BaseException) -> list[str]:
    """The qualified names of the error's class and its bases, most derived first."""
    return [f"{kind.__module__}.{kind.__qualname__}" for kind in type(error).__mro__]


def report(error: BaseException, *, with_traceback: bool) -> None:
    """The traceback (with --verbose), then one line on stderr: `Error: <Type>: <message>`."""
    if with_traceback:
        typer.echo("".join(traceback.format_exception(error)).rstrip(), err=True)
    typer.echo(f"Error: {type(error).__name__}: {message_of(error)}", err=True)


def message_of(error: BaseException) -> str:
    """The error's message; a database or broker error names the service (no password) and what to do."""
    names = class_names(error)
    if DATABASE_ERROR in names:  # its own text carries the SQL statement and a link, over several lines
        from jobs.settings import get_settings

        url = without_password(get_settings().resolved_database_url)
        return (f"database {url} is not usable ({first_line(getattr(error, 'orig', None) or error)}); start it "
                "or fix SWARMBATCH_DATABASE_URL, and migrate it with 'swarmbatch db upgrade'")
    if BROKER_ERROR in names:
        from jobs.settings import get_settings

        url = without_password(get_settings().resolved_broker_url)
        return f"broker {url} is not reachable ({first_line(error)}); start it or fix SWARMBATCH_BROKER_URL"
    return str(error)


def first_line(error: BaseException) -> str:
    """The first non-empty line of an error's text (drivers add hints on further lines)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def without_password(url: str) -> str:
    """A database or broker URL with its password masked."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:  # not a URL SQLAlchemy parses: drop everything up to the host
        return url.rsplit("@", 1)[-1]
