"""The profile `monitoring` (deploy/, docs/monitoring.md): promtool checks the Prometheus config and unit-tests the
alert rules; every figure the rules and the dashboard name is one our /metrics serve; and a real Prometheus (Debian's
package) scrapes a real API and a real server /metrics on 127.0.0.1 and evaluates the rules."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from ports import free_port
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from jobs import snapshots
from jobs.api.metrics import make_registry
from jobs.runtime import Runtime
from launch.processes import ManagedProcess
from servers.counters import ServerCounters
from servers.memory import CacheBudget
from servers.metrics import MetricsEndpoint, ServerCollector, start_metrics
from servers.status import ServerStatus, SpanStatus
from swarmnet.data_structures import PROTOCOL_VERSION, ServerState

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"


def debian_tool(name: str) -> str:
    """The path of promtool or prometheus; skips where absent (fails in CI: .ci/run installs them)."""
    found = shutil.which(name)
    if found is None:
        message = f"{name} is not installed: run 'apt-get install -y prometheus' (.ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return found


def prometheus_dir_copy(target: Path) -> Path:
    """deploy/prometheus with the token file the container writes at start (empty: the API's /metrics is public)."""
    shutil.copytree(PROMETHEUS_DIR, target)
    (target / "api-token").write_text("")
    return target


@pytest.mark.swarm  # runs promtool
def test_promtool_accepts_the_config_and_its_rules(tmp_path: Path) -> None:
    config = prometheus_dir_copy(tmp_path / "prometheus") / "prometheus.yml"
    proc = subprocess.run([debian_tool("promtool"), "check", "config", str(config)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"SUCCESS: \d+ rules found", proc.stdout), proc.stdout


@pytest.mark.swarm  # runs promtool
def test_the_alert_rules_pass_their_promtool_unit_tests() -> None:
    proc = subprocess.run([debian_tool("promtool"), "test", "rules", "alerts.test.yml"], capture_output=True,
                          text=True, timeout=120, cwd=PROMETHEUS_DIR)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())["groups"]
            for rule in group["rules"]]


def test_every_alert_has_a_unit_test_a_severity_and_a_summary() -> None:
    tests = yaml.safe_load((PROMETHEUS_DIR / "alerts.test.yml").read_text())["tests"]
    tested = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case.get("exp_alerts")}
    alerts = [rule for rule in alert_rules() if "alert" in rule]
    assert {rule["alert"] for rule in alerts} == tested
    for rule in alerts:
        assert rule["labels"]["severity"] in {"critical", "warning", "info"} and rule["annotations"]["summary"], rule


# ---- the names the rules and the dashboard use exist ------------------------------------------------------------
def sample_names(registry: CollectorRegistry) -> set[str]:
    return {sample.name for family in text_string_to_metric_families(generate_latest(registry).decode())
            for sample in family.samples}


def a_server_status(state: ServerState = ServerState.ONLINE) -> ServerStatus:
    """A server's status with a span, a step and an error: every family its /metrics can serve."""
    stats = ServerCounters(steps=1, tokens=4)
    stats.record_error("internal")
    span = SpanStatus(start=0, end=2, throughput=10.0, sessions=0, forwards=0, cache=CacheBudget(64, 2).use())
    return ServerStatus(state=state, model_id="tiny", peer_id="QmPeer", dtype="float32", quant="none",
                        version=PROTOCOL_VERSION, revision="r", max_batch_size=8, max_length=64,
                        max_sessions_per_peer=3, stats=stats, span=span)


def served_names(runtime: Runtime) -> set[str]:
    """Every sample name of the API's and a server's /metrics, and the recorded ones of alerts.yml."""
    server = CollectorRegistry(auto_describe=False)
    server.register(ServerCollector(a_server_status))
    recorded = {rule["record"] for rule in alert_rules() if "record" in rule}
    return sample_names(make_registry(runtime)) | sample_names(server) | recorded | {"up"}


def referenced_names(text: str) -> set[str]:
    return set(re.findall(r"\bswarmbatch(?::[a-z0-9_]+:[a-z0-9_]+|_[a-z0-9_]+)", text)) - {"swarmbatch_"}


