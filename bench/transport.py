"""The transport floor of a hop, for bench/swarm.py: a decode step over a bare hivemind stream.

An echo process (pinned to one core, one torch thread) holds the same blocks as a server and runs them on every
message, so its caches are as cold as a server's when it answers; but it has no session, no validation and no
codec, only the 8-byte length prefix and raw float32 bytes. A client on its own P2P daemon (as the swarm client
has) times 1x1xH steps; round trip minus the echo's compute is the least a hop can cost on this machine.
`bench/swarm.py` prints it beside our hop cost, so the difference is what swarmbatch's own code adds.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import struct
import time
from pathlib import Path
from typing import Any

import torch

ECHO_RPC = "swarmbatch.bench-echo"
PREFILL = 64


async def read_raw(reader: asyncio.StreamReader) -> bytes:
    """One message: an 8-byte length, then raw bytes (not a frame: `protocol.read_frame` would take the first 4 bytes
    of the floats for a header's length)."""
    length = int.from_bytes(await reader.readexactly(8), "big")
    return await reader.readexactly(length)


def _echo_server(model_dir: str, start: int, end: int, cpu: int | None, ready: Any) -> None:
    """Child process: serve blocks [start, end) as an echo on a bare stream until SIGTERM."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    from hivemind.p2p import P2P

    from servers.block_loading import load_span
    from swarmnet import protocol
    from swarmnet.addresses import NetworkOptions
    from swarmnet.model_spec import ModelSpec
    from swarmnet.network import run_async

    span = load_span(ModelSpec.open(model_dir), start, end)
    caches = span.new_caches(start, end)
    span(torch.randn(1, PREFILL, span.spec.hidden_size), torch.ones(1, PREFILL, dtype=torch.long),
         torch.arange(PREFILL)[None], caches)
    mask, positions = torch.ones(1, PREFILL + 1, dtype=torch.long), torch.tensor([[PREFILL]])

    async def echo(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                frame = await read_raw(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            hidden = torch.frombuffer(bytearray(frame), dtype=torch.float32).view(1, 1, -1)
            began = time.perf_counter()
            with torch.inference_mode():
                output = span(hidden, mask, positions, caches)
            compute = time.perf_counter() - began
            for cache in caches:
                cache.crop(-1)  # the same cache length at every step
            protocol.write_frame(writer, struct.pack("<d", compute) + output.numpy().tobytes())
            await writer.drain()

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        p2p = await P2P.create(**NetworkOptions().p2p_kwargs())
        try:
            await p2p.add_binary_stream_handler(ECHO_RPC, echo)
            ready.put([str(a) for a in await p2p.get_visible_maddrs()])
            await stop.wait()
        finally:
            await p2p.shutdown()

    run_async(main())


async def _time_steps(maddrs: list[str], hidden_size: int, steps: int) -> list[float]:
    """Seconds of transport per step: round trip minus the compute the echo reports."""
    from hivemind.p2p import P2P, PeerID

    from swarmnet import protocol
    from swarmnet.addresses import NetworkOptions

    p2p = await P2P.create(initial_peers=maddrs, **NetworkOptions().p2p_kwargs())
    try:
        peer = PeerID.from_base58(maddrs[0].rsplit("/p2p/", 1)[1])
        _, reader, writer = await p2p.call_binary_stream_handler(peer, ECHO_RPC)
        payload = torch.randn(1, 1, hidden_size).numpy().tobytes()
        costs = []
        for step in range(steps + 1):
            began = time.perf_counter()
            protocol.write_frame(writer, payload)
            await writer.drain()
            answer = await read_raw(reader)
            round_trip = time.perf_counter() - began
            if step > 0:  # the first step opens the connection
                costs.append(round_trip - struct.unpack("<d", answer[:8])[0])
        writer.close()
        return costs
    finally:
        await p2p.shutdown()


def raw_hop_costs(model_dir: Path, start: int, end: int, steps: int, cpu: int | None) -> list[float]:
    """Transport seconds of `steps` decode steps to an echo of blocks [start, end) (see the module docstring)."""
    from swarmnet.model_spec import ModelSpec
    from swarmnet.network import LoopThread

    context = multiprocessing.get_context("spawn")
    ready = context.Queue()
    process = context.Process(target=_echo_server, args=(str(model_dir), start, end, cpu, ready), daemon=True)
    process.start()
    loop = LoopThread("bench-echo-client")
    try:
        maddrs = ready.get(timeout=120)
        return loop.run(_time_steps(maddrs, ModelSpec.open(model_dir).hidden_size, steps), timeout=300)
    finally:
        loop.stop()
        process.terminate()  # SIGTERM: the echo shuts its P2P daemon down, then exits
        process.join(timeout=20)
        if process.is_alive():
            process.kill()
            process.join()
