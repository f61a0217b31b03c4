"""The web view's HTTP side, without a browser: the redirect, the pages' assets (all local), the swarm snapshot that
workers publish and `GET /v1/swarm` serves, and what one key can see. A real uvicorn on 127.0.0.1, a real store."""
from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urljoin

import httpx
import pytest
from factories import new_key

from jobs import snapshots
from jobs.api import ui
from jobs.runtime import Runtime

# src= and href= attributes, and url(...) in styles: everything a page makes the browser load or link to
ASSET = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']|url\(\s*['"]?([^'")]+)""")
PAGES = ["/ui/", "/docs"]


def report(model_id: str, peers: list[str]) -> dict[str, object]:
    """A coverage report as swarmclient.coverage makes it: two blocks, each held by every one of `peers`."""
    servers = [{"peer_id": p, "state": "online", "start": 0, "end": 2, "throughput": 12.5, "cache_tokens_left": 4096,
                "version": "swarmbatch/3", "compatible": True, "member": True} for p in peers]
    return {"model_id": model_id, "num_blocks": 2, "blocks": [{"index": i, "servers": servers} for i in range(2)],
            "missing": [] if peers else [[0, 2]], "complete": bool(peers)}


def publish(runtime: Runtime, model: str, worker: str, body: dict[str, object], now: datetime | None = None) -> None:
    with runtime.session() as session:
        snapshots.publish_snapshot(session=session, model=model, worker=worker, report=body, now=now)
        session.commit()



@pytest.fixture
def runtime(make_runtime: Callable[..., Runtime], redis_url: str, tiny_model: Path) -> Runtime:
    """SQLite store, real Redis broker; the API serves the tiny model."""
    return make_runtime(broker_url=redis_url, api_models=[str(tiny_model)])


@pytest.fixture
def base_url(serve: Callable[[Runtime], str], runtime: Runtime) -> str:
    return serve(runtime)


@pytest.fixture
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=30) as client:
        yield client


def test_the_root_and_ui_redirect_to_the_web_view_page(http: httpx.Client) -> None:
    for path in ("/", "/ui"):
        answer = http.get(path)
        assert answer.status_code == 307 and urljoin(f"{http.base_url}{path}", answer.headers["location"]) \
            == f"{http.base_url}/ui/"
    page = http.get("/", follow_redirects=True)
    assert page.status_code == 200 and page.url.path == "/ui/" and page.headers["content-type"].startswith("text/html")
    assert 'id="sign-in-form"' in page.text and 'src="static/app.js"' in page.text


@pytest.mark.parametrize("path", PAGES)
def test_each_page_loads_only_assets_the_api_serves_itself(http: httpx.Client, path: str) -> None:
    # Given a page of the web view or of the API docs
    page = http.get(path)
    assert page.status_code == 200
    # When every asset it references is collected, from the page and from its own stylesheets
    pages = [(f"{http.base_url}{path}", page.text)]
    seen: dict[str, int] = {}
    while pages:
        where, text = pages.pop()
        for match in ASSET.finditer(text):
            reference = match.group(1) or match.group(2)
            if reference.startswith(("data:", "#")):
                continue
            # Then none is on another host, and each one answers 200 here
            assert not re.match(r"^(https?:)?//", reference), f"{path} loads {reference} from outside"
            url = urljoin(where, reference)
            if url not in seen:
                answer = http.get(url, follow_redirects=True)
                seen[url] = answer.status_code
                if url.endswith(".css"):
                    pages.append((url, answer.text))
    assert seen and all(code == 200 for code in seen.values()), seen


def test_redoc_is_not_served_since_its_page_loads_a_logo_from_outside(http: httpx.Client) -> None:
    assert http.get("/redoc").status_code == 404 and http.get("/openapi.json").status_code == 200


def test_the_web_views_script_calls_no_other_host(http: httpx.Client) -> None:
    script = http.get("/ui/static/app.js")

    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert not re.search(r"https?://", script.text)
    assert 'new URL("../v1/", location.href)' in script.text  # the API beside the page, also behind a path prefix


def test_the_swarm_route_serves_the_newest_snapshot_of_each_served_model_only(
        runtime: Runtime, http: httpx.Client, tiny_model: Path) -> None:
    # Given snapshots of the served model, the first replaced by a newer one from another worker, and of a model
    # the API does not serve
    served, key = str(tiny_model), new_key(runtime, "viewer")
    taken = datetime.now(UTC) - timedelta(seconds=30)
    publish(runtime, served, "host:1", report("tiny@r1", ["peerA"]), now=taken - timedelta(seconds=60))
    publish(runtime, served, "host:2", report("tiny@r1", ["peerA", "peerB"]), now=taken)
    publish(runtime, "/srv/private-model", "host:1", report("secret@r1", ["peerC"]))

    # When a key reads GET /v1/swarm
    answer = http.get("/v1/swarm", headers={"Authorization": f"Bearer {key}"})

    # Then it gets the served model's newest snapshot, who took it and how old it is, and nothing of the other model
    assert answer.status_code == 200
    body = answer.json()
    assert body["object"] == "list" and body["models"] == [served] and len(body["data"]) == 1
    [snapshot] = body["data"]
    assert (snapshot["model"], snapshot["worker"], snapshot["model_id"], snapshot["taken_at"]) == (
        served, "host:2", "tiny@r1", int(taken.timestamp()))
    assert 29 <= snapshot["age_seconds"] < 60
    assert [[s["peer_id"] for s in block["servers"]] for block in snapshot["blocks"]] == [["peerA", "peerB"]] * 2
    assert "secret" not in answer.text and "private-model" not in answer.text


def test_the_swarm_route_lists_the_served_models_before_any_worker_has_looked(runtime: Runtime,
                                                                             http: httpx.Client) -> None:
    answer = http.get("/v1/swarm", headers={"Authorization": f"Bearer {new_key(runtime, 'viewer')}"})

    assert answer.status_code == 200 and answer.json()["data"] == [] and answer.json()["models"] == runtime.settings.api_models


def test_the_swarm_route_refuses_a_caller_without_a_valid_key(runtime: Runtime, http: httpx.Client,
                                                             tiny_model: Path) -> None:
    publish(runtime, str(tiny_model), "host:1", report("tiny@r1", ["peerA"]))

    for headers in ({}, {"Authorization": "Bearer not-a-key"}):
        answer = http.get("/v1/swarm", headers=headers)
        assert answer.status_code == 401 and "peerA" not in answer.text
        assert "swarmbatch keys create" in answer.json()["error"]["message"]


def test_a_key_sees_only_its_own_jobs_where_the_web_view_reads_them(runtime: Runtime, http: httpx.Client,
                                                                  tiny_model: Path) -> None:
    # Given a job submitted with one key
    owner, other = new_key(runtime, "owner"), new_key(runtime, "other")
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/completions",
              "body": {"model": str(tiny_model), "prompt": "Hello", "max_tokens": 2}}]
    created = http.post("/v1/batches", headers={"Authorization": f"Bearer {owner}"},
                        files={"file": ("in.jsonl", "\n".join(json.dumps(x) for x in lines).encode())},
                        data={"model": str(tiny_model)})
    assert created.status_code == 200, created.text
    job_id = created.json()["id"]

    # When each key reads what the web view reads: the listing, the job, its errors and results
    def read(key: str) -> list[httpx.Response]:
        headers = {"Authorization": f"Bearer {key}"}
        return [http.get(path, headers=headers) for path in (
            "/v1/batches", f"/v1/batches/{job_id}", f"/v1/batches/{job_id}/errors", f"/v1/batches/{job_id}/results")]

    # Then the owner sees the job, and the other key neither lists it nor opens it
    listing, job, errors, results = read(owner)
    assert [j["id"] for j in listing.json()["data"]] == [job_id] and job.json()["id"] == job_id
    assert errors.status_code == results.status_code == 200
    listing, *opened = read(other)
    assert listing.status_code == 200 and listing.json()["data"] == []
    assert [answer.status_code for answer in opened] == [404, 404, 404]


def test_a_snapshot_is_due_only_once_the_interval_has_passed(runtime: Runtime) -> None:
    # Given a model no worker has published yet
    now = datetime.now(UTC)
    with runtime.session() as session:
        assert snapshots.snapshot_due(session=session, model="m", interval=10, now=now)
    # When a worker publishes it
    publish(runtime, "m", "host:1", report("m@r", ["peerA"]), now=now)
    # Then it is not due again within the interval, and is after it
    with runtime.session() as session:
        assert not snapshots.snapshot_due(session=session, model="m", interval=10, now=now + timedelta(seconds=9))
        assert snapshots.snapshot_due(session=session, model="m", interval=10, now=now + timedelta(seconds=10))


def test_the_web_views_files_are_package_data_so_a_non_editable_install_serves_them() -> None:
    pyproject = tomllib.loads((Path(ui.__file__).parents[3] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["jobs.api.ui"]
    files = [path.relative_to(ui.STATIC.parent) for path in ui.STATIC.iterdir()]

    assert {path.name for path in files} == {"index.html", "app.js", "app.css"}
    assert all(any(path.match(glob) for glob in globs) for path in files), (files, globs)
