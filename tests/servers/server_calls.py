"""Calls a test makes to a real server of the tiny model (6 blocks, hidden 64) through a real client: sessions
opened by hand on one server, its `info` answer, and waiting for what a server does a moment later."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from launch.local_swarm import LocalSwarm
from swarmclient.session import ServerSession
from swarmclient.swarm import Swarm
from swarmnet.data_structures import RouteHop
from swarmnet.model_spec import ModelSpec


def inputs(length: int, *, batch: int = 1, hidden_size: int = 64) -> list[torch.Tensor]:
    """A step's tensors: hidden states, attention mask, positions."""
    hidden = torch.randn(batch, length, hidden_size, generator=torch.Generator().manual_seed(length))
    return [hidden, torch.ones(batch, length, dtype=torch.long), torch.arange(length).expand(batch, length)]


def session(client: Swarm, peer_id: str, *, max_length: int = 8) -> ServerSession:
    """A session on all 6 blocks of a server, opened by its first step (4 tokens)."""
    opened = client.loop.run(ServerSession(client, RouteHop(peer_id, 0, 6), batch_size=1, max_length=max_length).open())
    client.loop.run(opened.step(*inputs(4)))
    return opened


def info(client: Swarm, peer_id: str) -> dict[str, Any]:
    """The server's `info` answer to this client."""
    return client.loop.run(client.call_info(peer_id))


def eventually(check: Callable[[], bool], timeout: float = 15.0) -> bool:
    """Whether `check` holds within `timeout` (a server frees a session a moment after its stream ends)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@contextmanager
def two_clients(swarm: LocalSwarm, model: Path) -> Iterator[tuple[Swarm, Swarm]]:
    """Two clients of the swarm (two peer ids: two callers to its servers), closed afterwards."""
    spec = ModelSpec.open(model)
    clients = [Swarm.connect(swarm.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks) for _ in range(2)]
    try:
        yield clients[0], clients[1]
    finally:
        for client in clients:
            client.close()
