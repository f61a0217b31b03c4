"""`LocalSwarm`: a DHT node and block servers on this machine as real processes (demo, tests, benches)."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from commands.ready import SERVING_BLOCKS
from launch.processes import ManagedProcess, cli_command


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

    def start_server(self, start: int, end: int, *, wait: bool = True, extra_args: Sequence[str] = (),
                     env: Mapping[str, str] | None = None) -> ManagedProcess:
        """Start one more block server on blocks [start, end); `env`: more environment variables for it."""
        number = len(self.servers)
        args = cli_command("serve", self.model_dir, "--blocks", f"{start}:{end}", "--host", self.host,
                           "--num-threads", str(self.num_threads), *self.server_args, *extra_args,
                           "--initial-peers", *self.initial_peers)
        server = ManagedProcess(args, name=f"server{number}-{start}-{end}", log_dir=self.log_dir,
                                env={"OMP_NUM_THREADS": str(self.num_threads), **(env or {})},
                                cpu=(number % (os.cpu_count() or 1)) if self.pin_cpus else None)
        self.servers.append(server)
        if wait:
            server.wait_for_line(SERVING_BLOCKS, timeout=self.ready_timeout)
        return server

    def start_servers(self, specs: Sequence[tuple[int, int, Sequence[str]]]) -> list[ManagedProcess]:
        """Start several servers at once, each (start, end, extra_args), and wait until all are ready."""
        started = [self.start_server(start, end, wait=False, extra_args=args) for start, end, args in specs]
        for server in started:
            server.wait_for_line(SERVING_BLOCKS, timeout=self.ready_timeout)
        return started

    def stop(self) -> None:
        """Stop every server (gracefully), then the DHT node."""
        for server in self.servers:
            server.terminate()
        if self.dht is not None:
            self.dht.terminate()
