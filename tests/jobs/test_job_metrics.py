"""The API's Prometheus endpoint against a real job run by a real worker on a real swarm (only the clock is faked)."""
from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from jobs_support import job_status, requests_of, wait_for
from prometheus_client.parser import text_string_to_metric_families

from jobs import clock
from jobs.runtime import Runtime
from jobs.submission import submit_batch
from launch.local_swarm import LocalSwarm
from launch.local_worker import start_local_worker

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def scrape(url: str) -> dict[str, float]:
    """`name{labels}` -> value, parsed by Prometheus' own text parser."""
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_metrics_report_a_real_jobs_counts_tokens_and_rate(
        make_runtime: Callable[..., Runtime], serve: Callable[[Runtime], str], shared_swarm: LocalSwarm,
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [T0]
    monkeypatch.setattr(clock, "now", lambda: now[0])
    runtime = make_runtime()
    url = serve(runtime)
    before = scrape(url)
    assert before["swarmbatch_tokens_generated_total"] == 0 and before["swarmbatch_tokens_per_second"] == 0
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"Item {i} is", "max_tokens": 10 + i, "temperature": 0}}) for i in range(4)]
    job = submit_batch(runtime, ("\n".join(lines) + "\n").encode(), model=str(tiny_model))
    worker = start_local_worker(runtime.settings.model_copy(update={"initial_peers": shared_swarm.initial_peers}),
                                log_dir=tmp_path)
    try:
        wait_for(lambda: job_status(runtime, job.id) == "completed", 120, "the job")
    finally:
        worker.terminate()
    tokens = sum(len(r.generated_ids) for r in requests_of(runtime, job.id))
    now[0] = T0 + timedelta(seconds=10)
    after = scrape(url)
    assert after['swarmbatch_jobs{status="completed"}'] == 1 and after['swarmbatch_jobs{status="validating"}'] == 0
    assert after['swarmbatch_requests{status="completed"}'] == 4 and after['swarmbatch_requests{status="failed"}'] == 0
    assert after["swarmbatch_tokens_generated_total"] == tokens > 0
    assert after["swarmbatch_tokens_per_second"] == pytest.approx(tokens / 10)