def test_the_rules_and_the_dashboard_name_only_figures_our_metrics_serve(make_runtime: Callable[..., Runtime]) -> None:
    runtime = make_runtime(api_models=["tiny"])
    with runtime.session() as session:  # a snapshot, so that the per-model figures have a sample
        snapshots.publish_snapshot(session=session, model="tiny", worker="w", report={
            "model_id": "tiny", "num_blocks": 1, "blocks": [{"index": 0, "servers": []}], "missing": [[0, 1]],
            "complete": False})
        session.commit()
    served = served_names(runtime)
    exprs = [rule["expr"] for rule in alert_rules()]
    dashboards = [json.loads(path.read_text()) for path in DASHBOARDS.glob("*.json")]
    exprs += [target["expr"] for board in dashboards for panel in board["panels"] for target in panel.get("targets", [])]
    referenced = set().union(*map(referenced_names, exprs))
    assert {"swarmbatch_workers_alive", "swarmbatch_blocks_without_server", "swarmbatch_server_errors_total"} <= referenced
    assert referenced - served == set()


def test_the_dashboard_reads_the_provisioned_datasource() -> None:
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    for path in DASHBOARDS.glob("*.json"):
        board = json.loads(path.read_text())
        panels = [panel for panel in board["panels"] if panel["type"] != "row"]
        assert panels and all(panel["datasource"]["uid"] == uid for panel in panels), path
        assert len({panel["id"] for panel in board["panels"]}) == len(board["panels"]), path


# ---- a real Prometheus -------------------------------------------------------------------------------------------
@pytest.fixture
def server_metrics() -> Iterator[MetricsEndpoint]:
    """A server /metrics (servers.metrics) on 127.0.0.1 for a server still joining."""
    endpoint = start_metrics(lambda: a_server_status(ServerState.JOINING), "127.0.0.1", 0)
    yield endpoint
    endpoint.stop()


def prometheus_config(folder: Path, api: str, server: str) -> Path:
    """deploy/prometheus/prometheus.yml, scraping and evaluating every second, with these targets."""
    config = yaml.safe_load((folder / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    targets = {"swarmbatch-api": api, "swarmbatch-servers": server}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    return folder / "prometheus.yml"


def query(url: str, path: str) -> Any:
    """A Prometheus HTTP API answer's data (None while it is starting)."""
    try:
        answer = httpx.get(f"{url}{path}", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return None
    return answer.get("data")


def wait_until(check: Callable[[], Any], what: str, process: ManagedProcess, within: float = 30) -> Any:
    deadline = time.monotonic() + within
    while not (found := check()):
        assert process.proc.poll() is None, f"prometheus exited; see {process.log_path}"
        assert time.monotonic() < deadline, f"{what} within {within:.0f} s; see {process.log_path}"
        time.sleep(0.3)
    return found


@pytest.mark.swarm  # runs prometheus
def test_a_real_prometheus_scrapes_the_api_and_a_server_and_evaluates_the_rules(
        make_runtime: Callable[..., Runtime], serve: Callable[[Runtime], str], server_metrics: MetricsEndpoint,
        tmp_path: Path) -> None:
    binary = debian_tool("prometheus")
    api = serve(make_runtime()).removeprefix("http://")
    config = prometheus_config(prometheus_dir_copy(tmp_path / "prometheus"), api,
                               server_metrics.url.removeprefix("http://").removesuffix("/metrics"))
    url = f"http://127.0.0.1:{free_port()}"
    prometheus = ManagedProcess([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address={url.removeprefix('http://')}"], name="prometheus",
                                log_dir=tmp_path)
    try:
        def targets_up() -> bool:
            data = query(url, "/api/v1/targets")
            return bool(data) and sorted(t["health"] for t in data["activeTargets"]) == ["up", "up"]

        def pending() -> set[str]:
            data = query(url, "/api/v1/alerts")
            return {a["labels"]["alertname"] for a in (data or {}).get("alerts", []) if a["state"] == "pending"}

        wait_until(targets_up, "both targets up", prometheus)
        # a new store has no live worker, and the server is still joining: both rules hold, for less than their `for`
        wait_until(lambda: {"SwarmbatchNoWorkerAlive", "SwarmbatchServerNotOnline"} <= pending(), "the alerts pending",
                   prometheus)
        rules = [rule for group in query(url, "/api/v1/rules")["groups"] for rule in group["rules"]]
        assert len(rules) == len(alert_rules()) and all(rule["health"] == "ok" for rule in rules), rules
    finally:
        prometheus.terminate()
