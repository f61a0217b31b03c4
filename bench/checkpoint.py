"""Benchmark: the cost of checkpointing generated tokens in SQL (K=1, K=8, no checkpoint) on a real swarm.

Runs the worker's own code path (JobWorker.process: claim, generate through the swarm, checkpoint, finish)
in this process, without Celery, so the difference between runs is the checkpoint writes alone.

usage: python bench/checkpoint.py [--model smollm2|PATH] [--requests 16] [--max-tokens 32] [--database-url URL]
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


from jobrun import bench_setup, job_bench_parser, run_job  # noqa: E402  (bench/ is the script's folder, first on sys.path)

from jobs.assembly import build_runtime  # noqa: E402
from jobs.migrate import upgrade  # noqa: E402
from jobs.settings import Settings  # noqa: E402
from launch.local_swarm import LocalSwarm  # noqa: E402
from swarmnet.model_spec import ModelSpec  # noqa: E402

NO_CHECKPOINT = 10**9  # K larger than any request: only the final write happens


def batch(requests: int, max_tokens: int) -> bytes:
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": f"Write a short story about robot {i}."}],
                                  "max_tokens": max_tokens, "temperature": 0}}) for i in range(requests)]
    return ("\n".join(lines) + "\n").encode()


def main() -> None:
    parser = job_bench_parser(__doc__.splitlines()[0], requests=16, max_tokens=32, batch_size=8, reps=2)
    parser.add_argument("--database-url", default=None, help="default: a fresh SQLite file")
    args = parser.parse_args()
    home, model_dir = bench_setup(args.model)
    blocks = ModelSpec.open(model_dir).num_blocks
    data = batch(args.requests, args.max_tokens)
    rows = []
    with LocalSwarm(model_dir, [(0, blocks // 2), (blocks // 2, blocks)], log_dir=home / "logs", pin_cpus=True) as swarm:
        for label, k in (("no checkpoint", NO_CHECKPOINT), ("K=8", 8), ("K=1", 1)):
            settings = Settings(home=home / label.replace(" ", "_").replace("=", ""), database_url=args.database_url,
                                initial_peers=swarm.initial_peers, checkpoint_every=k,
                                worker_batch_size=args.batch_size, broker_url="memory://")
            settings.home.mkdir(parents=True, exist_ok=True)
            upgrade(settings.resolved_database_url)
            runtime = build_runtime(settings)
            run_job(runtime, str(model_dir), batch(2, 4))  # warm-up: swarm join, first routes
            results = [run_job(runtime, str(model_dir), data)[:2] for _ in range(args.reps)]
            runtime.close()
            seconds = min(r[0] for r in results)
            tokens = results[0][1]
            rows.append((label, tokens, seconds, tokens / seconds))
    base = rows[0][3]
    print(f"\n{args.requests} requests x {args.max_tokens} tokens, batch {args.batch_size}, "
          f"{'SQLite' if not args.database_url else args.database_url.split('@')[-1]}, 2 servers, best of {args.reps}")
    print("| checkpoint | tokens | seconds | tokens/s | vs no checkpoint |")
    print("|---|---|---|---|---|")
    for label, tokens, seconds, rate in rows:
        print(f"| {label} | {tokens} | {seconds:.2f} | {rate:.1f} | {rate / base:.3f} |")


if __name__ == "__main__":
    main()
