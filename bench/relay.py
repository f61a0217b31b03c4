"""Benchmark: what a relay costs per token — a server behind NAT reached through the DHT node's relay, against the
same server reachable directly (network namespaces with latency, tests/netlab).

Run (root; tests/netlab builds the namespaces):
    .venv/bin/python bench/relay.py [--rtts 0,20] [--batches 1,8] [--tokens 24] [--reps 3] [--out results.json]

One lab: node 0 the client, node 1 the DHT node (`dht --relay`), node 2 a router with a machine behind its NAT
(MASQUERADE, nothing forwarded in), node 3 a machine anyone can dial; every node, the one behind NAT included,
delays its input by RTT/2, so each pair of machines is RTT apart and a relayed path (client - relay - server) is
two such legs. One server holds the whole tiny model (8 layers, hidden 256): "direct" on node 3, "relayed" behind
the NAT (`serve --use-relay`); each runs alone while measured, with a client process of its own (bench/wan.py's
client: a greedy generation of exactly --tokens new tokens per row, push on). Reported per (RTT, path, batch): the
median over reps of a run's median decode ms/token, and the relayed/direct ratio. Both paths must produce the same
tokens (checked every run).

The relay of this p2pd resets a relayed connection after 128 KiB each way (swarmnet/relays.py); the client then
dials a new one and resumes the session on the server, which kept it (`--session-grace`). Runs whose traffic crosses
that bound include that cost. The long-session case measures it alone: at RTT 0, one session of batch 4 and
--long-tokens new tokens (200: about 1.6 MB of steps to the server and 0.8 MB of answers, a dozen times what one
relayed connection carries), per path; reported are new tokens per second (rows x tokens / seconds from the first
step to the last token) and how often the client resumed the session (or failed over: replayed it).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LONG_BATCH = 4  # rows of the long session
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]


def start_server(lab: Any, node: Any, model: Path, peers: list[str], *extra: str) -> Any:
    from launch.processes import cli_command
    from launch.ready import SERVING_BLOCKS

    server = lab.run(node, cli_command("serve", str(model), "--blocks", "0:8", "--host", node.ip, "--num-threads", "1",
                                       *extra, "--initial-peers", *peers), name=f"server-{node.namespace}",
                     env={"OMP_NUM_THREADS": "1"})
    server.wait_for_line(SERVING_BLOCKS, timeout=180)
    return server


def measure(lab: Any, model: Path, peers: list[str], path: str, rtt: float, args: argparse.Namespace,
            inside: Any) -> list[dict[str, Any]]:
    """Start the path's server, run every batch --reps times through a fresh client, stop both."""
    from wan import Client

    server = (start_server(lab, inside, model, peers, "--use-relay") if path == "relayed"
              else start_server(lab, lab.nodes[3], model, peers))
    client = Client(lab, model, peers)
    rows = []
    try:
        client.run(push=True, batch=1, tokens=4)  # warm-up: route, session, first compute
        for rep in range(args.reps):
            for batch in args.batches:
                result = client.run(push=True, batch=batch, tokens=args.tokens)
                rows.append({"rtt": rtt, "path": path, "batch": batch, "rep": rep, **result})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)
            if rtt == 0 and args.long_tokens:
                result = client.run(push=True, batch=LONG_BATCH, tokens=args.long_tokens)
                rows.append({"rtt": rtt, "path": path, "batch": LONG_BATCH, "rep": rep, "long": True, **result})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)
    finally:
        client.close()
        server.terminate()
        lab.processes.remove(server)
    return rows


