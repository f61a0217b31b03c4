"""Batch-job commands through typer's runner: on the embedded store, and through the REST API with --api."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from jobs_support import check_lines
from ports import free_port
from typer.testing import CliRunner

import cli
from commands.errors import ExitCode
from jobs import store
from jobs.assembly import build_runtime, set_runtime
from jobs.models import ApiKey
from jobs.runtime import Runtime
from jobs.settings import get_settings
from launch.processes import cli_command

runner = CliRunner()
GOOD = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hello", "max_tokens": 4}}


@pytest.fixture
def embedded_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """SWARMBATCH_HOME in a temp dir: the CLI's own runtime uses the embedded SQLite store and broker."""
    monkeypatch.setenv("SWARMBATCH_HOME", str(tmp_path / "home"))
    for name in ("SWARMBATCH_DATABASE_URL", "SWARMBATCH_BROKER_URL", "SWARMBATCH_API_URL", "SWARMBATCH_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    get_settings.cache_clear()
    set_runtime(None)
    yield tmp_path / "home"
    get_settings.cache_clear()
    set_runtime(None)


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(cli.app, list(args))
    return result.exit_code, result.stdout, result.stderr


def write_batch(path: Path, *lines: object) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_db_upgrade_creates_the_embedded_store(embedded_home: Path) -> None:
    code, out, _ = invoke("db", "upgrade")
    assert code == 0 and "head" in out and (embedded_home / "swarmbatch.sqlite").exists()


def test_submit_status_jobs_cancel_and_results_on_the_embedded_store(embedded_home: Path, tiny_model: Path,
                                                                     tmp_path: Path) -> None:
    batch = write_batch(tmp_path / "in.jsonl", GOOD, "{oops", {**GOOD, "custom_id": "b"})
    code, out, err = invoke("submit", str(batch), "--model", str(tiny_model), "--json")
    assert code == 0, err
    job = json.loads(out)
    assert job["status"] == "validating" and job["request_counts"] == {"total": 2, "completed": 0, "failed": 0}
    code, out, _ = invoke("status", job["id"])
    assert code == 0 and job["id"] in out and "validating" in out and "1 bad input lines" in out
    code, out, _ = invoke("jobs", "--json")
    assert [j["id"] for j in json.loads(out)["data"]] == [job["id"]]
    code, out, _ = invoke("cancel", job["id"], "--json")
    assert code == 0 and json.loads(out)["status"] == "cancelled"
    code, out, _ = invoke("results", job["id"], "--errors", "-o", str(tmp_path / "errors.jsonl"))
    errors = [json.loads(line) for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert code == 0 and [(e["error"]["line"], e["error"]["code"]) for e in errors] == \
        [(2, "invalid_json"), (1, "batch_cancelled"), (3, "batch_cancelled")]


def finish_all(job_id: str) -> None:
    """As a worker would: claim every request of the job, complete it, and settle the job (it completes)."""
    from jobs.assembly import get_runtime
    from jobs.models import RequestStatus

    runtime = get_runtime()
    with runtime.session() as session:
        token, rows = store.claim_requests(session=session, job_id=job_id, worker="test", limit=10, lease_seconds=60,
                                           max_attempts=5)
        for row in rows:
            store.finish_request(session=session, request_id=row.id, token=token, status=RequestStatus.completed,
                                 generated=[5, 6], finish_reason="length", output_text="out")
        runtime.lifecycle.settle(session, store.get_job(session=session, job_id=job_id))
        session.commit()


def cancel(job_id: str) -> None:
    from jobs.assembly import get_runtime

    runtime = get_runtime()
    with runtime.session() as session:
        runtime.lifecycle.cancel(session, job_id)
        session.commit()


@pytest.mark.parametrize(("end", "code", "status"), [(finish_all, ExitCode.OK, "completed"),
                                                     (cancel, ExitCode.JOB_FAILED, "cancelled")],
                         ids=["completed", "cancelled"])
def test_status_watch_waits_for_the_job_to_end_and_exits_0_only_if_it_completed(
        embedded_home: Path, tiny_model: Path, tmp_path: Path, end: Callable[[str], None], code: int,
        status: str) -> None:
    # Given a job that no worker runs yet
    batch = write_batch(tmp_path / "in.jsonl", GOOD, {**GOOD, "custom_id": "b"})
    job_id = invoke("submit", str(batch), "--model", str(tiny_model))[1].strip()
    # When it is watched, and ends (as a worker, or a cancel, would end it) while the watch waits
    ender = threading.Timer(1.5, end, args=[job_id])
    ender.start()
    began = time.monotonic()
    try:
        exit_code, out, err = invoke("status", job_id, "--watch", "--json")
    finally:
        ender.join()
    # Then the watch returned once it ended, printed the job, and its exit code says how it ended
    assert exit_code == code, err
    assert json.loads(out)["status"] == status and time.monotonic() - began >= 1.5


def test_a_file_without_a_good_line_is_refused_with_one_line(embedded_home: Path, tiny_model: Path,
                                                             tmp_path: Path) -> None:
    code, _, err = invoke("submit", str(write_batch(tmp_path / "bad.jsonl", "{oops")), "--model", str(tiny_model))
    assert code == ExitCode.USAGE and err.startswith("Error: InvalidJob:") and len(err.strip().splitlines()) == 1
    assert json.loads(invoke("jobs", "--json")[1])["data"] == []


def test_an_unknown_job_is_a_usage_error(embedded_home: Path) -> None:
    code, _, err = invoke("status", "batch_nope")
    assert code == ExitCode.USAGE and "JobNotFound" in err


def test_an_unreachable_database_exits_3(embedded_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMBATCH_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:1/nothing")
    get_settings.cache_clear()
    code, _, err = invoke("status", "batch_x")
    assert code == ExitCode.STORE_UNREACHABLE and err.startswith("Error: StoreUnavailable:")


@pytest.mark.swarm  # real CLI processes
@pytest.mark.parametrize("command", [["status", "batch_x"], ["keys", "create", "alice"], ["db", "upgrade"], ["beat"]],
                         ids=" ".join)
def test_a_command_on_an_unreachable_database_exits_3_with_one_line_naming_it_without_its_password(
        tmp_path: Path, command: list[str]) -> None:
    # a real process: what a user sees on stderr, log lines included; beat and the servers would run forever
    port = free_port()
    env = {**os.environ, "SWARMBATCH_HOME": str(tmp_path / "home"),
           "SWARMBATCH_DATABASE_URL": f"postgresql+psycopg2://postgres:sekret@127.0.0.1:{port}/x"}
    for name in ("SWARMBATCH_BROKER_URL", "SWARMBATCH_API_URL", "SWARMBATCH_API_KEY"):
        env.pop(name, None)
    proc = subprocess.run(cli_command(*command), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == ExitCode.STORE_UNREACHABLE, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("Error: ") and f"127.0.0.1:{port}/x" in line and "sekret" not in line


def test_keys_create_on_a_database_that_cannot_be_opened_exits_3_with_one_line(
        embedded_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{embedded_home / 'no' / 'such' / 'dir' / 'x.sqlite'}"
    monkeypatch.setenv("SWARMBATCH_DATABASE_URL", url)
    get_settings.cache_clear()
    code, _, err = invoke("keys", "create", "alice")
    assert code == ExitCode.STORE_UNREACHABLE
    assert err.strip().splitlines() == [f"Error: OperationalError: database {url} is not usable (unable to open "
                                        "database file); start it or fix SWARMBATCH_DATABASE_URL, and migrate it "
                                        "with 'swarmbatch db upgrade'"]


def test_db_upgrade_to_an_unknown_revision_is_a_usage_error_in_one_line(embedded_home: Path) -> None:
    code, _, err = invoke("db", "upgrade", "nosuchrev")
    assert code == ExitCode.USAGE
    assert err.strip().splitlines() == ["Error: CommandError: Can't locate revision identified by 'nosuchrev'"]


def test_submit_with_an_unreachable_broker_exits_3_with_one_line_naming_it(
        embedded_home: Path, monkeypatch: pytest.MonkeyPatch, tiny_model: Path, tmp_path: Path) -> None:
    port = free_port()
    monkeypatch.setenv("SWARMBATCH_BROKER_URL", f"redis://:sekret@127.0.0.1:{port}/0")
    get_settings.cache_clear()
    code, _, err = invoke("submit", str(write_batch(tmp_path / "in.jsonl", GOOD)), "--model", str(tiny_model))
    assert code == ExitCode.STORE_UNREACHABLE
    (line,) = err.strip().splitlines()
    assert line.startswith(f"Error: OperationalError: broker redis://:***@127.0.0.1:{port}/0 is not reachable (")
    assert line.endswith("start it or fix SWARMBATCH_BROKER_URL")


def test_keys_create_prints_a_key_once_and_stores_only_its_hash(embedded_home: Path) -> None:
    code, out, _ = invoke("keys", "create", "alice")
    key = out.strip()
    assert code == 0 and key.startswith("sb-")
    runtime = build_runtime(get_settings())
    with runtime.session() as session:
        row = session.query(ApiKey).one()
        assert row.name == "alice" and row.key_hash == store.hash_key(key) and key not in row.key_hash
    runtime.close()


def test_the_cli_talks_to_the_rest_api_with_a_key(make_runtime: Callable[..., Runtime], redis_url: str,
                                                  serve: Callable[[Runtime], str], tiny_model: Path,
                                                  tmp_path: Path) -> None:
    runtime = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)])
    with runtime.session() as session:
        _, key = store.create_api_key(session=session, name="cli")
        session.commit()
    url = serve(runtime)
    batch = write_batch(tmp_path / "in.jsonl", GOOD)
    code, out, err = invoke("submit", str(batch), "--model", str(tiny_model), "--json", "--api", url, "--key", key)
    assert code == 0, err
    job_id = json.loads(out)["id"]
    check_lines(runtime, job_id)  # what a worker does first with a batch submitted over REST
    code, out, _ = invoke("status", job_id, "--json", "--api", url, "--key", key)
    assert code == 0 and json.loads(out)["request_counts"]["total"] == 1
    code, _, err = invoke("status", job_id, "--api", url, "--key", "sb-wrong")
    assert code == ExitCode.USAGE and "401" in err


def test_keys_list_and_revoke_and_the_revoked_key_gets_401_at_once(embedded_home: Path,
                                                                   serve: Callable[[Runtime], str]) -> None:
    # Given two keys and the API serving the CLI's own store
    alice, bob = (invoke("keys", "create", name)[1].strip() for name in ("alice", "bob"))
    runtime = build_runtime(get_settings())
    url = serve(runtime)
    as_alice = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {alice}"})
    as_bob = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {bob}"})
    assert as_alice.get("/v1/batches").status_code == 200
    code, out, _ = invoke("keys", "list", "--json")
    listed = json.loads(out)
    assert code == 0 and [(k["name"], k["revoked_at"]) for k in listed] == [("alice", None), ("bob", None)]
    assert all(set(k) == {"id", "name", "created_at", "revoked_at"} for k in listed)
    assert alice not in out and store.hash_key(alice) not in out

    # When alice's key is revoked by name
    code, out, _ = invoke("keys", "revoke", "alice")

    # Then her next call, on the same connection, is refused, and bob's key still works
    assert code == 0 and out.startswith(f"key {listed[0]['id']} (alice) revoked at ")
    refused = as_alice.get("/v1/batches")
    assert refused.status_code == 401 and "revoked" in refused.json()["error"]["message"]
    assert as_bob.get("/v1/batches").status_code == 200
    code, out, _ = invoke("keys", "list")
    assert code == 0 and "revoked 20" in out.splitlines()[0] and out.splitlines()[1].endswith("live")
    assert invoke("keys", "revoke", str(listed[1]["id"]))[0] == 0 and as_bob.get("/v1/batches").status_code == 401
    as_alice.close()
    as_bob.close()
    runtime.close()


def test_revoking_an_unknown_key_is_a_usage_error_in_one_line(embedded_home: Path) -> None:
    invoke("keys", "create", "alice")

    code, _, err = invoke("keys", "revoke", "nobody")

    assert code == ExitCode.USAGE
    assert err.strip().splitlines() == ["Error: ApiKeyNotFound: no API key 'nobody'; list them with "
                                        "'swarmbatch keys list'"]


@pytest.mark.parametrize(("status", "error", "code"), [(400, "InvalidJob", 2), (413, "InvalidJob", 2),
                                                       (409, "IdempotencyConflict", 2), (429, "StoreUnavailable", 3),
                                                       (503, "StoreUnavailable", 3)])
def test_an_api_error_answer_becomes_the_error_and_exit_code_it_means(status: int, error: str, code: int) -> None:
    from commands.errors import exit_code_for
    from jobs.backends import api_error

    raised = api_error(status, "why")
    assert type(raised).__name__ == error and exit_code_for(raised) == code and f"API answered {status}: why" in str(raised)
