"""Starting a swarm on this machine as real processes: a DHT node and block servers (demo, tests, benches).

Each process runs in its own process group, so stopping it also stops its p2pd daemon.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from servers.errors import ServerError

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
        """The first stdout line starting with `prefix`; raises ServerError if the process dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise ServerError(f"{self.name} exited with code {self.proc.returncode}; see {self.log_path}")
                continue
            if line.startswith(prefix):
                self.ready_line = line
                return line
        raise ServerError(f"{self.name} was not ready in {timeout:.0f} s; see {self.log_path}")

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
    """The swarmbatch CLI run by this interpreter."""
    return [sys.executable, "-m", "cli", *args]


class LocalSwarm:
    """A DHT bootstrap node and block servers on 127.0.0.1; a context manager that stops all it started."""

    def __init__(self, model_dir: str | Path, spans: Sequence[tuple[int, int]] = (), *, host: str = "127.0.0.1",
                 log_dir: Path | None = None, server_args: Sequence[str] = (), num_threads: int = 1,
                 pin_cpus: bool = False, ready_timeout: float = 180.0) -> None:
        self.model_dir, self.spans, self.host = str(model_dir), list(spans), host
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="swarmbatch-swarm-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.server_args, self.num_threads = list(server_args), num_threads
        self.pin_cpus, self.ready_timeout = pin_cpus, ready_timeout
        self.dht: ManagedProcess | None = None
        self.servers: list[ManagedProcess] = []
        self.initial_peers: list[str] = []

    def __enter__(self) -> LocalSwarm:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the DHT node, then every server in parallel, and wait until all are ready."""
        self.dht = ManagedProcess(cli_command("dht", "--host", self.host), name="dht", log_dir=self.log_dir)
        self.initial_peers = [self.dht.wait_for_line("/ip4/", timeout=60)]
        self.start_servers([(start, end, ()) for start, end in self.spans])

    def start_server(self, start: int, end: int, *, wait: bool = True, extra_args: Sequence[str] = ()
                     ) -> ManagedProcess:
        """Start one more block server on blocks [start, end)."""
        number = len(self.servers)
        args = cli_command("serve", self.model_dir, "--blocks", f"{start}:{end}", "--host", self.host,
                           "--num-threads", str(self.num_threads), *self.server_args, *extra_args,
                           "--initial-peers", *self.initial_peers)
        server = ManagedProcess(args, name=f"server{number}-{start}-{end}", log_dir=self.log_dir,
                                env={"OMP_NUM_THREADS": str(self.num_threads)},
                                cpu=(number % (os.cpu_count() or 1)) if self.pin_cpus else None)
        self.servers.append(server)
        if wait:
            server.wait_for_line("Serving blocks", timeout=self.ready_timeout)
        return server

    def start_servers(self, specs: Sequence[tuple[int, int, Sequence[str]]]) -> list[ManagedProcess]:
        """Start several servers at once, each (start, end, extra_args), and wait until all are ready."""
        started = [self.start_server(start, end, wait=False, extra_args=args) for start, end, args in specs]
        for server in started:
            server.wait_for_line("Serving blocks", timeout=self.ready_timeout)
        return started

    def stop(self) -> None:
        """Stop every server (gracefully), then the DHT node."""
        for server in self.servers:
            server.terminate()
        if self.dht is not None:
            self.dht.terminate()
