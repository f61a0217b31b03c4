"""Batch-job commands through typer's runner: on the embedded store, and through the REST API with --api."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

import cli
from jobs import store
from jobs.models import ApiKey
from jobs.runtime import Runtime, set_runtime
from jobs.settings import get_settings

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
    assert job["status"] == "queued" and job["request_counts"] == {"total": 2, "completed": 0, "failed": 0}
    code, out, _ = invoke("status", job["id"])
    assert code == 0 and job["id"] in out and "queued" in out and "1 bad input lines" in out
    code, out, _ = invoke("jobs", "--json")
    assert [j["id"] for j in json.loads(out)["data"]] == [job["id"]]
    code, out, _ = invoke("cancel", job["id"], "--json")
    assert code == 0 and json.loads(out)["status"] == "cancelled"
    code, out, _ = invoke("results", job["id"], "--errors", "-o", str(tmp_path / "errors.jsonl"))
    errors = [json.loads(line) for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert code == 0 and [(e["error"]["line"], e["error"]["code"]) for e in errors] == [(2, "invalid_json")]


def test_a_file_without_a_good_line_is_refused_with_one_line(embedded_home: Path, tiny_model: Path,
                                                             tmp_path: Path) -> None:
    code, _, err = invoke("submit", str(write_batch(tmp_path / "bad.jsonl", "{oops")), "--model", str(tiny_model))
    assert code == cli.EXIT_USAGE and err.startswith("Error: InvalidJob:") and len(err.strip().splitlines()) == 1
    assert json.loads(invoke("jobs", "--json")[1])["data"] == []


def test_an_unknown_job_is_a_usage_error(embedded_home: Path) -> None:
    code, _, err = invoke("status", "batch_nope")
    assert code == cli.EXIT_USAGE and "JobNotFound" in err


def test_an_unreachable_database_exits_3(embedded_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMBATCH_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:1/nothing")
    get_settings.cache_clear()
    code, _, err = invoke("status", "batch_x")
    assert code == cli.EXIT_STORE_UNREACHABLE and err.startswith("Error: StoreUnavailable:")


def test_keys_create_prints_a_key_once_and_stores_only_its_hash(embedded_home: Path) -> None:
    code, out, _ = invoke("keys", "create", "alice")
    key = out.strip()
    assert code == 0 and key.startswith("sb-")
    runtime = Runtime(get_settings())
    with runtime.session() as session:
        row = session.query(ApiKey).one()
        assert row.name == "alice" and row.key_hash == store.hash_key(key) and key not in row.key_hash
    runtime.close()


def test_the_cli_talks_to_the_rest_api_with_a_key(make_runtime: Callable[..., Runtime], redis_url: str,
                                                  serve: Callable[[Runtime], str], tiny_model: Path,
                                                  tmp_path: Path) -> None:
    runtime = make_runtime(broker_url=redis_url)
    with runtime.session() as session:
        _, key = store.create_api_key(session=session, name="cli")
        session.commit()
    url = serve(runtime)
    batch = write_batch(tmp_path / "in.jsonl", GOOD)
    code, out, err = invoke("submit", str(batch), "--model", str(tiny_model), "--json", "--api", url, "--key", key)
    assert code == 0, err
    job_id = json.loads(out)["id"]
    code, out, _ = invoke("status", job_id, "--json", "--api", url, "--key", key)
    assert code == 0 and json.loads(out)["request_counts"]["total"] == 1
    code, _, err = invoke("status", job_id, "--api", url, "--key", "sb-wrong")
    assert code == cli.EXIT_USAGE and "401" in err
