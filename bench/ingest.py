"""Ingest benchmark (issue 29): batches.create of OpenAI's largest batch file, through real API and worker processes.

A 50,000-line ~100 MB chat file (SmolLM2's chat template and tokenizer on every line) is uploaded to /v1/files,
then a batch is created from it, on SQLite (with the embedded broker) and on PostgreSQL (with Redis). Measured:
the time of the `batches.create` call, the time until the batch is `in_progress` (every line checked and the first
requests claimed by the worker; no swarm runs, so nothing is generated), and the peak resident memory (VmHWM) of the
API process and of the worker's processes.

Baseline, in the same run: the same file through the code of another checkout (`--baseline-tree`, by default
/work/main before this change), whose API checked every line inside the create call.

    PYTHONPATH=$PWD .venv/bin/python bench/ingest.py [--lines 50000] [--stores sqlite,postgresql]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis
from sqlalchemy import create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch.processes import ManagedProcess  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
WORDS = ("the council voted on a budget for roads schools parks and the river bridge after a long debate in which "
         "residents asked about taxes noise traffic and the timeline of every project while the mayor said").split()
POSTGRES = "postgresql+psycopg2://postgres@127.0.0.1:5432"
REDIS = "redis://127.0.0.1:6379/12"
POLL_SECONDS = 2.0  # as a client polls batches.retrieve; each poll counts the job's requests in the API
MODELS = Path(os.environ.get("SWARMBATCH_HOME", Path.home() / ".swarmbatch")) / "models"


@dataclass(frozen=True)
class Run:
    """One measured batches.create: its store, the code that served it, and what was measured."""

    code: str
    store: str
    create_s: float
    ready_s: float
    requests: int
    api_peak_mb: float
    worker_peak_mb: float | None


def free_port() -> int:
    """A TCP port nobody listens on right now, on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_file(path: Path, lines: int, line_bytes: int) -> int:
    """A JSONL chat batch of `lines` lines of about `line_bytes` bytes each; returns its size."""
    rng = random.Random(7)
    with path.open("w") as out:
        for i in range(lines):
            words: list[str] = []
            length = 0
            while length < line_bytes - 200:
                words.append(rng.choice(WORDS))
                length += len(words[-1]) + 1
            out.write(json.dumps({"custom_id": f"request-{i}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {"model": "smollm2", "max_tokens": 64, "messages": [
                                      {"role": "system", "content": "Summarize the report in one sentence."},
                                      {"role": "user", "content": " ".join(words)}]}}) + "\n")
    return path.stat().st_size


