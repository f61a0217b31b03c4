"""`LocalSwarm`: a DHT node and block servers on this machine as real processes (demo, tests, benches)."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from launch.processes import ManagedProcess, cli_command
from launch.ready import SERVING_BLOCKS
from swarmnet.identity import Identity
from swarmnet.membership import CLIENT, SERVER, SwarmAccess, SwarmFile


class LocalSwarm:
    """A DHT bootstrap node and block servers on 127.0.0.1; a context manager that stops all it started.

    private=True makes it a private swarm: a key per process in `log_dir/keys`, a swarm file listing them
    (`swarm_file`), and a member key for clients (`client_key`; `access()` is what a client passes).
    """

    def __init__(self, model_dir: str | Path, spans: Sequence[tuple[int, int]] = (), *, host: str = "127.0.0.1",
                 log_dir: Path | None = None, server_args: Sequence[str] = (), num_threads: int = 1,
                 pin_cpus: bool = False, ready_timeout: float = 180.0, private: bool = False) -> None:
        self.model_dir, self.spans, self.host = str(model_dir), list(spans), host
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="swarmbatch-swarm-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.server_args, self.num_threads = list(server_args), num_threads
        self.pin_cpus, self.ready_timeout = pin_cpus, ready_timeout
        self.dht: ManagedProcess | None = None
        self.servers: list[ManagedProcess] = []
        self.initial_peers: list[str] = []
        self.swarm_file = self.log_dir / "swarm.json" if private else None
        self.client_key = self.new_member("client", CLIENT) if private else None

    def __enter__(self) -> LocalSwarm:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def new_key(self, name: str) -> Path:
        """The key file `log_dir/keys/NAME.key`, created unless a run in the same log dir made it (not a member)."""
        path = self.log_dir / "keys" / f"{name}.key"
        Identity.load_or_create(path)
        return path

    def new_member(self, name: str, role: str = SERVER) -> Path:
        """A new key file, added to the swarm file in `role` (private swarms only)."""
        assert self.swarm_file is not None, "an open swarm has no members"
        path = self.new_key(name)
        swarm = SwarmFile.load(self.swarm_file) if self.swarm_file.exists() else SwarmFile(self.swarm_file)
        swarm.add(Identity.load(path).peer_id, name, role)
        swarm.save()
        return path

    def access(self) -> SwarmAccess:
        """What a client of this swarm passes: open, or the swarm file and the client member key."""
        return SwarmAccess.load(self.swarm_file, self.client_key)

    def member_args(self, name: str) -> list[str]:
        """--identity and --swarm-file of a new member process (nothing for an open swarm)."""
        if self.swarm_file is None:
            return []
        return ["--identity", str(self.new_member(name)), "--swarm-file", str(self.swarm_file)]

    def start(self) -> None:
        """Start the DHT node, then every server in parallel, and wait until all are ready."""
        self.dht = ManagedProcess(cli_command("dht", "--host", self.host, *self.member_args("dht")), name="dht",
                                  log_dir=self.log_dir)
        self.initial_peers = [self.dht.wait_for_line("/", timeout=60)]  # its multiaddr: /ip4/, /ip6/ or /dns4/
        self.start_servers([(start, end, ()) for start, end in self.spans])

    def start_server(self, start: int, end: int, *, wait: bool = True, extra_args: Sequence[str] = (),
                     member: bool = True, env: Mapping[str, str] | None = None,
                     model_dir: str | Path | None = None) -> ManagedProcess:
        """Start one more block server on blocks [start, end).

        member=False in a private swarm: a server with its own key that is not in the swarm file (and, having none,
        open to anyone), as an outsider would run one. env: extra environment variables. model_dir: this server's
        own copy of the model (e.g. only its span's shards), instead of the swarm's.
        """
        return self._start_server(f"{start}-{end}", ["--blocks", f"{start}:{end}"], wait=wait, extra_args=extra_args,
                                  member=member, env=env, model_dir=model_dir)

    def start_unpinned(self, num_blocks: int, *, wait: bool = True, extra_args: Sequence[str] = ()) -> ManagedProcess:
        """Start one more block server with --num-blocks: it picks its span, and moves it (docs/healing.md)."""
        return self._start_server(f"n{num_blocks}", ["--num-blocks", str(num_blocks)], wait=wait,
                                  extra_args=extra_args)

    def _start_server(self, label: str, span_args: Sequence[str], *, wait: bool, extra_args: Sequence[str],
                      member: bool = True, env: Mapping[str, str] | None = None,
                      model_dir: str | Path | None = None) -> ManagedProcess:
        number = len(self.servers)
        name = f"server{number}-{label}"
        membership = self.member_args(name) if member else \
            ([] if self.swarm_file is None else ["--identity", str(self.new_key(name))])
        args = cli_command("serve", str(model_dir or self.model_dir), *span_args, "--host", self.host,
                           "--num-threads", str(self.num_threads), *membership, *self.server_args, *extra_args,
                           "--initial-peers", *self.initial_peers)
        server = ManagedProcess(args, name=name, log_dir=self.log_dir,
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
