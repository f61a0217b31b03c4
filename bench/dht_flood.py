"""Benchmark: a server's decode step latency with and without a flood of DHT store requests from a stranger, same run.

A swarm of one server (all blocks; private by default, `--open` for an open one) and a member client in this
process. A stranger -- its own process (niced, as it would be another machine's load), with its own key and a plain
hivemind DHT node -- sends the server one store request after another, each answered before the next is sent. By
default each request is as large as p2pd carries (`--records 6300`: 3.9 MiB of records with the stranger's real
RSA-2048 key and garbage signatures); `--records 64` sends the most a node verifies per request instead (in an
open swarm each of those costs the server 64 RSA verifications).

The client runs decode steps under three conditions: quiet; the server flooded; and a control, a second stranger
flooding the swarm's DHT node instead -- the same load on this machine (the senders' CPU, the receiving p2pd's
decryption), none on the server's process or its p2pd. On a shared 2-core VM the flood's CPU alone slows every
process, whatever it targets; the control measures that part, the server condition adds what the server's own
handling costs. Each of `--rounds` rounds runs `--block` seconds of steps per condition (long enough to span whole
requests, from their transfer to their handling), in an order rotating round by round, so that other work on the
machine falls on all three alike. Prints per condition the median and p90 step, the
ratios, and how many requests landed while its steps ran.

usage: python bench/dht_flood.py [--model tiny|smollm2|PATH] [--rounds 20] [--block 0.5] [--records 6300] [--open]

The stranger's side runs as `python bench/dht_flood.py --sender INITIAL_PEER TARGET KEY_FILE RECORDS` and reads
"on" / "off" / "quit" on its stdin (tests/test_dht_flood.py uses `FloodSender` and `decode_steps` from here).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

RECORDS = 6300  # about 3.9 MiB of records: as much as one request through p2pd (4 MiB) carries
NICENESS = 10   # the stranger's process: its CPU is another machine's in a real attack


# ---- the stranger (its own process) --------------------------------------------------------------------------------
def flood_request(identity: Any, node_info: Any, records: int) -> Any:
    """A store request of `records` records under the stranger's own peer id, each carrying its real public key and a
    garbage signature, under as many keys."""
    import msgpack
    from hivemind.dht.routing import DHTID
    from hivemind.proto import dht_pb2
    from hivemind.utils import MSGPackSerializer, get_dht_time

    subkey = MSGPackSerializer.dumps(identity.peer_id)
    values = [msgpack.packb([b"value %d" % i, identity.public_key_der, b"\x01" * 256], use_bin_type=True)
              for i in range(records)]
    return dht_pb2.StoreRequest(keys=[DHTID.generate(source=f"flood.{i}").to_bytes() for i in range(records)],
                                subkeys=[subkey] * records, values=values,
                                expiration_time=[get_dht_time() + 60] * records, in_cache=[False] * records,
                                peer=node_info)


async def run_sender(initial_peer: str, target: str, key_file: str, records: int) -> None:
    """Join the DHT as a plain hivemind node, then flood `target` between "on" and "off" lines on stdin."""
    from hivemind.dht.node import DHTNode
    from hivemind.p2p import P2P, PeerID

    from swarmnet.identity import Identity

    identity = Identity.load_or_create(key_file)
    p2p = await P2P.create(initial_peers=[initial_peer], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                           identity_path=str(identity.path), check_if_identity_free=False)
    node = await DHTNode.create(p2p=p2p, initial_peers=[initial_peer])
    request = flood_request(identity, node.protocol.node_info, records)
    stub = node.protocol.get_stub(PeerID.from_base58(target))
    print(f"ready {request.ByteSize()}", flush=True)
    loop = asyncio.get_running_loop()
    flooding, idle = asyncio.Event(), asyncio.Event()
    idle.set()
    sent, failed, verdicts = 0, 0, set[int]()

    async def flood() -> None:
        nonlocal sent, failed
        while True:
            await flooding.wait()
            idle.clear()
            try:
                response = await stub.rpc_store(request, timeout=30)
                verdicts.add(len(response.store_ok))
                sent += 1
            except Exception:
                failed += 1
            finally:
                idle.set()

    task = asyncio.create_task(flood())
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if line == "on":
            before = sent
            flooding.set()
            while sent < before + 1 and not failed:  # the first request has landed: the flood is under way
                await asyncio.sleep(0.005)
            print(f"on {sent}", flush=True)
        elif line == "off":
            flooding.clear()
            await idle.wait()  # the request in flight was answered
            print(f"off {sent} {failed} {','.join(map(str, sorted(verdicts)))}", flush=True)
        else:
            break
    task.cancel()
    await node.shutdown()
    await p2p.shutdown()


class FloodSender:
    """The stranger's process, started niced in its own session; `set(True)` / `set(False)` start and stop the flood,
    `close()` ends it (and its p2pd) by its process group id."""

    def __init__(self, initial_peer: str, target: str, key_file: Path, records: int = RECORDS) -> None:
        command = [sys.executable, str(Path(__file__).resolve()), "--sender", initial_peer, target, str(key_file),
                   str(records)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True, preexec_fn=lambda: os.nice(NICENESS))
        self.request_bytes = int(self._expect("ready").split()[1])
        self.sent = self.failed = 0
        self.verdicts: list[int] = []

    def _expect(self, word: str) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith(word):
            raise RuntimeError(f"the flood sender said {line!r} (exit code {self.proc.poll()})")
        return line

    def _say(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def set(self, on: bool) -> None:
        """Start the flood (returns once its first request landed) or stop it (once the last one was answered)."""
        self._say("on" if on else "off")
        words = self._expect("on" if on else "off").split()
        self.sent = int(words[1])
        if not on:  # "off SENT FAILED VERDICTS": verdicts, the lengths of the answers' store_ok, comma-separated
            self.failed = int(words[2])
            self.verdicts = [int(n) for n in words[3].split(",")] if len(words) > 3 else []

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._say("quit")
                self.proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
        else:  # its p2pd is in its process group
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


# ---- the member client ---------------------------------------------------------------------------------------------
QUIET, SERVER, CONTROL = "quiet", "server", "control"  # the three conditions the steps run under


def decode_steps(model: Any, floods: dict[str, FloodSender], rounds: int, block_seconds: float,
                 max_steps: int = 120) -> dict[str, Any]:
    """Per decode step, its seconds under each condition: QUIET, and a flood by each sender of `floods` (SERVER: one
    aimed at the server the steps go through; CONTROL: one aimed at the DHT node, the same load on the machine and
    none on the server). Each round runs a block of steps per condition, in an order rotating round by round; a
    block lasts `block_seconds` (at most `max_steps` steps), long enough to span whole flood requests, from their
    transfer to their handling. Also the requests each flood landed while its steps ran, and the seconds they ran."""
    import torch

    conditions = [QUIET, *floods]
    times: dict[str, list[float]] = {name: [] for name in conditions}
    rounds_run: list[dict[str, list[float]]] = []
    seconds = dict.fromkeys(floods, 0.0)
    landed = dict.fromkeys(floods, 0)
    prompt = torch.tensor([[1, 2, 3, 4]])
    token = model.head.embed(torch.tensor([[5]]))
    for index in range(rounds):
        # a session per round: its length stays within the model's whatever the steps' speed
        with model.inference_session(batch_size=1, max_length=8 + len(conditions) * max_steps + 3) as session:
            session.step(model.head.embed(prompt), torch.ones_like(prompt), torch.arange(4)[None])
            length = 4

            def step() -> float:
                nonlocal length
                length += 1
                began = time.perf_counter()
                session.step(token, torch.ones(1, length, dtype=torch.long), torch.tensor([[length - 1]]))
                return time.perf_counter() - began

            def block() -> list[float]:
                taken: list[float] = []
                began = time.perf_counter()
                while time.perf_counter() - began < block_seconds and len(taken) < max_steps:
                    taken.append(step())
                return taken

            for _ in range(3):  # warm-up, untimed
                step()
            shift = index % len(conditions)
            this_round: dict[str, list[float]] = {}
            for name in conditions[shift:] + conditions[:shift]:
                if name == QUIET:
                    this_round[QUIET] = block()
                    continue
                sender = floods[name]
                sender.set(True)
                began, sent = time.perf_counter(), sender.sent
                this_round[name] = block()
                seconds[name] += time.perf_counter() - began
                sender.set(False)
                landed[name] += sender.sent - sent
        rounds_run.append(this_round)
        for name, taken in this_round.items():
            times[name].extend(taken)
    return {"times": times, "rounds": rounds_run, "seconds": seconds, "landed": landed,
            "failed": {name: sender.failed for name, sender in floods.items()},
            "verdicts": {name: sender.verdicts for name, sender in floods.items()}}


def flood_cost(sender: FloodSender, pid: int, seconds: float = 2.0) -> dict[str, float]:
    """What one flood request costs the process `pid` (a server, the DHT node) and its p2pd, in CPU ms: the sender
    floods it for `seconds` with no decode steps running, and the process's CPU time (its threads; its p2pd's
    separately) is divided by the requests that landed."""
    import psutil

    process = psutil.Process(pid)
    p2pd = [child for child in process.children(recursive=True) if child.name() == "p2pd"]

    def cpu() -> tuple[float, float]:
        return (sum(process.cpu_times()[:2]), sum(sum(child.cpu_times()[:2]) for child in p2pd))

    (python0, p2pd0), sent = cpu(), sender.sent
    sender.set(True)
    time.sleep(seconds)
    sender.set(False)
    python1, p2pd1 = cpu()
    requests = max(sender.sent - sent, 1)
    return {"requests": requests, "python_ms": (python1 - python0) / requests * 1e3,
            "p2pd_ms": (p2pd1 - p2pd0) / requests * 1e3}


def median(seconds: list[float]) -> float:
    return statistics.median(seconds)


def mean(seconds: list[float]) -> float:
    """The mean step: a block's seconds over its steps. Unlike the median it counts stalls: a server that holds its
    loop 0.4 s per request makes one step of each request wait and leaves the next few fast, and its median step
    barely moves while its steps per second fall several times."""
    return statistics.fmean(seconds)


def paired_ratio(result: dict[str, Any], name: str, *others: str, of: Callable[[list[float]], float] = median
                 ) -> float:
    """The median over rounds of: `name`'s median (or `of`) step in the round / the largest of `others`' in the same
    round. Pairing within a round (seconds apart) cancels what other work on the machine does over the run."""
    return median([of(r[name]) / max(of(r[other]) for other in others) for r in result["rounds"]])


def summary(seconds: list[float]) -> tuple[float, float, float]:
    """Median, p90 and mean, in ms."""
    return median(seconds) * 1e3, statistics.quantiles(seconds, n=10)[-1] * 1e3, mean(seconds) * 1e3


def report(result: dict[str, Any], request_bytes: int) -> str:
    """The figures, a line per condition."""
    times, lines = result["times"], []
    quiet = median(times[QUIET])
    for name, seconds in times.items():
        m, p90, average = summary(seconds)
        line = (f"{name:8} {len(seconds)} steps: median {m:.2f} ms, p90 {p90:.2f} ms, mean {average:.2f} ms, "
                f"median / quiet {m / 1e3 / quiet:.2f}")
        if name != QUIET:
            rate = result["landed"][name] / max(result["seconds"][name], 1e-9)
            line += (f"; {result['landed'][name]} requests of {request_bytes / 2**20:.2f} MiB landed meanwhile "
                     f"({rate:.1f}/s), {result['failed'][name]} failed, verdicts per answer {result['verdicts'][name]}")
        lines.append(line)
    if SERVER in times and CONTROL in times:
        for label, of in (("median", median), ("mean", mean)):
            lines.append(f"paired per round, {label} step (median of {len(result['rounds'])} rounds): server / quiet "
                         f"{paired_ratio(result, SERVER, QUIET, of=of):.2f}, control / quiet "
                         f"{paired_ratio(result, CONTROL, QUIET, of=of):.2f}, server / control "
                         f"{paired_ratio(result, SERVER, CONTROL, of=of):.2f}, server / max(quiet, control) "
                         f"{paired_ratio(result, SERVER, QUIET, CONTROL, of=of):.2f}")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--sender":
        initial_peer, target, key_file, records = sys.argv[2:6]
        asyncio.run(run_sender(initial_peer, target, key_file, int(records)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny (a 6-layer random model), smollm2 or a model dir")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=float, default=0.5, help="seconds of steps per condition and round")
    parser.add_argument("--records", type=int, default=RECORDS, help="records per store request")
    parser.add_argument("--open", action="store_true", help="an open swarm (no swarm file): records get verified")
    args = parser.parse_args()

    from jobrun import bench_setup  # bench/ is the script's folder, first on sys.path

    from launch.local_swarm import LocalSwarm
    from swarmclient.model import DistributedModelForCausalLM
    from swarmnet.model_spec import ModelSpec

    home, model_dir = bench_setup(args.model)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")
    blocks = ModelSpec.open(model_dir).num_blocks
    with LocalSwarm(model_dir, [(0, blocks)], log_dir=home / "swarm", private=not args.open) as swarm:
        dht = swarm.initial_peers[0]
        floods = {SERVER: FloodSender(dht, swarm.servers[0].peer_id, home / "stranger1.key", args.records),
                  CONTROL: FloodSender(dht, dht.rsplit("/p2p/", 1)[1], home / "stranger2.key", args.records)}
        try:
            with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                             access=None if args.open else swarm.access()) as model:
                result = decode_steps(model, floods, args.rounds, args.block)
            assert swarm.dht is not None
            costs = {SERVER: flood_cost(floods[SERVER], swarm.servers[0].pid),
                     CONTROL: flood_cost(floods[CONTROL], swarm.dht.pid)}
        finally:
            for sender in floods.values():
                sender.close()
    print(f"{'open' if args.open else 'private'} swarm, {args.model}, {args.records} records per request, "
          f"{args.rounds} rounds of {args.block:g} s of steps per condition")
    print(report(result, floods[SERVER].request_bytes))
    for name, who in ((SERVER, "the server"), (CONTROL, "the DHT node")):
        cost = costs[name]
        print(f"one request, flooding {who} alone for 2 s ({cost['requests']} requests): {cost['python_ms']:.1f} ms "
              f"of its Python process's CPU, {cost['p2pd_ms']:.1f} ms of its p2pd's")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