def peak_mb(pid: int) -> float:
    """VmHWM (peak resident memory) of one process, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def tree(pid: int) -> list[int]:
    """A process and its descendants."""
    found = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        for child in children:
            found.extend(tree(int(child)))
    return found


@contextmanager
def database(store: str, home: Path) -> Iterator[tuple[str, str]]:
    """(database URL, broker URL) of a fresh store: a SQLite file and the embedded broker, or a new PostgreSQL
    database and Redis (flushed)."""
    if store == "sqlite":
        yield f"sqlite:///{home / 'bench.sqlite'}", f"sqla+sqlite:///{home / 'broker.sqlite'}"
        return
    name = f"bench_ingest_{uuid.uuid4().hex[:8]}"
    admin = create_engine(f"{POSTGRES}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f"CREATE DATABASE {name}"))
    redis.Redis.from_url(REDIS).flushdb()
    try:
        yield f"{POSTGRES}/{name}", REDIS
    finally:
        redis.Redis.from_url(REDIS).flushdb()
        with admin.connect() as connection:
            connection.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


def cli(tree_dir: Path, env: dict[str, str], *args: str) -> str:
    """Run the CLI of a checkout to completion; its stdout."""
    done = subprocess.run([sys.executable, "-P", "-m", "cli", *args], env={**os.environ, **env,
                          "PYTHONPATH": str(tree_dir)}, capture_output=True, text=True, check=True)
    return done.stdout


def measure(code: str, tree_dir: Path, store: str, batch: Path, *, worker: bool) -> Run:
    """One batches.create of the file on a fresh store, served by the code in `tree_dir`."""
    home = Path(tempfile.mkdtemp(prefix=f"bench-ingest-{code}-{store}-"))
    (home / "models").symlink_to(MODELS)  # SmolLM2 prepared once (`swarmbatch model prepare smollm2`), not per run
    with database(store, home) as (database_url, broker_url):
        env = {"SWARMBATCH_HOME": str(home), "SWARMBATCH_DATABASE_URL": database_url,
               "SWARMBATCH_BROKER_URL": broker_url,
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree_dir)}
        cli(tree_dir, env, "db", "upgrade")
        key = cli(tree_dir, env, "keys", "create", "bench").strip().splitlines()[-1]
        port = free_port()
        api = ManagedProcess([sys.executable, "-P", "-m", "cli", "api", "--host", "127.0.0.1", "--port", str(port)],
                             name=f"api-{code}-{store}", log_dir=home, env=env)
        workers = ManagedProcess([sys.executable, "-P", "-m", "cli", "worker"], name=f"worker-{code}-{store}",
                                 log_dir=home, env=env) if worker else None
        try:
            url = f"http://127.0.0.1:{port}"
            http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600)
            wait_healthy(http, api)
            with batch.open("rb") as file:
                uploaded = http.post("/v1/files", files={"file": ("big.jsonl", file)}, data={"purpose": "batch"})
            uploaded.raise_for_status()
            began = time.monotonic()
            created = http.post("/v1/batches", json={"input_file_id": uploaded.json()["id"],
                                                     "endpoint": "/v1/chat/completions", "completion_window": "24h"})
            create_s = time.monotonic() - began
            created.raise_for_status()
            job = created.json()
            while job["status"] == "validating" and job["request_counts"]["total"] == 0 or \
                    worker and job["status"] == "validating":
                if time.monotonic() - began > 600:
                    raise RuntimeError(f"the batch is still {job['status']} after 600 s; see {home}")
                time.sleep(POLL_SECONDS)
                job = http.get(f"/v1/batches/{job['id']}").json()
            ready_s = time.monotonic() - began
            api_peak = peak_mb(api.pid)
            worker_peak = max(peak_mb(pid) for pid in tree(workers.pid)) if workers else None
            http.close()
        finally:
            if workers:
                workers.terminate()
            api.terminate()
    return Run(code, store, create_s, ready_s, job["request_counts"]["total"], api_peak, worker_peak)


def wait_healthy(http: httpx.Client, api: ManagedProcess) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if http.get("/healthz").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if api.proc.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"the API did not answer; see {api.log_path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--line-bytes", type=int, default=2_000)
    parser.add_argument("--stores", default="sqlite,postgresql")
    parser.add_argument("--baseline-tree", type=Path, default=Path("/work/main"),
                        help="a checkout whose API checks lines inside batches.create (none: skip the baseline)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    batch = folder / "big.jsonl"
    size = write_file(batch, args.lines, args.line_bytes)
    print(f"file: {args.lines} lines, {size / 1e6:.1f} MB", flush=True)
    runs = []
    for store in args.stores.split(","):
        for code, tree_dir in (("before", args.baseline_tree), ("after", HERE)):
            if not tree_dir.exists():
                continue
            run = measure(code, tree_dir, store, batch, worker=code == "after")
            runs.append(run)
            worker = f", worker peak {run.worker_peak_mb:.0f} MB" if run.worker_peak_mb else ""
            print(f"{store:<10} {code:<6} create {run.create_s:6.2f} s, in_progress-ready {run.ready_s:6.1f} s, "
                  f"{run.requests} requests, API peak {run.api_peak_mb:.0f} MB{worker}", flush=True)
    batch.unlink()
    print(json.dumps([run.__dict__ for run in runs]))


if __name__ == "__main__":
    main()
