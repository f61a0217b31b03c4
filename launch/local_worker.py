"""Starting `swarmbatch worker` as a child process with this process's settings (demo and tests)."""
from __future__ import annotations

from pathlib import Path

from jobs.errors import WorkerGone
from jobs.settings import Settings
from launch.processes import ManagedProcess, cli_command


def settings_env(settings: Settings) -> dict[str, str]:
    """The SWARMBATCH_* environment that rebuilds `settings` in a child process."""
    env: dict[str, str] = {}
    for name, value in settings.model_dump().items():
        if value is not None:
            env[f"SWARMBATCH_{name.upper()}"] = env_value(value)
    # resolved, so that a stray variable inherited from this process cannot point the child elsewhere
    env["SWARMBATCH_DATABASE_URL"] = settings.resolved_database_url
    env["SWARMBATCH_BROKER_URL"] = settings.resolved_broker_url
    env["OMP_NUM_THREADS"] = str(settings.worker_threads)
    return env


def env_value(value: object) -> str:
    """A setting as its environment variable writes it: lists comma-separated (a path may hold spaces), mappings as
    KEY=VALUE pairs (SWARMBATCH_MODEL_ALIASES)."""
    if isinstance(value, list):
        return ",".join(str(item) for item in value)
    if isinstance(value, dict):
        return ",".join(f"{key}={item}" for key, item in value.items())
    return str(value)


def start_local_worker(settings: Settings, *, log_dir: Path, name: str = "worker", verbose: bool = False,
                       beat: bool = False) -> ManagedProcess:
    """A `swarmbatch worker` process (own process group) on the store and broker of `settings`.

    It maintains the store by itself (lost leases, deadlines); `beat=True` embeds beat too, for schedules.
    """
    args = (["-v"] if verbose else []) + ["worker"] + (["--beat"] if beat else [])
    return ManagedProcess(cli_command(*args), name=name, log_dir=log_dir, env=settings_env(settings))


def require_running(worker: ManagedProcess, *, resume: str = "run 'swarmbatch worker' to resume") -> None:
    """Raise WorkerGone, naming its exit code, how to resume (`resume`) and its log, if the worker process has
    exited."""
    code = worker.proc.poll()
    if code is not None:
        raise WorkerGone(f"the {worker.name} process (pid {worker.pid}) exited with code {code} before the job "
                         f"ended; its checkpoints are kept: {resume}. Log: {worker.log_path}")
