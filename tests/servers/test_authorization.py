"""`BlockHandler.authorize`: the one check of a stream's first message, before anything is reserved or computed."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hivemind.p2p import P2P, PeerID

from servers.config import ServerConfig
from servers.errors import RequestRejected
from servers.server import BlockServer
from swarmnet import protocol
from swarmnet.network import run_async


async def first_answer(client: P2P, server: BlockServer, rpc: str, frame: bytes) -> dict[str, Any]:
    """Send one message on a new stream of `rpc`; the meta of its answer."""
    _, reader, writer = await client.call_binary_stream_handler(PeerID.from_base58(server.peer_id), rpc)
    try:
        protocol.write_frame(writer, frame)
        await writer.drain()
        return protocol.decode(await protocol.read_frame(reader, 1 << 20))[1]
    finally:
        writer.close()


@pytest.mark.swarm  # a server and two clients in this process (three p2pd)
def test_a_refused_caller_gets_unauthorized_on_every_rpc_and_takes_nothing(tiny_model: Path) -> None:
    server = BlockServer(ServerConfig(model_dir=str(tiny_model), initial_peers=[], blocks=(0, 6),
                                      attn_cache_tokens=64))
    calls: list[tuple[str, dict[str, Any]]] = []

    def members_only(caller: str, meta: dict[str, Any]) -> str:
        calls.append((caller, meta))
        if meta.get("credential") != "member":
            raise RequestRejected(protocol.ErrorCode.UNAUTHORIZED, "not a member of this swarm")
        return caller

    async def scenario() -> None:
        maddrs = await server.start()
        assert server.serving is not None
        server.serving.handler.authorize = members_only
        stranger, member = await P2P.create(initial_peers=maddrs), await P2P.create(initial_peers=maddrs)
        try:
            header = {"start": 0, "end": 6, "batch_size": 1, "length": 2, "dtype": "float32"}
            opening = {"open": True, "session_id": "a" * 32, "start": 0, "end": 6, "batch_size": 1, "max_length": 32}
            for rpc, meta in [(protocol.RPC_INFO, {}), (protocol.RPC_FORWARD, header), (protocol.RPC_INFERENCE, opening)]:
                answer = await first_answer(stranger, server, rpc, protocol.encode([], meta))
                assert (protocol.response_error(answer) or (None,))[0] == protocol.ErrorCode.UNAUTHORIZED, rpc
            status = server.status().loaded_span()
            assert (status.sessions, status.forwards, status.cache.used) == (0, 0, 0)
            assert server.status().stats.errors["unauthorized"] == 3
            # the caller is the authenticated peer id; the hook sees the first message's meta, extra keys included
            assert [caller for caller, _ in calls] == [stranger.peer_id.to_base58()] * 3
            assert calls[2][1] == opening
            answer = await first_answer(member, server, protocol.RPC_INFERENCE,
                                        protocol.encode([], {**opening, "credential": "member"}))
            assert answer == {"opened": True, "session_id": "a" * 32}
            assert calls[-1] == (member.peer_id.to_base58(), {**opening, "credential": "member"})
            info = await first_answer(member, server, protocol.RPC_INFO, protocol.encode([], {"credential": "member"}))
            assert info["peer_id"] == server.peer_id
        finally:
            await stranger.shutdown()
            await member.shutdown()
            await server.shutdown()

    run_async(scenario())
