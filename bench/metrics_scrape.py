"""Benchmark: the cost of one `GET /metrics` scrape of the API on a store with a long history.

Fills a fresh store (SQLite, or a temporary PostgreSQL database) with `--jobs` jobs of `--per-job` requests,
most completed with `--tokens` generated tokens each, then times scrapes through the real app in this process
(starlette's TestClient): each scrape with the cache off (every scrape reads SQL) and, where the app has one,
a burst of scrapes within the cache's lifetime.

usage: python bench/metrics_scrape.py [--jobs 100] [--per-job 200] [--tokens 128] [--reps 20]
                                      [--postgres postgresql+psycopg2://postgres@127.0.0.1:5432/test]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import create_engine, insert, text

from jobs.api.main import make_app
from jobs.assembly import build_runtime
from jobs.migrate import upgrade
from jobs.models import Job, JobStatus, Request, RequestStatus, utcnow
from jobs.runtime import Runtime
from jobs.settings import Settings


@contextmanager
def database(postgres_admin: str | None, home: Path) -> Iterator[str | None]:
    """None (SQLite under `home`) or a temporary PostgreSQL database, dropped afterwards."""
    if postgres_admin is None:
        yield None
        return
    admin = create_engine(postgres_admin, isolation_level="AUTOCOMMIT")
    name = f"sbbench_{uuid.uuid4().hex[:12]}"
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield postgres_admin.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def fill(runtime: Runtime, *, jobs: int, per_job: int, tokens: int) -> None:
    """`jobs` completed jobs; in each, 9 of 10 requests completed with `tokens` tokens, the rest pending."""
    now = utcnow()
    with runtime.engine.begin() as connection:
        for j in range(jobs):
            job_id = f"batch_bench{j:08d}"
            connection.execute(insert(Job).values(
                id=job_id, model="tiny", endpoint="/v1/completions", status=JobStatus.completed, line_errors=[],
                checkpoint_every=8, completion_window_s=86400, metadata={}, created_at=now,
                expires_at=now + timedelta(days=1)))
            connection.execute(insert(Request), [dict(
                job_id=job_id, index=i, line_number=i + 1, custom_id=f"r{i}", body={"prompt": "x" * 200},
                prompt_ids=list(range(64)), max_tokens=tokens, temperature=0.0, top_p=1.0, seed=0, stop=[],
                status=RequestStatus.completed if i % 10 else RequestStatus.pending, attempts=1,
                generated_ids=list(range(tokens)) if i % 10 else [], **counted(tokens if i % 10 else 0),
                stage=0, final=True, created_at=now) for i in range(per_job)])


def settle(runtime: Runtime) -> None:
    """What autovacuum does to a PostgreSQL table soon after a bulk insert: statistics and the visibility map."""
    if runtime.engine.dialect.name == "postgresql":
        with runtime.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(text("VACUUM ANALYZE"))


def counted(tokens: int) -> dict[str, int]:
    """The request's token count column, where the schema has one (it did not before issue 14)."""
    return {"generated_count": tokens} if hasattr(Request, "generated_count") else {}


def time_scrapes(client: TestClient, reps: int) -> list[float]:
    """Seconds of each of `reps` scrapes."""
    seconds = []
    for _ in range(reps):
        began = time.perf_counter()
        response = client.get("/metrics")
        seconds.append(time.perf_counter() - began)
        assert response.status_code == 200, response.text
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--per-job", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=128, help="generated tokens of each completed request")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--postgres", default=None, help="admin URL of a PostgreSQL server (default: SQLite)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, database(args.postgres, Path(tmp)) as url:
        rows = {}
        for label, ttl in (("every scrape reads SQL", 0.0), ("burst within the cache's lifetime", 60.0)):
            settings = Settings(home=Path(tmp), database_url=url, broker_url="memory://", metrics_cache_seconds=ttl)
            upgrade(settings.resolved_database_url)
            runtime = build_runtime(settings)
            if not rows:
                fill(runtime, jobs=args.jobs, per_job=args.per_job, tokens=args.tokens)
                settle(runtime)
            with TestClient(make_app(runtime)) as client:
                time_scrapes(client, 2)  # warm-up: connections, the database's caches
                rows[label] = time_scrapes(client, args.reps)
            runtime.close()
    where = "SQLite" if args.postgres is None else "PostgreSQL"
    print(f"{args.jobs * args.per_job} requests ({args.jobs} jobs, {args.tokens} tokens per completed request), "
          f"{where}, {args.reps} scrapes each")
    print("| scrapes | median ms | max ms |")
    print("|---|---|---|")
    for label, seconds in rows.items():
        print(f"| {label} | {statistics.median(seconds) * 1000:.1f} | {max(seconds) * 1000:.1f} |")


if __name__ == "__main__":
    main()
