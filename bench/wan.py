"""Benchmark: a swarm across machines (network namespaces with latency, tests/netlab), push on vs off.

Run (root; tests/netlab builds the namespaces):
    .venv/bin/python bench/wan.py [--models tiny,smollm2] [--servers 2,3] [--rtts 0,20,50] [--batches 1,8]
                                  [--tokens 24] [--reps 3] [--out results.json]

For each model and server count it builds one lab: node 0 holds the DHT and the client, nodes 1..N one server each
(the model's blocks split evenly), every node delaying its input by RTT/2 (so every pair of nodes is RTT apart;
`ping -U` measures it). The client (this script with --client, inside node 0) holds two models, push on and push
off, and runs what the orchestrator asks: a greedy generation of exactly --tokens new tokens per row, batch 1 or 8.
Reps are interleaved: each rep walks the RTTs (rotating the order), and at each RTT push on and off, batch 1 and 8.
Reported per (model, servers, RTT, push, batch): the median over reps of the median decode ms/token of a run;
the floor of push, (hops + 1) / 2 x RTT + the push-on ms/token at RTT 0 (compute and local overheads); and the
bytes each link carried per position (prompt prefill included, both directions, IP headers included), from
iptables counters in each node. Push on and off must produce identical tokens (checked every run).

"tiny" is `modelprep.write_tiny_model(layers=8, hidden_size=256)` (`swarmbatch model tiny --layers 8`, at hidden
256); "smollm2" the real SmolLM2-135M-Instruct (30 layers, hidden 576), prepared under ~/.swarmbatch/models.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

PROMPTS = ["Hello world, this is", "A", "The quick brown fox jumps over the lazy dog and then", "one two three",
           "Once upon a time", "In the beginning", "Summarize: the bakery on Main Street", "List three uses of"]


# ---- the client, inside node 0 -------------------------------------------------------------------------------------
def client_main(model_dir: Path, initial_peers: list[str]) -> None:
    """Answer one JSON line per request line {"push", "batch", "tokens"} on stdin until EOF."""
    import torch

    from swarmclient.config import ClientConfig
    from swarmclient.generation import generate_tokens
    from swarmclient.model import DistributedModelForCausalLM
    from swarmclient.textgen import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(model_dir)
    models = {push: DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=initial_peers,
                                                                config=ClientConfig(push=push)) for push in (True, False)}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        model = models[request["push"]]
        batch = tokenizer(PROMPTS[:request["batch"]], return_tensors="pt", padding=True)
        stamps: list[float] = []
        prompt = batch.input_ids.shape[1]
        with model.inference_session(batch_size=request["batch"], max_length=prompt + request["tokens"] + 1) as session:
            began = time.perf_counter()
            tokens = generate_tokens(model.head, session.step, batch.input_ids, batch.attention_mask,
                                     max_new_tokens=request["tokens"],
                                     params=model.sampling_params(request["batch"], False, 1.0, 1.0, 0),
                                     eos_token_ids=set(), pad_token_id=model.pad_token_id,
                                     on_token=lambda index, _: stamps.append(time.perf_counter()))  # noqa: B023
            hops = len(session.route)
        gaps = [(b - a) * 1000 for a, b in zip(stamps, stamps[1:], strict=False)]
        print(json.dumps({"ms_per_token": statistics.median(gaps), "prefill_ms": (stamps[0] - began) * 1000,
                          "hops": hops, "positions": prompt + request["tokens"], "tokens": tokens.tolist()}), flush=True)
    for model in models.values():
        model.close()


# ---- the orchestrator ----------------------------------------------------------------------------------------------
def model_dir(name: str, work: Path) -> Path:
    if name == "tiny":
        from modelprep import write_tiny_model
        return write_tiny_model(work / "tiny-8L-256", layers=8, hidden_size=256, seed=1)
    from modelprep import prepare_model
    return prepare_model(name, cache_dir=Path.home() / ".swarmbatch" / "models")


def spans(num_blocks: int, servers: int) -> list[tuple[int, int]]:
    bounds = [round(i * num_blocks / servers) for i in range(servers + 1)]
    return list(zip(bounds, bounds[1:], strict=False))


class Client:
    """The client process in node 0, driven over its stdin/stdout."""

    def __init__(self, lab: Any, model: Path, peers: list[str]) -> None:
        args = ["ip", "netns", "exec", lab.nodes[0].namespace, sys.executable, __file__, "--client", str(model),
                "--initial-peers", *peers]
        self.log = open(lab.log_dir / "client.log", "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the client exited; see {self.log.name}")
        return json.loads(line)  # type: ignore[no-any-return]

    def run(self, **request: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


def link_bytes(before: dict[tuple[int, int], int], after: dict[tuple[int, int], int]) -> dict[str, int]:
    """Bytes per link (both directions) between two traffic readings: 'c-s1', 's1-s2', ..."""
    name = lambda i: "c" if i == 0 else f"s{i}"  # noqa: E731
    links: dict[str, int] = {}
    for (src, dst), value in after.items():
        key = "-".join(name(i) for i in sorted((src, dst)))
        links[key] = links.get(key, 0) + value - before.get((src, dst), 0)
    return {k: v for k, v in sorted(links.items()) if v > 0}


def bench_lab(name: str, model: Path, servers: int, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    from netlab.lab import NetLab, start_dht, start_servers

    from swarmclient.model_spec import ModelSpec

    num_blocks = ModelSpec.open(model).num_blocks
    rows: list[dict[str, Any]] = []
    with NetLab(servers + 1, log_dir=work / f"{name}-{servers}") as lab:
        peers = start_dht(lab, lab.nodes[0])
        start_servers(lab, model, peers, [(lab.nodes[i + 1], a, b, ()) for i, (a, b) in enumerate(spans(num_blocks, servers))])
        client = Client(lab, model, peers)
        try:
            client.run(push=True, batch=1, tokens=4)  # warm-up: routes, sessions, first compute
            measured_rtt: dict[int, float] = {}
            for rep in range(args.reps):
                rtts = args.rtts[rep % len(args.rtts):] + args.rtts[:rep % len(args.rtts)]
                for rtt in rtts:
                    for node in lab.nodes:
                        lab.set_delay(node, rtt / 2)
                    if rtt not in measured_rtt:
                        measured_rtt[rtt] = lab.rtt_ms(lab.nodes[1], lab.nodes[servers])
                    for batch in args.batches:
                        outputs = {}
                        for push in ((True, False) if rep % 2 == 0 else (False, True)):
                            before = lab.traffic()
                            result = client.run(push=push, batch=batch, tokens=args.tokens)
                            links = link_bytes(before, lab.traffic())
                            outputs[push] = result.pop("tokens")
                            rows.append({"model": name, "servers": servers, "rtt": rtt, "ping_ms": measured_rtt[rtt],
                                         "push": push, "batch": batch, "rep": rep, **result,
                                         "bytes_per_position": {k: v / result["positions"] for k, v in links.items()}})
                            print(json.dumps(rows[-1]), flush=True)
                        if outputs[True] != outputs[False]:
                            raise SystemExit(f"push on and off generated different tokens: {name} {servers} servers "
                                             f"RTT {rtt} batch {batch}")
        finally:
            client.close()
    return rows


def summarize(rows: list[dict[str, Any]]) -> str:
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["servers"], row["rtt"], row["batch"], row["push"]), []).append(row)
    median = {key: statistics.median(r["ms_per_token"] for r in group) for key, group in groups.items()}
    lines = ["| model | servers | RTT (ping -U) | batch | push on ms/token | off ms/token | off / on | floor (push) | "
             "on / floor | bytes/position per link (push on) | (push off) |", "|" + " --- |" * 11]
    for (model, servers, rtt, batch, push), value in sorted(median.items()):
        if not push:
            continue
        off = median[(model, servers, rtt, batch, False)]
        compute = median.get((model, servers, 0, batch, True))
        floor = None if compute is None else (servers + 1) / 2 * rtt + compute
        ping = groups[(model, servers, rtt, batch, True)][0]["ping_ms"]
        per_link = {push_: groups[(model, servers, rtt, batch, push_)][-1]["bytes_per_position"] for push_ in (True, False)}
        show = lambda links: ", ".join(f"{k} {v / 1000:.1f} kB" for k, v in links.items())  # noqa: E731
        lines.append(f"| {model} | {servers} | {rtt} ({ping:.1f}) | {batch} | {value:.1f} | {off:.1f} | {off / value:.2f} | "
                     f"{'' if floor is None else f'{floor:.1f}'} | {'' if floor is None else f'{value / floor:.2f}'} | "
                     f"{show(per_link[True])} | {show(per_link[False])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--servers", default="2,3")
    parser.add_argument("--rtts", default="0,20,50")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.client:
        client_main(args.client, args.initial_peers)
        return
    from netlab.lab import unavailable

    if (reason := unavailable()) is not None:
        raise SystemExit(f"bench/wan.py needs network namespaces: {reason}")
    args.rtts = [int(x) for x in args.rtts.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    work = Path(tempfile.mkdtemp(prefix="swarmbatch-wan-"))
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        model = model_dir(name, work)
        for servers in (int(x) for x in args.servers.split(",")):
            rows += bench_lab(name, model, servers, args, work)
            if args.out:
                args.out.write_text(json.dumps(rows, indent=1))
    print(summarize(rows))


if __name__ == "__main__":
    main()