def bench(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    from netlab.lab import PUBLIC_SUBNET, NetLab

    from launch.processes import cli_command
    from modelprep import write_tiny_model

    model = write_tiny_model(work / "tiny-8L-256", layers=8, hidden_size=256, seed=1)
    rows: list[dict[str, Any]] = []
    for rtt in args.rtts:
        with NetLab(4, delay_ms=rtt / 2, subnet=PUBLIC_SUBNET, log_dir=work / f"rtt{rtt:g}") as lab:
            inside = lab.behind_nat(lab.nodes[2])
            dht = lab.run(lab.nodes[1], cli_command("dht", "--host", lab.nodes[1].ip, "--relay"), name="dht")
            peers = [dht.wait_for_line("/", timeout=60)]
            ping = lab.rtt_ms(lab.nodes[0], lab.nodes[3])
            for path in ("direct", "relayed"):
                for row in measure(lab, model, peers, path, rtt, args, inside):
                    rows.append({**row, "ping_ms": ping})
    return rows


def summarize(rows: list[dict[str, Any]]) -> str:
    """A table: RTT, batch, direct and relayed ms/token (median of the runs' medians), their ratio; then the long
    sessions' tokens/s and resumes."""
    return "\n\n".join(part for part in (summarize_short([r for r in rows if not r.get("long")]),
                                          summarize_long([r for r in rows if r.get("long")])) if part)


def summarize_long(rows: list[dict[str, Any]]) -> str:
    """Per path: the long session's new tokens/s (median over reps), resumes and failovers (each rep's)."""
    if not rows:
        return ""
    lines = ["| path | batch x new tokens | tokens/s | ms/token | resumed (per rep) | failed over (per rep) |",
             "|---|---|---|---|---|---|"]
    for path in ("direct", "relayed"):
        runs = [r for r in rows if r["path"] == path]
        rate = statistics.median(r["batch"] * len(r["tokens"][0]) / r["seconds"] for r in runs)
        lines.append(f"| {path} | {runs[0]['batch']} x {len(runs[0]['tokens'][0])} | {rate:.0f} | "
                     f"{statistics.median(r['ms_per_token'] for r in runs):.1f} | "
                     f"{', '.join(str(r['reattachments']) for r in runs)} | "
                     f"{', '.join(str(r['failovers']) for r in runs)} |")
    return "\n".join(lines)


def summarize_short(rows: list[dict[str, Any]]) -> str:
    """A table: RTT, batch, direct and relayed ms/token (median of the runs' medians), their ratio."""
    lines = ["| RTT ms (ping) | batch | direct ms/token | relayed ms/token | relayed / direct |", "|---|---|---|---|---|"]
    for rtt in sorted({r["rtt"] for r in rows}):
        for batch in sorted({r["batch"] for r in rows}):
            direct, relayed = (statistics.median(r["ms_per_token"] for r in rows if r["rtt"] == rtt
                                                 and r["batch"] == batch and r["path"] == path)
                               for path in ("direct", "relayed"))
            ping = next(r["ping_ms"] for r in rows if r["rtt"] == rtt)
            lines.append(f"| {rtt:g} ({ping:.1f}) | {batch} | {direct:.1f} | {relayed:.1f} | {relayed / direct:.2f} |")
    return "\n".join(lines)


def check_tokens(rows: list[dict[str, Any]]) -> None:
    """Direct and relayed generated the same tokens at every RTT and batch (and in the long sessions)."""
    for rtt in {r["rtt"] for r in rows}:
        for batch, long in {(r["batch"], bool(r.get("long"))) for r in rows}:
            outputs = {json.dumps(r["tokens"]) for r in rows if r["rtt"] == rtt and r["batch"] == batch
                       and bool(r.get("long")) == long}
            if len(outputs) != 1:
                raise SystemExit(f"direct and relayed generated different tokens at RTT {rtt} batch {batch}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":  # never: bench/wan.py runs the clients
        raise SystemExit("the client runs from bench/wan.py")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rtts", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 20.0])
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--long-tokens", type=int, default=200, help="new tokens of the long session (0: none)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-relay-"))
    rows = bench(args, work)  # on failure the logs stay in `work`
    shutil.rmtree(work)
    check_tokens(rows)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    print(summarize(rows))


if __name__ == "__main__":
    main()
