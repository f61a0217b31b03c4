"""The API's /metrics says what keeps work from moving, on each database: live workers, blocked jobs, refused input
lines, and each served model's coverage from the swarm snapshot a worker published (jobs.api.health_figures)."""
from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from factories import block_infos, span
from test_job_metrics import scrape

from jobs import liveness, snapshots
from jobs.models import Job, utcnow
from jobs.runtime import Runtime
from jobs.submission import submit_batch
from swarmclient.coverage import coverage_report
from swarmnet.data_structures import ServerState

GOOD = {"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 2}}


@pytest.fixture(params=["sqlite", "postgresql"])
def runtime(request: pytest.FixtureRequest, make_runtime: Callable[..., Runtime], tiny_model: Path) -> Runtime:
    """An embedded runtime serving the tiny model and `other`, on SQLite, then PostgreSQL."""
    database_url = request.getfixturevalue("postgres_url") if request.param == "postgresql" else None
    return make_runtime(database_url=database_url, api_models=[str(tiny_model), "other"])


def test_a_new_store_reports_no_worker_nothing_blocked_and_no_coverage(runtime: Runtime,
                                                                       serve: Callable[[Runtime], str]) -> None:
    metrics = scrape(serve(runtime))
    assert metrics["swarmbatch_workers_alive"] == 0 and metrics["swarmbatch_jobs_blocked"] == 0
    assert metrics["swarmbatch_input_line_errors"] == 0
    assert not [name for name in metrics if "{model=" in name]  # no snapshot yet: unknown, not "all served"


def test_workers_blocked_jobs_refused_lines_and_coverage(runtime: Runtime, serve: Callable[[Runtime], str],
                                                         tiny_model: Path) -> None:
    model = str(tiny_model)
    lines = [json.dumps(GOOD), "not json", json.dumps({**GOOD, "custom_id": "bad", "url": "/v1/nowhere"})]
    blocked = submit_batch(runtime, ("\n".join(lines) + "\n").encode(), model=model)
    submit_batch(runtime, (json.dumps(GOOD) + "\n").encode(), model=model)
    now = utcnow()
    with runtime.session() as session:
        liveness.record_heartbeat(session=session, worker="w1", alive_for=30)
        liveness.record_heartbeat(session=session, worker="w2", alive_for=30)
        liveness.record_heartbeat(session=session, worker="gone", alive_for=30, now=now - timedelta(minutes=5))
        row = session.get(Job, blocked.id)
        assert row is not None
        row.blocked_reason = "MissingBlocksError: no server holds blocks 4:6"  # what a worker records
        # the servers as a worker saw them 42 s ago: blocks 4 and 5 have no server online (one is still joining)
        infos = block_infos(6, span("peer-a", 0, 2), span("peer-b", 2, 4), span("peer-c", 4, 6,
                                                                                state=ServerState.JOINING))
        snapshots.publish_snapshot(session=session, model=model, worker="w1", report=coverage_report(model, infos),
                                   now=now - timedelta(seconds=42))
        session.commit()
    metrics = scrape(serve(runtime))
    assert metrics["swarmbatch_workers_alive"] == 2 and metrics["swarmbatch_jobs_blocked"] == 1
    assert metrics["swarmbatch_input_line_errors"] == 2
    labels = f'{{model="{model}"}}'
    assert metrics[f"swarmbatch_swarm_blocks{labels}"] == 6
    assert metrics[f"swarmbatch_blocks_without_server{labels}"] == 2
    assert metrics[f"swarmbatch_swarm_servers_online{labels}"] == 2
    assert 42 <= metrics[f"swarmbatch_swarm_snapshot_age_seconds{labels}"] < 42 + 30
    assert 'swarmbatch_swarm_blocks{model="other"}' not in metrics  # served, but no worker has looked at it
