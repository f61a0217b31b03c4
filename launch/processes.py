"""Child processes of this machine that we start and stop by PID: `ManagedProcess` and the CLI command line.

Each process runs in its own process group, so stopping it also stops its p2pd daemon.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from launch.errors import ProcessNotReady

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


class ManagedProcess:
    """A child process started in its own session; its stdout lines are collected by a reader thread."""

    def __init__(self, args: Sequence[str], *, name: str, log_dir: Path, env: dict[str, str] | None = None,
                 cpu: int | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        command = ["taskset", "-c", str(cpu), *args] if cpu is not None else list(args)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **OFFLINE_ENV, **(env or {})}, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.ready_line = ""
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def pid(self) -> int:
        """The child's PID (also its process group id)."""
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode(errors="replace").rstrip("\n"))

    def wait_for_line(self, prefix: str, timeout: float) -> str:
        """The first stdout line starting with `prefix`; raises ProcessNotReady if the process dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise ProcessNotReady(f"{self.name} exited with code {self.proc.returncode}; see {self.log_path}") from None
                continue
            if line.startswith(prefix):
                self.ready_line = line
                return line
        raise ProcessNotReady(f"{self.name} was not ready in {timeout:.0f} s; see {self.log_path}")

    def terminate(self, timeout: float = 15.0) -> None:
        """SIGTERM to the process (graceful: a server announces OFFLINE), then SIGKILL its group.

        Only the process gets SIGTERM: it still needs its p2pd daemon to say goodbye on the DHT.
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the process group (the process and its p2pd): a crash, as far as peers can tell."""
        self._signal_group(signal.SIGKILL)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def tree_pids(self) -> list[int]:
        """The process and its living descendants (a worker's pool processes, a server's p2pd)."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            return [root.pid, *(child.pid for child in root.children(recursive=True))]
        except psutil.NoSuchProcess:
            return []

    @property
    def peer_id(self) -> str:
        """The peer id a server printed in its ready line ('Serving blocks A:B of M as PEER at ...')."""
        words = self.ready_line.split()
        return words[words.index("as") + 1] if "as" in words else ""

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that `with LocalSwarm(...)` blocks stop their processes on `kill PID`."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def cli_command(*args: str) -> list[str]:
    """The swarmbatch CLI run by this interpreter.

    -P: the working folder is not put on sys.path, so a user's own `cli.py` or `jobs/` there cannot shadow ours.
    """
    return [sys.executable, "-P", "-m", "cli", *args]


@contextmanager
def interrupts_ignored() -> Iterator[None]:
    """Ignore Ctrl-C (SIGINT) and SIGTERM for the duration, so that a second one cannot cut short the stopping of our
    children. Outside the main thread (where signal handlers cannot be set) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
