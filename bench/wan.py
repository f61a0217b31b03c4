"""Benchmark: a swarm across machines (network namespaces with latency, tests/netlab), push on vs off.

Run (root; tests/netlab builds the namespaces):
    .venv/bin/python bench/wan.py [--models tiny,smollm2] [--servers 2,3] [--rtts 0,20,50] [--batches 1,8]
                                  [--tokens 24] [--reps 3] [--out results.json]
    .venv/bin/python bench/wan.py --job [--models smollm2] [--servers 2] [--rtts 0,0q,50] [--reps 2]

For each model and server count it builds one lab: node 0 holds the DHT and the client, nodes 1..N one server each
(the model's blocks split evenly), every node delaying its input by RTT/2 (so every pair of nodes is RTT apart;
`ping -U` measures it). The client (this script with --client, inside node 0) holds two models, push on and push
off, and runs what the orchestrator asks: a greedy generation of exactly --tokens new tokens per row, batch 1 or 8,
push on, push off, or the ring (push on, and the last server, started with --ring, guesses each next step and pushes
it to the first: servers/ring.py; --no-ring skips it). Reps are interleaved: each rep walks the RTTs (rotating the
order), and at each RTT the modes (rotating), batch 1 and 8.
Reported per (model, servers, RTT, push, batch): the median over reps of the median decode ms/token of a run;
the floor of push, (hops + 1) / 2 x RTT + the push-on ms/token at RTT 0 (compute and local overheads); and the
bytes each link carried per position (prompt prefill included, both directions, IP headers included), from
iptables counters in each node; the ring's ms/token against the same floor. Every mode must produce identical tokens
(checked every run).

With --job it measures instead what the RTT costs a batch job: the `bench/throughput.py` job (64 requests x 64 new
tokens, mixed prompt lengths) run by the worker's own code path with default settings (the worker sizes its claim and
lanes, jobs/worker/sizing.py; push on) in node 0, at each RTT in turn, interleaved over reps; reported: tokens/s per
RTT, its ratio to RTT 0, and the plan (claim, lanes) the worker chose at each RTT. The delay programs run on the
same 2 cores as the servers and the worker (separate machines would not pay them), so the CPU they take is reported
per run, and "0q" runs the job at 0 ms with every packet still passing through them: the emulation's cost without
the latency, the control that isolates what the RTT itself costs.

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
import shlex  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

PROMPTS = ["Hello world, this is", "A", "The quick brown fox jumps over the lazy dog and then", "one two three",
           "Once upon a time", "In the beginning", "Summarize: the bakery on Main Street", "List three uses of"]


# ---- the client, inside node 0 -------------------------------------------------------------------------------------
def client_main(model_dir: Path, initial_peers: list[str]) -> None:
    """Answer one JSON line per request line {"push", "batch", "tokens"} on stdin until EOF."""
    import torch
    from swarm import StepClock  # bench/swarm.py: times each step of a session

    from swarmclient.config import ClientConfig
    from swarmclient.generation import generate_tokens
    from swarmclient.model import DistributedModelForCausalLM
    from swarmclient.textgen import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(model_dir)
    models = {push: DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=initial_peers,
                                                                config=ClientConfig(push=push)) for push in (True, False)}
    hop_times = {push: observe_hops(model.swarm) for push, model in models.items()}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        model = models[request["push"]]
        batch = tokenizer(PROMPTS[:request["batch"]], return_tensors="pt", padding=True)
        stamps: list[float] = []
        prompt = batch.input_ids.shape[1]
        ring = request.get("ring", False)  # push on, and the last server guesses each next step (servers/ring.py)
        with model.inference_session(batch_size=request["batch"], max_length=prompt + request["tokens"] + 1,
                                     ring=ring) as session:
            step, hop_ms = StepClock(session), hop_times[request["push"]]
            hop_ms.clear()
            began = time.perf_counter()
            tokens = generate_tokens(model.head, step, batch.input_ids, batch.attention_mask,
                                     max_new_tokens=request["tokens"],
                                     params=model.sampling_params(request["batch"], False, 1.0, 1.0, 0),
                                     eos_token_ids=set(), pad_token_id=model.pad_token_id,
                                     on_token=lambda index, _: stamps.append(time.perf_counter()),  # noqa: B023
                                     feed_argmax=ring)
            hops, guessed = len(session.route), session.guessed_steps
        gaps = [(b - a) * 1000 for a, b in zip(stamps, stamps[1:], strict=False)]
        print(json.dumps({"ms_per_token": statistics.median(gaps), "prefill_ms": (stamps[0] - began) * 1000,
                          "seconds": stamps[-1] - began, "hops": hops, "positions": prompt + request["tokens"],
                          "reattachments": session.reattachments, "failovers": session.failovers, "guessed": guessed,
                          "step_ms": statistics.median(step.wall[1:] or [0.0]) * 1000,  # decode steps
                          "hop_ms": [round(statistics.median(times), 2) for times in hop_ms.values()],
                          "tokens": tokens.tolist()}), flush=True)
    for model in models.values():
        model.close()


def observe_hops(swarm: Any) -> dict[str, list[float]]:
    """ms of each hop of each decode step, by peer id, as the session reports them (`Swarm.observe_step`: from sending
    the step to the first hop's answer, then from each answer to the next: answers travel separately)."""
    hops: dict[str, list[float]] = {}
    report = swarm.observe_step

    def observe(peer_id: str, num_blocks: int, seconds: float) -> None:
        hops.setdefault(peer_id, []).append(seconds * 1000)
        report(peer_id, num_blocks, seconds)
    swarm.observe_step = observe
    return hops


def job_client_main(model_dir: Path, initial_peers: list[str], requests: int, max_tokens: int, configs: str) -> None:
    """Run the throughput job once per line on stdin ({"config": label}: default settings, or a CLAIMxLANES of
    `configs`; one store each); answer one JSON line each."""
    import logging

    from jobrun import run_job
    from throughput import batch_file, job_runtime, prompts

    from jobs.worker.job_worker import logger as worker_logger

    plans: list[str] = []

    class PlanLog(logging.Handler):  # the worker logs each batch's plan: "Job <id>: claim 24 in 4 lanes (...)"
        def emit(self, record: logging.LogRecord) -> None:
            if " lanes (" in record.getMessage():
                plans.append(record.getMessage().split(": ", 1)[1])

    worker_logger.addHandler(PlanLog())
    worker_logger.setLevel(logging.INFO)
    texts = prompts(requests)
    data = batch_file(texts, max_tokens)
    home = Path(tempfile.mkdtemp(prefix="swarmbatch-wan-job-"))
    runtimes = {label: job_runtime(home, label, initial_peers, argparse.Namespace(batch_size=None), options,
                                   model_dir, texts) for label, options in job_configs(configs).items()}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        plans.clear()
        runtime = runtimes[json.loads(line)["config"]]
        # the RTT just changed: measure it again now, as a worker that has run at this RTT for a minute would have
        runtime.swarm_model(str(model_dir)).swarm.pinged_at.clear()
        seconds, tokens, outputs = run_job(runtime, str(model_dir), data)
        print(json.dumps({"seconds": seconds, "tokens": tokens, "plans": sorted(set(plans)),
                          "outputs": json.dumps(outputs, sort_keys=True)}), flush=True)
    for runtime in runtimes.values():
        runtime.close()


def job_configs(configs: str) -> dict[str, dict[str, object]]:
    """{label: worker settings}: "defaults" (the worker sizes its batch), then each CLAIMxLANES of `configs`."""
    from throughput import tuned_configs

    return {"defaults": {}, **tuned_configs(configs)}


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
    """The client process in node 0, driven over its stdin/stdout (`mode`: --client or --job-client)."""

    def __init__(self, lab: Any, model: Path, peers: list[str], mode: str = "--client", *extra: str) -> None:
        args = ["ip", "netns", "exec", lab.nodes[0].namespace, sys.executable, __file__, mode, str(model),
                *extra, "--initial-peers", *peers]
        self.log = open(lab.log_dir / "client.log", "ab")  # closed in close()
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

    from swarmnet.model_spec import ModelSpec

    num_blocks = ModelSpec.open(model).num_blocks
    rows: list[dict[str, Any]] = []
    with NetLab(servers + 1, log_dir=work / f"{name}-{servers}") as lab:
        peers = start_dht(lab, lab.nodes[0])
        extra = ("--ring",) if args.ring else ()  # the last server holds the head: only ring requests use it
        start_servers(lab, model, peers, [(lab.nodes[i + 1], a, b, extra)
                                          for i, (a, b) in enumerate(spans(num_blocks, servers))])
        client = Client(lab, model, peers)
        modes = [(True, False), (False, False)] + ([(True, True)] if args.ring else [])  # (push, ring)
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
                        for push, ring in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                            before = lab.traffic()
                            result = client.run(push=push, ring=ring, batch=batch, tokens=args.tokens)
                            links = link_bytes(before, lab.traffic())
                            outputs[push, ring] = result.pop("tokens")
                            rows.append({"model": name, "servers": servers, "rtt": rtt, "ping_ms": measured_rtt[rtt],
                                         "push": push, "ring": ring, "batch": batch, "rep": rep, **result,
                                         "bytes_per_position": {k: v / result["positions"] for k, v in links.items()}})
                            print(json.dumps(rows[-1]), flush=True)
                        if len({json.dumps(tokens) for tokens in outputs.values()}) != 1:
                            raise SystemExit(f"push on, off and the ring generated different tokens: {name} {servers} "
                                             f"servers RTT {rtt} batch {batch}")
        finally:
            client.close()
    return rows


def bench_job_lab(name: str, model: Path, servers: int, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """The throughput job at each RTT in turn (rotated per rep), in one lab; one row per run."""
    from netlab.lab import NetLab, start_dht, start_servers

    from swarmnet.model_spec import ModelSpec

    num_blocks = ModelSpec.open(model).num_blocks
    rows: list[dict[str, Any]] = []
    with NetLab(servers + 1, log_dir=work / f"job-{name}-{servers}") as lab:
        peers = start_dht(lab, lab.nodes[0])
        extra = tuple(shlex.split(args.server_args))
        start_servers(lab, model, peers, [(lab.nodes[i + 1], a, b, extra)
                                          for i, (a, b) in enumerate(spans(num_blocks, servers))])
        client = Client(lab, model, peers, "--job-client", "--requests", str(args.requests),
                        "--tokens", str(args.tokens), "--configs", args.configs)
        try:
            outputs: set[str] = set()
            for rep in range(args.reps):
                for rtt in args.rtts[rep % len(args.rtts):] + args.rtts[:rep % len(args.rtts)]:
                    for node in lab.nodes:  # "0q": 0 ms, but through the delay programs (their CPU cost alone)
                        lab.set_delay(node, float(rtt.rstrip("q")) / 2, queued=rtt.endswith("q"))
                    ping = lab.rtt_ms(lab.nodes[0], lab.nodes[1])
                    for config in job_configs(args.configs):
                        emulation, cpu = lab.delay_cpu_seconds(), cpu_ticks()
                        result = client.run(config=config)
                        outputs.add(result.pop("outputs"))
                        rows.append({"model": name, "servers": servers, "rtt": rtt, "config": config, "ping_ms": ping,
                                     "rep": rep, **result, "tokens_per_s": result["tokens"] / result["seconds"],
                                     "delay_cpu_s": lab.delay_cpu_seconds() - emulation, "cpu_busy": busy_since(cpu)})
                        print(json.dumps(rows[-1]), flush=True)
            if len(outputs) != 1:
                raise SystemExit(f"the job's greedy outputs differ between RTTs: {name} {servers} servers")
        finally:
            client.close()
    return rows


def cpu_ticks() -> tuple[int, int]:
    """(busy, all) jiffies of the whole machine so far, from /proc/stat (idle and iowait count as not busy)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def busy_since(before: tuple[int, int]) -> float:
    """The share of the machine's cores that were busy since `before` (a `cpu_ticks()` reading)."""
    busy, total = cpu_ticks()
    return (busy - before[0]) / max(1, total - before[1])


def summarize_jobs(rows: list[dict[str, Any]]) -> str:
    """Per (model, servers, config, RTT): the best run's tokens/s, its ratio to the same config's best at RTT 0 (and
    at "0q": 0 ms through the delay programs), the CPU the delay programs took, the plans chosen."""
    best: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        key = (row["model"], row["servers"], row["config"], row["rtt"])
        if key not in best or row["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = row
    lines = ["| model | servers | config | RTT (ping -U) | seconds | tokens | tokens/s | vs RTT 0 | vs 0q | "
             "delay programs' CPU | CPU busy | plans chosen (all runs) |", "|" + " --- |" * 12]
    for key, row in sorted(best.items(), key=lambda item: (*item[0][:3], rtt_order(item[0][3]))):
        model, servers, config, rtt = key
        zero, queued = best.get((model, servers, config, "0")), best.get((model, servers, config, "0q"))
        plans = sorted({p for r in rows if (r["model"], r["servers"], r["config"], r["rtt"]) == key for p in r["plans"]})
        ratios = ["" if base is None else f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}" for base in (zero, queued)]
        lines.append(f"| {model} | {servers} | {config} | {rtt} ({row['ping_ms']:.1f}) | {row['seconds']:.1f} | "
                     f"{row['tokens']} | {row['tokens_per_s']:.1f} | {' | '.join(ratios)} | {row['delay_cpu_s']:.1f} s "
                     f"({row['delay_cpu_s'] / row['seconds'] * 100:.0f}% of a core) | {row['cpu_busy'] * 100:.0f}% | "
                     f"{'; '.join(plans)} |")
    return "\n".join(lines)


def rtt_order(rtt: str) -> tuple[float, bool]:
    """"0" < "0q" < "20" < "50"."""
    return float(rtt.rstrip("q")), rtt.endswith("q")


def summarize(rows: list[dict[str, Any]]) -> str:
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        if not row.get("ring"):
            groups.setdefault((row["model"], row["servers"], row["rtt"], row["batch"], row["push"]), []).append(row)
    median = {key: statistics.median(r["ms_per_token"] for r in group) for key, group in groups.items()}
    ring = {(r["model"], r["servers"], r["rtt"], r["batch"]): r for r in rows if r.get("ring")}
    lines = ["| model | servers | RTT (ping -U) | batch | push on ms/token | off ms/token | off / on | floor (push) | "
             "on / floor | ring ms/token | ring / floor | bytes/position per link (push on) | (push off) |",
             "|" + " --- |" * 13]
    for (model, servers, rtt, batch, push), value in sorted(median.items()):
        if not push:
            continue
        off = median[(model, servers, rtt, batch, False)]
        ringed = statistics.median(r["ms_per_token"] for r in rows if r.get("ring") and
                                   (r["model"], r["servers"], r["rtt"], r["batch"]) == (model, servers, rtt, batch)) \
            if (model, servers, rtt, batch) in ring else None
        compute = median.get((model, servers, 0, batch, True))
        floor = None if compute is None else (servers + 1) / 2 * rtt + compute
        ping = groups[(model, servers, rtt, batch, True)][0]["ping_ms"]
        per_link = {push_: groups[(model, servers, rtt, batch, push_)][-1]["bytes_per_position"] for push_ in (True, False)}
        show = lambda links: ", ".join(f"{k} {v / 1000:.1f} kB" for k, v in links.items())  # noqa: E731
        lines.append(f"| {model} | {servers} | {rtt} ({ping:.1f}) | {batch} | {value:.1f} | {off:.1f} | {off / value:.2f} | "
                     f"{'' if floor is None else f'{floor:.1f}'} | {'' if floor is None else f'{value / floor:.2f}'} | "
                     f"{'' if ringed is None else f'{ringed:.1f}'} | "
                     f"{'' if ringed is None or floor is None else f'{ringed / floor:.2f}'} | "
                     f"{show(per_link[True])} | {show(per_link[False])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--job-client", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--job", action="store_true", help="the throughput job at each RTT instead of generations")
    parser.add_argument("--requests", type=int, default=64, help="requests of the --job job")
    parser.add_argument("--configs", default="", help="--job: tuned settings run beside the defaults at each RTT, "
                                                     "CLAIMxLANES,... (e.g. 64x4,64x2)")
    parser.add_argument("--server-args", default="", help="--job: more `swarmbatch serve` options for every server, "
                                                         "e.g. --server-args='--no-lend-idle-cache --batch-wait-ms 0' "
                                                         "(with '=': the value starts with --)")
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--models", default=None, help="default tiny,smollm2 (--job: smollm2)")
    parser.add_argument("--servers", default=None, help="default 2,3 (--job: 2)")
    parser.add_argument("--rtts", default=None, help="default 0,20,50 (--job: 0,0q,50; 0q = 0 ms through the delay "
                                                       "programs)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--no-ring", dest="ring", action="store_false",
                        help="skip the ring runs (push on, the last server started with --ring guessing each next "
                             "step: servers/ring.py)")
    parser.add_argument("--tokens", type=int, default=None, help="new tokens per row (default 24; --job: 64)")
    parser.add_argument("--reps", type=int, default=None, help="default 3 (--job: 2)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.client:
        client_main(args.client, args.initial_peers)
        return
    if args.job_client:
        job_client_main(args.job_client, args.initial_peers, args.requests, args.tokens, args.configs)
        return
    defaults = dict(models="smollm2", servers="2", rtts="0,0q,50", tokens=64, reps=2) if args.job else dict(
        models="tiny,smollm2", servers="2,3", rtts="0,20,50", tokens=24, reps=3)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    from netlab.lab import unavailable

    if (reason := unavailable()) is not None:
        raise SystemExit(f"bench/wan.py needs network namespaces: {reason}")
    args.rtts = args.rtts.split(",") if args.job else [int(x) for x in args.rtts.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    work = Path(tempfile.mkdtemp(prefix="swarmbatch-wan-"))
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        model = model_dir(name, work)
        for servers in (int(x) for x in args.servers.split(",")):
            rows += (bench_job_lab if args.job else bench_lab)(name, model, servers, args, work)
            if args.out:
                args.out.write_text(json.dumps(rows, indent=1))
    print(summarize_jobs(rows) if args.job else summarize(rows))


if __name__ == "__main__":
    main()
