"""A client's DHT reads of who serves what: one read shared by concurrent callers, and a decision that never waits."""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from launch.local_swarm import LocalSwarm
from swarmclient.config import ClientConfig
from swarmclient.model import DistributedModelForCausalLM
from swarmnet.data_structures import RemoteSpanInfo
from swarmnet.discovery import BlockServers

T = TypeVar("T")


def test_concurrent_callers_share_one_dht_read_and_a_checkpoint_decision_does_not_wait_for_one(
        tiny_model: Path, shared_swarm: LocalSwarm) -> None:
    # Given a client whose DHT reads go stale at once (discovery_ttl 0), after a first read
    config = dataclasses.replace(ClientConfig(), discovery_ttl=0.0)
    with DistributedModelForCausalLM.from_pretrained(tiny_model, initial_peers=shared_swarm.initial_peers,
                                                     config=config) as model:
        swarm = model.swarm
        first = swarm.loop.run(swarm.block_infos(refresh=True))

        async def three_callers() -> list[list[BlockServers]]:
            return list(await asyncio.gather(*(swarm.block_infos() for _ in range(3))))
        # When three callers ask for the servers at once
        reads = swarm.loop.run(three_callers())
        # Then they got one read between them: the very same answer, read after the first
        assert reads[0] is reads[1] is reads[2] and reads[0] is not first

        async def fresh() -> tuple[list[RemoteSpanInfo] | None, list[BlockServers], list[BlockServers]]:
            # When a decision that must not wait (a checkpoint: which hops anyone can check) asks for the servers
            spans = swarm.fresh_member_spans()
            # Then it is told there is no fresh read (a plain call: it cannot wait for one), and a read began beside
            # it, which the next two callers share
            again = await asyncio.gather(swarm.block_infos(), swarm.block_infos())
            return spans, *again
        stale, second, third = swarm.loop.run(fresh())
        assert stale is None and second is third and second is not reads[0]
        # And with a read younger than discovery_ttl, the same call answers from it at once
        fresh_config = dataclasses.replace(config, discovery_ttl=3600.0)
        swarm.config = fresh_config
        spans = swarm.loop.run(_call(swarm.fresh_member_spans))
        assert spans is not None
        assert {server.peer_id for server in shared_swarm.servers} <= {span.peer_id for span in spans}


async def _call(function: Callable[[], T]) -> T:
    return function()
