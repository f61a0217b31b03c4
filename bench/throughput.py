"""Benchmark: batch-job throughput with pipelining, server-side batching and continuous batching, on and off.

A 64-request job (SmolLM2, 64 new tokens each, mixed prompt lengths) runs through 2 block servers, each
process pinned to one core with one torch thread, by the worker's own code path (JobWorker.process: claim,
generate, checkpoint, finish; in this process, without Celery). In the same run it measures:
  (a) local transformers `generate`, batch 64, 2 threads (the speed limit on this machine);
  (b) the job with the features off: one session per batch, finished rows ride along, no merging;
  (c) the job with the features on: `--lanes` micro-batches in flight, finished rows leave at once and
      pending requests take their slots, servers merge concurrent sessions' decode steps.
Tokens are the real generated tokens (up to each row's EOS).

With --sweep it measures what the worker's own sizing is worth instead: the job with default settings (the worker
sizes its claim and lanes from what the servers announce, jobs/worker/sizing.py) against every tuned setting of a
small sweep (claim 8/16/32/64 x lanes 2/4/8), and the defaults with 2 workers (own swarm clients) on the same job;
the target is defaults >= 0.9x the best tuned setting. Local generate is skipped.

With --verify-fractions 0.02,0.1 it measures the cost of checked outputs instead: 4 servers, two holders of each
half (so a second server can recompute any hop step), the job with the features on and no checks, then with each
fraction of hop steps checked (SWARMBATCH_VERIFY_FRACTION), interleaved in the same run; local generate is skipped.
--checkpoint-every K sets the jobs' checkpoint window (8 by default, as a job's): checks compare a window's positions
and recompute the sampled rows' history for it, so their cost per token falls as K grows.

With --user-path it measures the job as a user runs it against local generate (issue 30's first target): the job
with default settings (no claim or lanes set: the worker sizes them) through 2 servers that are not pinned to cores
(as `launch.local_swarm.LocalSwarm` starts them for the demo), and local generate of the same prompts (batch 64,
2 threads), interleaved over reps (the order alternating); the target is job >= 0.9x local. The job runs the
worker's code in this process. With --cli-path a `swarmbatch worker` process runs it instead (Celery on the embedded
broker, as a user starts it after `swarmbatch submit`), timed from its submission to its last line.
--baseline-settings KEY=VALUE,... (e.g. prefill_chunk_tokens=0) also runs the job with those worker settings,
interleaved with the others (with --cli-path, by a second `swarmbatch worker`), and gives the default job's ratio to it.

With --machines it measures what spreading lanes over machines is worth (swarmclient/routing.py, `machine_loads`): two
servers each holding every block, each pinned to its own core with one thread (a machine of one core), announced as
two machines (`serve --machine`), against the same two servers announced as one machine (so all lanes take one
server, as every client did before), the job with `--lanes` lanes; a fresh swarm per run, the order alternating
over reps. Each run also gives each server's decode steps.

--out FILE writes every run, the best run per config and the mode's ratios as JSON (bench/perf.py reads it).

usage: python bench/throughput.py [--model smollm2|PATH] [--requests 64] [--max-tokens 64] [--lanes 4]
       [--batch-size 64] [--reps 1] [--sweep] [--verify-fractions 0.02,0.1 [--checkpoint-every 8]]
       [--user-path | --cli-path [--baseline-settings KEY=VALUE,...] | --machines] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from jobrun import bench_setup, job_bench_parser, run_job  # noqa: E402  (bench/ is the script's folder, first on sys.path)

from jobs.assembly import build_runtime  # noqa: E402
from jobs.migrate import upgrade  # noqa: E402
from jobs.runtime import Runtime  # noqa: E402
from jobs.settings import Settings  # noqa: E402
from jobs.store import job_counts  # noqa: E402
from jobs.submission import submit_batch  # noqa: E402
from launch.embedded import worker_settings  # noqa: E402
from launch.local_swarm import LocalSwarm  # noqa: E402
from launch.local_worker import require_running, start_local_worker  # noqa: E402
from swarmclient.swarm import Swarm  # noqa: E402
from swarmnet.model_spec import ModelSpec  # noqa: E402

LOCAL = "local transformers generate, whole batch, 2 threads"
TOPICS = ["a lighthouse", "a robot", "the river", "a bakery", "winter", "a train", "the moon", "a library"]


def prompts(count: int) -> list[str]:
    """Mixed lengths: 0 to 7 extra sentences of context before the question."""
    context = "The town council met on Tuesday to discuss the new bike lanes and the library's opening hours. "
    return [context * (i % 8) + f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i})."
            for i in range(count)]


def batch_file(texts: list[str], max_tokens: int) -> bytes:
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                                  "temperature": 0}})
             for i, text in enumerate(texts)]
    return ("\n".join(lines) + "\n").encode()


def run_local(model_dir: Path, texts: list[str], max_tokens: int) -> tuple[float, int]:
    """(seconds, generated tokens) of transformers generate on the whole batch, 2 threads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
             for t in texts]
    inputs = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():  # warm-up: the first generate call sets up far more than it computes
        model.generate(**tokenizer(chats[:2], return_tensors="pt", padding=True, add_special_tokens=False),
                       max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    began = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    seconds = time.perf_counter() - began
    torch.set_num_threads(1)
    new = out[:, inputs.input_ids.shape[1]:]
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    tokens = 0
    for row in new.tolist():
        for token in row:
            tokens += 1
            if token in eos:
                break
    return seconds, tokens


def checked_steps(runtime: Runtime) -> tuple[int, int, int]:
    """(steps verified, mismatches, sampled steps unverified) over the runtime's jobs."""
    from jobs.api.metrics import read_verification

    with runtime.session() as session:
        totals = read_verification(session)
    return totals.verified, totals.mismatches, totals.unverified


def main() -> None:
    parser = job_bench_parser(__doc__.splitlines()[0], requests=64, max_tokens=64, batch_size=64, reps=1)
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument("--verify-fractions", default="", help="e.g. 0.02,0.1: the cost of checked outputs instead")
    parser.add_argument("--checkpoint-every", type=int, default=8,
                        help="--verify-fractions: the jobs' checkpoint window K (the default job's: 8); checks compare "
                             "a window, so a longer one recomputes fewer histories per token")
    parser.add_argument("--sweep", action="store_true", help="default settings vs a sweep of claims and lanes")
    parser.add_argument("--configs", default="", help="--sweep: only these tuned settings, CLAIMxLANES,... (e.g. "
                                                      "64x4,32x2; default: 8/16/32/64 x 2/4/8)")
    parser.add_argument("--user-path", action="store_true", help="the default job through 2 unpinned servers vs "
                                                                  "local generate, interleaved")
    parser.add_argument("--cli-path", action="store_true", help="the default job run by a `swarmbatch worker` process "
                                                                 "(Celery, embedded broker) vs local generate")
    parser.add_argument("--server-args", default="", help="--user-path/--cli-path: extra `swarmbatch serve` options for "
                                                           "both servers, e.g. '--batch-wait-ms 0'")
    parser.add_argument("--baseline-settings", default="", help="--user-path/--cli-path: also run the job with these "
                                                                 "worker settings, KEY=VALUE,... (e.g. "
                                                                 "prefill_chunk_tokens=0), interleaved, and give the "
                                                                 "default job's ratio to it")
    parser.add_argument("--machines", action="store_true", help="lanes over two one-core machines (each server "
                                                                 "holding every block) vs the same servers as one")
    parser.add_argument("--out", type=Path, default=None, help="write the runs and ratios as JSON here")
    args = parser.parse_args()
    if args.machines:
        machines_main(args)
        return
    if args.user_path or args.cli_path:
        user_path_main(args)
        return
    if args.sweep:
        sweep_main(args)
        return
    if args.verify_fractions:
        verify_main(args)
        return
    home, model_dir = bench_setup(args.model)
    blocks = ModelSpec.open(model_dir).num_blocks
    texts = prompts(args.requests)
    data = batch_file(texts, args.max_tokens)
    rows: list[tuple[str, float, int]] = []
    outputs: dict[str, dict[str, str]] = {}
    with LocalSwarm(model_dir, [(0, blocks // 2), (blocks // 2, blocks)], log_dir=home / "logs", pin_cpus=True) as swarm:
        configs = {"features off": dict(pipeline_lanes=1, continuous_batching=False),
                   "features on": dict(pipeline_lanes=args.lanes, continuous_batching=True)}
        runtimes = {label: job_runtime(home, label, swarm.initial_peers, args, features, model_dir, texts)
                    for label, features in configs.items()}
        for _ in range(args.reps):  # interleaved, so that drifts of this noisy VM hit every config alike
            seconds, tokens = run_local(model_dir, texts, args.max_tokens)
            rows.append((LOCAL, seconds, tokens))
            for label, runtime in runtimes.items():
                seconds, tokens, outputs[label] = run_job(runtime, str(model_dir), data)
                rows.append((f"swarm job, {label}", seconds, tokens))
        for runtime in runtimes.values():
            runtime.close()
    best = best_runs(rows)
    rate = {label: tokens / seconds for label, (seconds, tokens) in best.items()}
    local, off = rate[LOCAL], rate["swarm job, features off"]
    print(f"\n{args.requests} requests x {args.max_tokens} new tokens ({args.model}), mixed prompt lengths; "
          f"2 servers pinned to one core each; worker batch {args.batch_size}, {args.lanes} lanes; best of {args.reps}")
    print("| config | seconds | tokens | tokens/s | vs local | vs features off |")
    print("|---|---|---|---|---|---|")
    for label, (seconds, tokens) in best.items():
        print(f"| {label} | {seconds:.1f} | {tokens} | {rate[label]:.1f} | {rate[label] / local:.2f} | "
              f"{rate[label] / off:.2f} |")
    same = outputs["features on"] == outputs["features off"]
    print(f"greedy texts identical with the features on and off: {same}")
    write_out(args, "features", rows, best, ratios={"on_vs_local": rate["swarm job, features on"] / local,
                                                    "on_vs_off": rate["swarm job, features on"] / off},
              same_texts=same)


def job_runtime(home: Path, label: str, initial_peers: list[str], args: argparse.Namespace,
                options: dict[str, object], model_dir: Path, texts: list[str], *, warm: bool = True) -> Runtime:
    """A runtime of its own store for one config, warmed up (swarm join, routes) by a 2-request job run in this
    process (`warm`)."""
    options = {"worker_batch_size": args.batch_size, "broker_url": "memory://", **options}
    settings = Settings(home=home / "".join(c if c.isalnum() else "_" for c in label), initial_peers=initial_peers,
                        **options)  # type: ignore[arg-type]
    settings.home.mkdir(parents=True, exist_ok=True)
    upgrade(settings.resolved_database_url)
    runtime = build_runtime(settings)
    if warm:
        run_job(runtime, str(model_dir), batch_file(texts[:2], 4))
    return runtime


def tuned_configs(spec: str) -> dict[str, dict[str, object]]:
    """{label: worker settings} for each CLAIMxLANES of `spec` ("64x4,32x2"): a fixed claim in fixed lanes."""
    pairs = [tuple(int(x) for x in pair.split("x")) for pair in spec.split(",") if pair]
    return {f"claim {claim}, {lanes} lanes": {"worker_batch_size": claim, "pipeline_lanes": lanes}
            for claim, lanes in pairs}


def sweep_main(args: argparse.Namespace) -> None:
    """Default settings (the worker sizes its batch) against claims x lanes, interleaved; and 2 workers."""
    home, model_dir = bench_setup(args.model)
    blocks = ModelSpec.open(model_dir).num_blocks
    texts = prompts(args.requests)
    data = batch_file(texts, args.max_tokens)
    grid = ",".join(f"{claim}x{lanes}" for claim in (8, 16, 32, 64) for lanes in (2, 4, 8))
    configs: dict[str, dict[str, object]] = {DEFAULTS: {"worker_batch_size": None},
                                             **tuned_configs(args.configs or grid)}
    rows: list[tuple[str, float, int]] = []
    with LocalSwarm(model_dir, [(0, blocks // 2), (blocks // 2, blocks)], log_dir=home / "logs", pin_cpus=True) as swarm:
        runtimes = {label: job_runtime(home, label, swarm.initial_peers, args, options, model_dir, texts)
                    for label, options in configs.items()}
        second = second_worker(runtimes[DEFAULTS], swarm)
        for _ in range(args.reps):  # interleaved, so that drifts of this noisy VM hit every config alike
            for label, runtime in runtimes.items():
                seconds, tokens, _ = run_job(runtime, str(model_dir), data)
                rows.append((label, seconds, tokens))
            seconds, tokens = run_job_with_two_workers(runtimes[DEFAULTS], second, str(model_dir), data)
            rows.append((TWO_WORKERS, seconds, tokens))
        second.close()
        for runtime in runtimes.values():
            runtime.close()
    best = best_runs(rows)
    rate = {label: tokens / seconds for label, (seconds, tokens) in best.items()}
    tuned = max((label for label in rate if label.startswith("claim")), key=rate.__getitem__)
    print(f"\n{args.requests} requests x {args.max_tokens} new tokens ({args.model}), mixed prompt lengths; 2 servers "
          f"pinned to one core each; best of {args.reps}")
    print("| config | seconds | tokens | tokens/s | vs best tuned |")
    print("|---|---|---|---|---|")
    for label, (seconds, tokens) in best.items():
        print(f"| {label} | {seconds:.1f} | {tokens} | {rate[label]:.1f} | {rate[label] / rate[tuned]:.2f} |")
    print(f"defaults vs the best tuned setting ({tuned}): {rate[DEFAULTS] / rate[tuned]:.2f} (target >= 0.9)")
    write_out(args, "sweep", rows, best, ratios={"defaults_vs_best_tuned": rate[DEFAULTS] / rate[tuned]},
              best_tuned=tuned)


DEFAULTS, TWO_WORKERS = "defaults (sized by the worker)", "defaults, 2 workers on the job"


def second_worker(runtime: Runtime, swarm: LocalSwarm) -> Runtime:
    """Another worker on the same store: its own Runtime, so its own swarm client (peer id, per-caller shares)."""
    return build_runtime(runtime.settings.model_copy(update={"initial_peers": swarm.initial_peers}))


def run_job_with_two_workers(first: Runtime, second: Runtime, model: str, data: bytes) -> tuple[float, int]:
    """(seconds, generated tokens) of one job that two workers claim from at once, each in its own thread."""
    from concurrent.futures import ThreadPoolExecutor

    from jobs.store import job_counts
    from jobs.submission import submit_batch
    from jobs.worker.job_worker import JobWorker

    job = submit_batch(first, data, model=model)
    began = time.perf_counter()

    def work(runtime: Runtime) -> None:
        worker = JobWorker(runtime)
        while worker.process(job.id).more:
            pass
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(work, [first, second]))
    seconds = time.perf_counter() - began
    with first.session() as session:
        counts = job_counts(session=session, job_id=job.id)
    assert counts.completed == counts.total, counts
    return seconds, counts.tokens


def user_path_main(args: argparse.Namespace) -> None:
    """The default job through 2 unpinned servers against local generate of the same prompts, interleaved."""
    home, model_dir = bench_setup(args.model)
    blocks = ModelSpec.open(model_dir).num_blocks
    texts = prompts(args.requests)
    data = batch_file(texts, args.max_tokens)
    rows: list[tuple[str, float, int]] = []
    job_label = CLI_JOB if args.cli_path else USER_JOB
    variants: dict[str, dict[str, object]] = {job_label: {}}
    if args.baseline_settings:
        variants[f"{job_label}, with {args.baseline_settings}"] = parse_settings(args.baseline_settings)
    with LocalSwarm(model_dir, [(0, blocks // 2), (blocks // 2, blocks)], log_dir=home / "logs", pin_cpus=False,
                    server_args=args.server_args.split()) as swarm, ExitStack() as stack:
        jobs: dict[str, JobIn] = {}
        for label, settings in variants.items():
            options: dict[str, object] = {"worker_batch_size": None, **settings,
                                          **({"broker_url": None} if args.cli_path else {})}
            runtime = job_runtime(home, label, swarm.initial_peers, args, options, model_dir, texts,
                                  warm=not args.cli_path)
            stack.callback(runtime.close)
            jobs[label] = stack.enter_context(worker_of(runtime, swarm, home / "logs", cli=args.cli_path))
            if args.cli_path:
                jobs[label](str(model_dir), batch_file(texts[:2], 4))  # warm-up: the worker joins, finds routes
        order = [LOCAL, *jobs]
        for rep in range(args.reps):  # interleaved, the order alternating, so that drifts hit all alike
            for which in (order if rep % 2 == 0 else order[::-1]):
                seconds, tokens = run_local(model_dir, texts, args.max_tokens) if which == LOCAL else \
                    jobs[which](str(model_dir), data)
                rows.append((which, seconds, tokens))
                print(f"rep {rep}: {which}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s",
                      flush=True)
        stack.close()
        merging = merge_counts(swarm, model_dir)
    best = best_runs(rows)
    rate = {label: tokens / seconds for label, (seconds, tokens) in best.items()}
    paired = paired_ratios(rows, job_label, LOCAL)
    print(f"\n{args.requests} requests x {args.max_tokens} new tokens ({args.model}), mixed prompt lengths; 2 servers "
          f"not pinned; the worker's default sizing; best of {args.reps}")
    print("| config | seconds | tokens | tokens/s | vs local |")
    print("|---|---|---|---|---|")
    for label, (seconds, tokens) in best.items():
        print(f"| {label} | {seconds:.1f} | {tokens} | {rate[label]:.1f} | {rate[label] / rate[LOCAL]:.2f} |")
    print(f"job vs local, best runs: {rate[job_label] / rate[LOCAL]:.2f}; per rep: "
          f"{', '.join(f'{r:.2f}' for r in paired)} (target >= 0.9)")
    ratios = {"job_vs_local": rate[job_label] / rate[LOCAL]}
    for label in list(variants)[1:]:
        against = paired_ratios(rows, job_label, label)
        ratios["job_vs_baseline"] = rate[job_label] / rate[label]
        print(f"default job vs the job {label.removeprefix(job_label + ', ')}, best runs: "
              f"{ratios['job_vs_baseline']:.2f}; per rep: {', '.join(f'{r:.2f}' for r in against)}")
    print(merging)
    write_out(args, "cli-path" if args.cli_path else "user-path", rows, best, ratios=ratios, paired=paired)


def parse_settings(spec: str) -> dict[str, object]:
    """'prefill_chunk_tokens=0,pipeline_lanes=2' -> worker settings (Settings validates the values' types)."""
    pairs = [item.split("=", 1) for item in spec.split(",") if item.strip()]
    if any(len(pair) != 2 for pair in pairs):
        raise SystemExit(f"--baseline-settings: expected KEY=VALUE,..., got {spec!r}")
    return {key.strip(): value.strip() for key, value in pairs}


def server_infos(swarm: LocalSwarm, model_dir: Path) -> list[dict[str, Any]]:
    """Each server's `info` answer (its counters since start), in start order."""
    spec = ModelSpec.open(model_dir)
    client = Swarm.connect(swarm.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks)
    try:
        return [client.loop.run(client.call_info(server.peer_id)) for server in swarm.servers]
    finally:
        client.close()


def merge_counts(swarm: LocalSwarm, model_dir: Path) -> str:
    """One line: how many of each server's steps were merged with other sessions' (servers/batching.py)."""
    infos = server_infos(swarm, model_dir)
    return "servers' steps, merged: " + "; ".join(
        f"{info['steps']} steps, {info['merged_sessions']} of them in {info['merged_steps']} merged forwards "
        f"(at most {info['max_merged']} sessions)" for info in infos)


USER_JOB = "swarm job, default settings, 2 unpinned servers"
CLI_JOB = "swarm job run by a `swarmbatch worker` process, default settings, 2 unpinned servers"
JobIn = Callable[[str, bytes], tuple[float, int]]


@contextmanager
def worker_of(runtime: Runtime, swarm: LocalSwarm, log_dir: Path, *, cli: bool) -> Iterator[JobIn]:
    """How a job runs: in this process (the worker's code, batch after batch), or with `cli` by a `swarmbatch worker`
    process (Celery on the embedded broker, as a user starts it), submitted as `swarmbatch submit` stores it and
    timed from its submission to its last line."""
    if not cli:
        yield lambda model, data: run_job(runtime, model, data)[:2]
        return
    worker = start_local_worker(worker_settings(runtime.settings, swarm), log_dir=log_dir)
    try:
        def job_in(model: str, data: bytes) -> tuple[float, int]:
            began = time.perf_counter()
            job = submit_batch(runtime, data, model=model)
            while True:
                require_running(worker)
                with runtime.session() as session:
                    counts = job_counts(session=session, job_id=job.id)
                if counts.completed + counts.failed >= counts.total:
                    break
                time.sleep(0.1)
            assert counts.completed == counts.total, counts
            return time.perf_counter() - began, counts.tokens
        yield job_in
    finally:
        worker.terminate()


def paired_ratios(rows: list[tuple[str, float, int]], label: str, base: str) -> list[float]:
    """Per rep (the n-th run of each): tokens/s of `label` over tokens/s of `base`."""
    rates = {name: [tokens / seconds for run, seconds, tokens in rows if run == name] for name in (label, base)}
    return [a / b for a, b in zip(rates[label], rates[base], strict=False)]


def write_out(args: argparse.Namespace, mode: str, rows: list[tuple[str, float, int]],
              best: dict[str, tuple[float, int]], **extra: object) -> None:
    """--out: the settings, every run, the best run per config and the mode's own figures, as JSON."""
    if args.out is None:
        return
    tuned = ("batch_size", "lanes") if mode in ("features", "verify", "machines") else ()  # the others size their own
    settings = {key: getattr(args, key) for key in ("model", "requests", "max_tokens", "reps", *tuned)}
    args.out.write_text(json.dumps({
        "mode": mode, "settings": settings,
        "runs": [{"config": label, "seconds": seconds, "tokens": tokens} for label, seconds, tokens in rows],
        "best": {label: {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
                 for label, (seconds, tokens) in best.items()}, **extra}, indent=1))
    print(f"wrote {args.out}")


def best_runs(rows: list[tuple[str, float, int]]) -> dict[str, tuple[float, int]]:
    """Per config, the (seconds, tokens) of its fastest run."""
    best: dict[str, tuple[float, int]] = {}
    for label, seconds, tokens in rows:
        if label not in best or tokens / seconds > best[label][1] / best[label][0]:
            best[label] = (seconds, tokens)
    return best


def verify_main(args: argparse.Namespace) -> None:
    """The cost of checked outputs: no checks, then each fraction, interleaved, two holders of each half."""
    home, model_dir = bench_setup(args.model)
    blocks = ModelSpec.open(model_dir).num_blocks
    texts = prompts(args.requests)
    data = batch_file(texts, args.max_tokens)
    fractions = [0.0, *(float(f) for f in args.verify_fractions.split(","))]
    halves = [(0, blocks // 2), (blocks // 2, blocks)]
    rows: list[tuple[str, float, int]] = []
    outputs: dict[str, dict[str, str]] = {}
    with LocalSwarm(model_dir, halves * 2, log_dir=home / "logs", pin_cpus=True) as swarm:
        options = dict(pipeline_lanes=args.lanes, continuous_batching=True, checkpoint_every=args.checkpoint_every)
        runtimes = {f"verify {f:g}" if f else "no checks": job_runtime(
            home, f"verify {f:g}", swarm.initial_peers, args, {**options, "verify_fraction": f}, model_dir, texts)
            for f in fractions}
        before = {label: checked_steps(runtime) for label, runtime in runtimes.items()}
        for _ in range(args.reps):
            for label, runtime in runtimes.items():
                seconds, tokens, outputs[label] = run_job(runtime, str(model_dir), data)
                rows.append((label, seconds, tokens))
                print(f"  {label}: {seconds:.1f} s, {tokens / seconds:.1f} tok/s", flush=True)
        checks = {label: tuple(a - b for a, b in zip(checked_steps(runtime), before[label], strict=True))
                  for label, runtime in runtimes.items()}
        for runtime in runtimes.values():
            runtime.close()
    best = best_runs(rows)
    off = best["no checks"][1] / best["no checks"][0]
    print(f"\n{args.requests} requests x {args.max_tokens} new tokens ({args.model}), mixed prompt lengths; 4 servers "
          f"(two holders of each half) pinned to {os.cpu_count()} cores; worker batch {args.batch_size}, "
          f"{args.lanes} lanes, features on, a checkpoint every {args.checkpoint_every} tokens; best of {args.reps}")
    print("| checks | seconds | tokens | tokens/s | vs no checks | hop steps verified | mismatches | unverified |")
    print("|---|---|---|---|---|---|---|---|")
    for label, (seconds, tokens) in best.items():
        verified, mismatches, unverified = checks[label]
        print(f"| {label} | {seconds:.1f} | {tokens} | {tokens / seconds:.1f} | {tokens / seconds / off:.2f} | "
              f"{verified} | {mismatches} | {unverified} |")
    same = all(texts == outputs["no checks"] for texts in outputs.values())
    print(f"greedy texts identical with and without checks: {same}")
    write_out(args, "verify", rows, best, ratios={label: tokens / seconds / off for label, (seconds, tokens) in best.items()},
              checks={label: dict(zip(("verified", "mismatches", "unverified"), counts, strict=True))
                      for label, counts in checks.items()}, same_texts=same,
              paired={label: paired_ratios(rows, label, "no checks") for label in best})


SPREAD, ONE_MACHINE = "two machines (lanes spread)", "one machine (all lanes on one server)"


def machines_main(args: argparse.Namespace) -> None:
    """Lanes over two one-core machines against the same servers announced as one machine, alternating."""
    home, model_dir = bench_setup(args.model)
    blocks = ModelSpec.open(model_dir).num_blocks
    texts = prompts(args.requests)
    data = batch_file(texts, args.max_tokens)
    configs = {SPREAD: ["core-0", "core-1"], ONE_MACHINE: ["one-box", "one-box"]}
    rows: list[tuple[str, float, int]] = []
    outputs: dict[str, dict[str, str]] = {}
    steps: dict[str, list[list[int]]] = {label: [] for label in configs}
    for rep in range(args.reps):
        for label in (list(configs) if rep % 2 == 0 else list(configs)[::-1]):
            run_home = home / f"machines-{rep}-{label.split()[0]}"
            with LocalSwarm(model_dir, [], log_dir=run_home / "logs", pin_cpus=True) as swarm:
                swarm.start_servers([(0, blocks, ["--machine", name]) for name in configs[label]])
                runtime = job_runtime(run_home, label, swarm.initial_peers, args,
                                      dict(pipeline_lanes=args.lanes, continuous_batching=True), model_dir, texts)
                seconds, tokens, outputs[label] = run_job(runtime, str(model_dir), data)
                runtime.close()
                steps[label].append([info["steps"] for info in server_infos(swarm, model_dir)])
            rows.append((label, seconds, tokens))
            print(f"  {label}: {seconds:.1f} s, {tokens / seconds:.1f} tok/s, servers' steps {steps[label][-1]}",
                  flush=True)
    best = best_runs(rows)
    one = best[ONE_MACHINE][1] / best[ONE_MACHINE][0]
    print(f"\n{args.requests} requests x {args.max_tokens} new tokens ({args.model}), mixed prompt lengths; 2 servers "
          f"of all {blocks} blocks, each pinned to its own core (1 thread); worker batch {args.batch_size}, "
          f"{args.lanes} lanes; best of {args.reps}")
    print("| servers announced as | seconds | tokens | tokens/s | vs one machine | servers' steps per run |")
    print("|---|---|---|---|---|---|")
    for label, (seconds, tokens) in best.items():
        print(f"| {label} | {seconds:.1f} | {tokens} | {tokens / seconds:.1f} | {tokens / seconds / one:.2f} | "
              f"{steps[label]} |")
    same = outputs[SPREAD] == outputs[ONE_MACHINE]
    print(f"greedy texts identical: {same}")
    write_out(args, "machines", rows, best, ratios={"spread_vs_one_machine": best[SPREAD][1] / best[SPREAD][0] / one},
              steps=steps, same_texts=same, paired=paired_ratios(rows, SPREAD, ONE_MACHINE))


if __name__ == "__main__":
    main()
