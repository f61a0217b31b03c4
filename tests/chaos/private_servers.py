"""Private Redis and PostgreSQL servers for the chaos tests: started on free ports, crashed and restarted at will.

The shared services are never touched: each server here is a child process of the test run, stopped by its PID.
PostgreSQL refuses to run as root, so as root `initdb` and `postgres` run as the `postgres` user.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from ports import free_port


def missing(what: str) -> None:
    """Skip on a laptop without the binaries; fail in CI, which must have them."""
    message = f"{what} is not installed; the chaos tests run private servers"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


class PrivateRedis:
    """redis-server on a free port without persistence: a kill loses every queued message, as a crash would."""

    def __init__(self, log_dir: Path) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            missing("redis-server")
        self.port, self.log_path = free_port(), log_dir / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it on its port and wait until it answers."""
        import redis

        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([str(self.binary), "--port", str(self.port), "--bind", "127.0.0.1",
                                          "--save", "", "--appendonly", "no", "--daemonize", "no"],
                                         stdout=log, stderr=log, start_new_session=True)
        client = redis.Redis(port=self.port)
        wait_until(lambda: _answers(client.ping), 10, "the private Redis")
        client.close()

    def kill(self) -> None:
        """SIGKILL, and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class PrivatePostgres:
    """A PostgreSQL cluster in a temporary folder, on a free port, trust authentication; `crash()` and `start()`."""

    def __init__(self) -> None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(Path(p).parts[-3]))
        if not found:
            missing("PostgreSQL (/usr/lib/postgresql/*/bin)")
        self.bin = Path(found[-1]).parent
        self.user = "postgres" if os.geteuid() == 0 else None  # initdb refuses root
        self.root = Path(tempfile.mkdtemp(prefix="swarmbatch-chaos-pg-"))
        if self.user:
            account = pwd.getpwnam(self.user)
            os.chown(self.root, account.pw_uid, account.pw_gid)
        self.data, self.port, self.log_path = self.root / "data", free_port(), self.root / "postgres.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                   "--locale=C", "--no-sync"])

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, args: list[str]) -> None:
        subprocess.run(args, user=self.user, check=True, capture_output=True, cwd=self.root)

    def start(self) -> None:
        """Start the server (after a crash: with crash recovery) and wait until it accepts connections."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.root),
                 "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "full_page_writes=off"],
                stdout=log, stderr=log, user=self.user, cwd=self.root, start_new_session=True)
        wait_until(self._accepts, 30, "the private PostgreSQL")

    def _accepts(self) -> bool:
        ready = subprocess.run([str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                               capture_output=True)
        return ready.returncode == 0

    def crash(self) -> None:
        """`pg_ctl stop -m immediate`: every backend is killed at once, nothing is shut down cleanly."""
        self._run([str(self.bin / "pg_ctl"), "stop", "-D", str(self.data), "-m", "immediate"])
        if self.proc is not None:
            self.proc.wait(10)

    def stop(self) -> None:
        """Fast shutdown by PID, then remove the cluster."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)


def _answers(ping: Callable[[], object]) -> bool:
    try:
        return bool(ping())
    except Exception:  # not up yet
        return False


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not start in {timeout:.0f} s")
        time.sleep(0.05)
