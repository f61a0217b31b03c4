"""Benchmark: what the per-message checks of issue 28 (N7, N15) add to a decode step's hop, in microseconds.

Run:  .venv/bin/python bench/frame_checks.py [--hidden 576] [--messages 20000] [--reps 5]

Two costs on every message a server reads, each timed against its baseline in the same run, interleaved rep by rep:
  read     `protocol.read_frame` (reads the 4-byte header length first and refuses a header over 64 KiB before
           reading the rest) vs a bare reader of the same messages (8-byte length, then the bytes:
           bench/transport.py's `read_raw`, what read_frame did before), over an in-memory StreamReader holding
           decode-step frames (1 x 1 x hidden float32, its mask and position)
  recheck  `StreamService._still_member` on an authorized stream (a membership generation read and an integer
           comparison; the swarm file is looked at every 5 s) vs nothing, for an open swarm and a private one
A decode hop costs about 1 ms on this machine (bench/RESULTS.md), so a microsecond here is 0.1 % of it.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transport import read_raw  # noqa: E402  (bench/ is the script's folder, first on sys.path)

from servers.handler import BlockHandler  # noqa: E402
from servers.sessions import Stream  # noqa: E402
from swarmnet import protocol  # noqa: E402
from swarmnet.identity import Identity  # noqa: E402
from swarmnet.membership import Membership, SwarmFile  # noqa: E402


def decode_message(hidden: int) -> bytes:
    """A decode-step message of one row, as a client sends it."""
    frame = protocol.encode([torch.randn(1, 1, hidden), torch.ones(1, 100, dtype=torch.long), torch.tensor([[99]])],
                            {"session_id": "s" * 32, "step_id": 99})
    return protocol.length_prefixed(frame)


async def per_message(read: Callable[[asyncio.StreamReader], Awaitable[bytes]], data: bytes, count: int) -> float:
    """Microseconds per message read from an in-memory stream, each message fed just before it is read (as one
    arrives at a server: the buffer holds one message, not thousands)."""
    reader = asyncio.StreamReader()
    began = time.perf_counter()
    for _ in range(count):
        reader.feed_data(data)
        await read(reader)
    return (time.perf_counter() - began) / count * 1e6


def recheck_us(membership: Membership, count: int) -> tuple[float, float]:
    """(microseconds per `_still_member`, per empty loop iteration) on an authorized stream."""
    service = BlockHandler.__new__(BlockHandler)
    service.membership = membership

    async def stream() -> Stream:
        return Stream(peer="p", timeout=300.0, authorized=True, generation=membership.generation)
    checked = asyncio.run(stream())
    began = time.perf_counter()
    for _ in range(count):
        service._still_member(checked)
    checks = time.perf_counter() - began
    began = time.perf_counter()
    for _ in range(count):
        pass
    return checks / count * 1e6, (time.perf_counter() - began) / count * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=576, help="hidden size (576: SmolLM2)")
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    data = decode_message(args.hidden)
    with tempfile.TemporaryDirectory() as folder:
        key = Identity.create(Path(folder) / "member.key")
        SwarmFile(Path(folder) / "swarm.json", {key.peer_id: "member"}).save()
        private = Membership.from_file(Path(folder) / "swarm.json")
        rows: dict[str, list[float]] = {"read_raw": [], "read_frame": [], "recheck open": [], "recheck private": [],
                                        "empty loop": []}
        for _ in range(args.reps):
            rows["read_raw"].append(asyncio.run(per_message(read_raw, data, args.messages)))
            rows["read_frame"].append(asyncio.run(per_message(
                lambda r: protocol.read_frame(r, 1 << 20), data, args.messages)))
            open_us, empty_us = recheck_us(Membership.open(), args.messages)
            rows["recheck open"].append(open_us)
            rows["recheck private"].append(recheck_us(private, args.messages)[0])
            rows["empty loop"].append(empty_us)
    print(f"per message, median of {args.reps} reps of {args.messages} (hidden {args.hidden}):")
    for name, values in rows.items():
        print(f"  {name:16s} {statistics.median(values):7.3f} us  (reps: {', '.join(f'{v:.3f}' for v in values)})")
    added = statistics.median(rows["read_frame"]) - statistics.median(rows["read_raw"])
    print(f"read_frame - read_raw: {added:+.3f} us per message; recheck (private) - empty loop: "
          f"{statistics.median(rows['recheck private']) - statistics.median(rows['empty loop']):+.3f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
