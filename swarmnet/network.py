"""hivemind P2P + DHT node plumbing shared by clients and servers, and a background event loop for sync callers.

We run `P2P` and `DHTNode` in-process (never `hivemind.DHT`, which forks a child process): this works inside
Celery prefork children and leaves no orphan process but the p2pd daemon, which dies with our process group.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import uvloop
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, P2PDaemonError
from hivemind.utils.logging import loglevel, python_level_to_golog

from swarmnet.addresses import NetworkOptions
from swarmnet.errors import DHTUnreachable
from swarmnet.identity import Identity
from swarmnet.records import GuardedDHTNode, SignedRecordValidator, reader_validator
from swarmnet.relays import RELAY_LOGGER, RelayGuard, RelayRole

T = TypeVar("T")
logger = logging.getLogger(__name__)


async def start_dht_node(
    initial_peers: Sequence[str], options: NetworkOptions, *, client_mode: bool,
    writers: Callable[[str], bool] | None = None,
) -> tuple[P2P, GuardedDHTNode]:
    """Start a P2P daemon and a DHT node on it; raises DHTUnreachable if no initial peer answers.

    Every node is a GuardedDHTNode checking records with a SignedRecordValidator (swarmnet/records.py). A full
    node (server, bootstrap) also signs its own records, with the key its libp2p peer id is made of:
    `options.identity_path`, or an ephemeral key (`node_key`). A client-mode node stores nothing for others; it
    only checks what it reads.

    writers: whose records a full node stores (a private swarm's `Membership.allows`); None stores everyone's.
    Every node decodes peers' values within bounds and every full node refuses oversized store requests whole
    (swarmnet/dht_wire.py), from before it meets its first peer.
    """
    plan = options.plan()
    for level, note in plan.notes(options.host):
        logger.log(level, "%s", note)
    guarded = options.relay_role is RelayRole.relay and writers is not None
    if client_mode:
        p2p = await _start_p2p(initial_peers, options.p2p_kwargs(plan, initial_peers))
        validator = reader_validator()
    else:
        with node_key(options.identity_path) as (identity, existed):
            # a key created just now cannot be in use: skip hivemind's check, which dials the swarm first
            p2p = await _start_p2p(initial_peers, {**options.p2p_kwargs(plan, initial_peers),
                                                   "identity_path": str(identity.path),
                                                   "check_if_identity_free": existed, "relay_events": guarded})
        validator = SignedRecordValidator(identity)
        if p2p.peer_id.to_base58() != identity.peer_id:
            await p2p.shutdown()
            raise RuntimeError(f"p2pd runs as {p2p.peer_id} but records would be signed as {identity.peer_id}")
        logger.info("Listening on %s; announcing %s", " ".join(plan.listen), " ".join(await visible_maddrs(p2p)))
    if guarded:
        assert writers is not None and isinstance(p2p, RelayP2P)  # for mypy: `guarded` says both
        RelayGuard(p2p, writers)
        logger.info("Relaying for this swarm's members (circuit relay v2; others are disconnected)")
    elif options.relay_role is RelayRole.relay:
        logger.info("Relaying for anyone: this swarm is open (no --swarm-file)")
    try:
        node = await GuardedDHTNode.create(
            p2p=p2p, initial_peers=list(initial_peers), client_mode=client_mode,
            ensure_bootstrap_success=bool(initial_peers), wait_timeout=3, record_validator=validator,
            writers=writers,
        )
    except Exception as e:  # hivemind raises RuntimeError/P2P errors when bootstrap fails
        await p2p.shutdown()
        raise DHTUnreachable(f"could not join the DHT through --initial-peers {', '.join(initial_peers)}: {e}. "
                             "Start 'swarmbatch dht' or fix --initial-peers") from e
    return p2p, node


async def _start_p2p(initial_peers: Sequence[str], p2p_kwargs: dict[str, Any]) -> P2P:
    try:
        with _children_ignore_sigint():
            return await RelayP2P.create(initial_peers=list(initial_peers), **p2p_kwargs)
    except P2PDaemonError as e:
        raise DHTUnreachable(f"cannot start P2P or reach {list(initial_peers)}: {e}. "
                             "Check that 'swarmbatch dht' runs and the multiaddr is right") from e


class RelayP2P(P2P):
    """hivemind's P2P with two additions: p2pd flags that `P2P.create` has no argument for, and a callback that sees
    every log record of p2pd's relay service (`on_relay_event(message)`)."""

    _extra_flags: dict[str, Any] = {}

    def __init__(self) -> None:
        super().__init__()
        self.on_relay_event: Callable[[str], None] | None = None

    @classmethod
    async def create(cls, *args: Any, extra_flags: dict[str, Any] | None = None,  # type: ignore[override]
                     relay_events: bool = False, **kwargs: Any) -> RelayP2P:
        """`P2P.create` plus `extra_flags` (-name=value for p2pd) and, with `relay_events`, p2pd's relay logger at
        debug level (what `on_relay_event` receives)."""
        flags = dict(extra_flags or {})

        class Configured(cls):  # type: ignore[valid-type,misc]
            _extra_flags = flags

        with _relay_log_level(relay_events):
            p2p = await P2P.create.__func__(Configured, *args, **kwargs)  # type: ignore[attr-defined]
        return p2p  # type: ignore[no-any-return]

    @classmethod
    def _make_process_args(cls, *args: Any, **kwargs: Any) -> list[str]:  # type: ignore[override]
        return P2P._make_process_args(*args, **{**kwargs, **cls._extra_flags})

    def _log_p2pd_message(self, line: str) -> None:  # type: ignore[override]
        P2P._log_p2pd_message(line)
        if self.on_relay_event is not None and f'"logger":"{RELAY_LOGGER}"' in line:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                self.on_relay_event(str(json.loads(line)["msg"]))


@contextlib.contextmanager
def _relay_log_level(enabled: bool) -> Iterator[None]:
    """GOLOG_LOG_LEVEL for the p2pd started inside the block: the relay logger at debug level, others as hivemind
    sets them. p2pd copies the environment when it starts, so the change lasts only as long as the block."""
    if not enabled:
        yield
        return
    previous = os.environ.get("GOLOG_LOG_LEVEL")
    base = previous or python_level_to_golog(loglevel)
    os.environ["GOLOG_LOG_LEVEL"] = f"{base},{RELAY_LOGGER}=debug"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("GOLOG_LOG_LEVEL", None)
        else:
            os.environ["GOLOG_LOG_LEVEL"] = previous


@contextlib.contextmanager
def node_key(identity_path: str | None) -> Iterator[tuple[Identity, bool]]:
    """The key a full node runs p2pd with and signs its records with, and whether its file existed before.

    With `identity_path`, that key file (created if missing). Without, an ephemeral key in a private temporary
    directory (mode 0700, the file 0400), deleted when the block exits: p2pd reads it once, at start-up.
    """
    if identity_path is not None:
        existed = os.path.isfile(identity_path)
        yield Identity.load_or_create(identity_path), existed
        return
    with tempfile.TemporaryDirectory(prefix="swarmbatch-key-") as directory:
        yield Identity.create(Path(directory) / "identity.key"), False


async def stop_dht_node(p2p: P2P, node: DHTNode, timeout: float = 5.0) -> None:
    """Leave the DHT, then stop the P2P daemon; each step bounded by `timeout`.

    A signal sent to the whole process group (Ctrl-C in a terminal, `kill -- -PGID`) may have stopped p2pd
    first; hivemind's shutdown then waits forever on the dead daemon.
    """
    for step in (node.shutdown, p2p.shutdown):
        try:
            await asyncio.wait_for(step(), timeout=timeout)
        except Exception as e:
            logger.warning("Shutdown step %s did not finish: %s", step.__qualname__, type(e).__name__)


@contextlib.contextmanager
def _children_ignore_sigint() -> Iterator[None]:
    """Spawn p2pd with SIGINT ignored (inherited through exec), so Ctrl-C in a terminal reaches only us.

    Otherwise the terminal's SIGINT kills p2pd at once, and a server can no longer announce OFFLINE.
    Only the main thread may change signal handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


async def visible_maddrs(p2p: P2P) -> list[str]:
    """Full multiaddrs (with /p2p/<peer id>) that other peers can use as initial peers."""
    return [str(addr) for addr in await p2p.get_visible_maddrs()]


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop: a decode step's hops cross the loop several times, and uvloop's wake-ups are cheaper."""
    return uvloop.new_event_loop()


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on a uvloop event loop (servers and the DHT node)."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


class LoopThread:
    """An asyncio event loop in a daemon thread, so synchronous code can run coroutines on it."""

    def __init__(self, name: str = "swarmbatch-loop") -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """Cancel what still runs on the loop (hivemind leaves background tasks), stop it and join its thread."""
        if not self.loop.is_running():
            return
        try:
            self.run(_cancel_other_tasks(), timeout=5)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)


async def _cancel_other_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
