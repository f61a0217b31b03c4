"""Benchmark: does a stable swarm of unpinned servers stop moving? Real processes, no membership change.

A DHT node and SERVERS servers with --num-blocks (default 6 x 10 of a 30-block tiny Llama: twice covered), all
started at once (so they all pick the same window and must spread out), checking coverage every --period seconds.
After --settle seconds, it counts the moves of the next --minutes minutes ('Moved blocks' lines in the servers'
logs): issue 31 asks for 0. It prints every move with its time and reason, the spans at the end, and the counts.

usage: python bench/rebalancing.py [--servers 6] [--blocks 10] [--layers 30] [--period 5] [--settle 60] [--minutes 10]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import datetime
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from launch.local_swarm import LocalSwarm  # noqa: E402
from launch.ready import SERVING_BLOCKS  # noqa: E402
from modelprep import write_tiny_model  # noqa: E402
from swarmclient.coverage import coverage_report  # noqa: E402
from swarmclient.swarm import Swarm  # noqa: E402
from swarmnet.model_spec import ModelSpec  # noqa: E402


def moves(swarm: LocalSwarm) -> list[tuple[float, str, str]]:
    """(wall-clock time, server, line) of every move logged so far."""
    found = []
    for path in swarm.log_dir.glob("server*.log"):
        for line in path.read_text().splitlines():
            if "Moved blocks" in line:
                found.append((datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp(), path.stem,
                              line.split("servers.server: ", 1)[-1]))
    return sorted(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=6)
    parser.add_argument("--blocks", type=int, default=10, help="--num-blocks of each server")
    parser.add_argument("--layers", type=int, default=30, help="blocks of the tiny model")
    parser.add_argument("--period", type=float, default=5.0, help="--rebalance-period and --announce-period")
    parser.add_argument("--settle", type=float, default=60.0, help="seconds after start whose moves do not count")
    parser.add_argument("--minutes", type=float, default=10.0, help="minutes of stable membership watched")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="swarmbatch-rebalancing-"))
    model = write_tiny_model(root / "model", layers=args.layers, seed=0)
    server_args = ["--announce-period", str(args.period), "--rebalance-period", str(args.period),
                   "--move-drain-seconds", "5"]
    with LocalSwarm(model, [], log_dir=root / "logs", server_args=server_args) as swarm:
        started = [swarm.start_unpinned(args.blocks, wait=False) for _ in range(args.servers)]
        for server in started:
            server.wait_for_line(SERVING_BLOCKS, timeout=swarm.ready_timeout)
        began = time.time()
        print(f"{args.servers} servers online; logs in {swarm.log_dir}", flush=True)
        time.sleep(args.settle + args.minutes * 60)
        spec = ModelSpec.open(model)
        client = Swarm.connect(swarm.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks)
        try:
            report = coverage_report(spec.model_id, client.loop.run(client.block_infos(refresh=True)))
        finally:
            client.close()
        logged = moves(swarm)  # before the servers stop: those left then would move into the holes
    for at, server, line in logged:
        print(f"{at - began:+8.1f} s  {server}: {line}")
    for entry in report["servers"]:
        print(f"{entry['peer_id'][-6:]}  {entry['start']}:{entry['end']} {entry['state']}")
    late = [m for m in logged if m[0] - began > args.settle]
    print(f"moves to settle: {len(logged) - len(late)}; moves in the {args.minutes:g} minutes after: {len(late)}; "
          f"bottleneck {report['bottleneck']['throughput']:.0f} steps/s, missing {report['missing']}")


if __name__ == "__main__":
    main()
