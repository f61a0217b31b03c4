"""`BlockServer.move_span` on a real in-process server: new sessions are refused while it moves, a running one is
ended after the drain, the new span is served and announced with the move in the record."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
from hivemind.p2p import P2P, PeerID

from servers.config import ServerConfig
from servers.rebalancing import Move
from servers.server import BlockServer
from swarmnet import protocol
from swarmnet.data_structures import ServerState
from swarmnet.discovery import get_remote_module_infos
from swarmnet.network import run_async

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def open_session(client: P2P, server: BlockServer, session_id: str, start: int, end: int
                       ) -> tuple[Stream, dict[str, Any]]:
    """A new inference stream and the answer to its open message."""
    _, reader, writer = await client.call_binary_stream_handler(PeerID.from_base58(server.peer_id),
                                                               protocol.RPC_INFERENCE)
    protocol.write_frame(writer, protocol.encode([], {"open": True, "session_id": session_id, "start": start,
                                                      "end": end, "batch_size": 1, "max_length": 8}))
    await writer.drain()
    return (reader, writer), protocol.decode(await protocol.read_frame(reader, 1 << 20))[1]


@pytest.mark.swarm  # a server and a client in this process (two p2pd)
def test_a_moving_server_refuses_new_sessions_ends_running_ones_and_serves_its_new_span(tiny_model: Path) -> None:
    server = BlockServer(ServerConfig(model_dir=str(tiny_model), initial_peers=[], num_blocks=3,
                                      rebalance_period=3600, move_drain_seconds=0.5))

    async def scenario() -> None:
        maddrs = await server.start()
        client = await P2P.create(initial_peers=maddrs)
        try:
            assert server.status().loaded_span().start == 0
            running, opened = await open_session(client, server, "a" * 32, 0, 3)
            assert opened["opened"] is True
            moving = asyncio.create_task(server.move_span(Move(server.peer_id, 3, 6, 0, 1.0, "a test's reason")))
            await asyncio.sleep(0.2)  # announced JOINING on 3:6, draining
            status = server.status()
            assert (status.state, status.loaded_span().start, status.loaded_span().end) == (ServerState.JOINING, 3, 6)
            refused = (await open_session(client, server, "b" * 32, 0, 3))[1]
            assert protocol.response_error(refused) == (protocol.ErrorCode.BUSY,
                                                        "this server is moving to blocks 3:6; route around it")
            assert await moving is True
            assert await asyncio.wait_for(running[0].read(), 5) == b""  # ended after the drain
            status = server.status()
            assert (status.state, status.loaded_span().start, status.loaded_span().sessions) == (ServerState.ONLINE, 3, 0)
            assert [(m.from_start, m.from_end, m.start, m.end, m.reason) for m in status.moves] == \
                [(0, 3, 3, 6, "a test's reason")]
            assert (await open_session(client, server, "c" * 32, 3, 6))[1]["opened"] is True
            assert server.announcer is not None
            infos = await get_remote_module_infos(server.announcer.node, server.spec.model_id, 6)
            assert [infos[i][server.peer_id].state for i in range(6)] == [ServerState.OFFLINE] * 3 + [ServerState.ONLINE] * 3
            assert infos[4][server.peer_id].moves == status.moves and infos[4][server.peer_id].rebalances
        finally:
            await client.shutdown()
            await server.shutdown()

    run_async(scenario())


@pytest.mark.swarm  # a server and a client in this process (two p2pd)
def test_a_move_whose_span_cannot_load_serves_the_old_span_again_and_ends_no_session(
        tiny_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    server = BlockServer(ServerConfig(model_dir=str(model), initial_peers=[], num_blocks=3,
                                      rebalance_period=3600, move_drain_seconds=0.3))

    async def scenario() -> None:
        maddrs = await server.start()
        client = await P2P.create(initial_peers=maddrs)
        try:
            running, opened = await open_session(client, server, "a" * 32, 0, 3)
            assert opened["opened"] is True
            for weights in model.glob("*.safetensors"):  # the new span cannot be read from disk any more
                weights.write_bytes(b"not safetensors")
            moved = await server.move_span(Move(server.peer_id, 3, 6, 0, 1.0, "a test's reason"))
            # the move failed: the old span is served and announced, its session still open, nothing recorded
            status = server.status()
            assert moved is False and not status.moves
            assert (status.state, status.loaded_span().start, status.loaded_span().end) == (ServerState.ONLINE, 0, 3)
            assert status.loaded_span().sessions == 1 and not running[0].at_eof()
            assert (await open_session(client, server, "b" * 32, 0, 3))[1]["opened"] is True
            assert server.announcer is not None
            infos = await get_remote_module_infos(server.announcer.node, server.spec.model_id, 6)
            assert [infos[i][server.peer_id].state for i in range(3)] == [ServerState.ONLINE] * 3
        finally:
            await client.shutdown()
            await server.shutdown()

    run_async(scenario())
