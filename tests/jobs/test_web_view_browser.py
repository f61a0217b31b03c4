"""The web view in a real headless browser: Debian's chromium driven by playwright, against `swarmbatch api` and
`swarmbatch worker` processes on a tiny-model swarm. Screenshots are kept in SWARMBATCH_SCREENSHOTS (a folder), else
in the test's tmp folder; their paths are printed.

Without chromium or playwright the tests skip (CI, where .ci/run installs chromium, fails instead).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from factories import new_key
from jobs_support import start_api
from tiers import process_fixture

from jobs.runtime import Runtime
from launch.local_swarm import LocalSwarm
from launch.local_worker import start_local_worker

CHROMIUM = os.environ.get("SWARMBATCH_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
PROMPTS = [f"Story number {i} begins" for i in range(8)]  # one at a time, 48 tokens each: the bar moves for seconds
LOCAL_SCHEMES = ("data", "blob")


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@process_fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless chromium (Debian's; playwright downloads no browser), closed after the module."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed: pip install -e '.[test]'")
    if CHROMIUM is None:
        _missing("chromium is not installed: apt-get install -y chromium (or set SWARMBATCH_CHROMIUM); "
                 ".ci/run installs it in CI")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield launched
        launched.close()


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("SWARMBATCH_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh browser tab (its own sessionStorage); every URL it requests is kept in `page.requested`, every
    uncaught script error in `page.errors`."""
    context = browser.new_context(viewport={"width": 1280, "height": 820}, accept_downloads=True)
    context.set_default_timeout(90_000)  # a loaded 2-core CI machine: waits are for the worker, not the page
    tab = context.new_page()
    tab.requested = []
    tab.on("request", lambda request: tab.requested.append(request.url))
    tab.errors = []
    tab.on("pageerror", lambda error: tab.errors.append(str(error)))
    yield tab
    context.close()


def shoot(page: Any, folder: Path, name: str) -> Path:
    path = folder / name
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def assert_clean(page: Any) -> None:
    """The page loaded nothing from outside 127.0.0.1 and threw no script error."""
    assert not page.errors, page.errors
    outside = [url for url in page.requested
               if urlsplit(url).scheme not in LOCAL_SCHEMES and urlsplit(url).hostname != "127.0.0.1"]
    assert page.requested and not outside, f"the page loaded from outside: {outside}"



def submit(url: str, key: str, model: str) -> str:
    """A batch of the prompts plus one broken line, uploaded as JSONL; returns its id (the API loads the tokenizer
    first: tens of seconds on a busy machine)."""
    lines = [json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": model, "prompt": p, "max_tokens": 48}}) for i, p in enumerate(PROMPTS)]
    data = "\n".join([*lines[:2], "{broken", *lines[2:]]).encode()
    created = httpx.post(f"{url}/v1/batches", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                         files={"file": ("prompts.jsonl", data)}, data={"model": model})
    assert created.status_code == 200, created.text
    return str(created.json()["id"])


def bar(page: Any, job_id: str) -> tuple[str, int]:
    """The job's row as the page shows it now: (status, requests done per its progress bar)."""
    element = page.locator(f'tr[data-job="{job_id}"] [role=progressbar]')
    return str(element.get_attribute("data-status")), int(element.get_attribute("aria-valuenow") or -1)


def watch_until_completed(page: Any, job_id: str, timeout: float, on_change: Callable[[str, int], None]
                          ) -> list[tuple[str, int]]:
    """Every distinct (status, done) the page's bar showed until the job completed."""
    seen: list[tuple[str, int]] = []
    deadline = time.monotonic() + timeout
    while not seen or seen[-1][0] not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"the page's bar did not reach completed: {seen}"
        now = bar(page, job_id)
        if not seen or now != seen[-1]:
            seen.append(now)
            on_change(*now)
        page.wait_for_timeout(200)
    return seen


def test_a_user_signs_in_sees_a_jobs_bar_move_to_completed_opens_it_and_sees_the_swarm_map(
        make_runtime: Callable[..., Runtime], redis_url: str, shared_swarm: LocalSwarm, tiny_model: Path,
        tmp_path: Path, page: Any, screenshots: Path) -> None:
    # Given `swarmbatch api` on a store, a key, and the page open at /
    runtime = make_runtime(broker_url=redis_url, api_models=[str(tiny_model)])
    api, url = start_api(runtime, tmp_path)
    worker = None
    try:
        key = new_key(runtime, "browser-user")
        page.goto(f"{url}/")
        assert page.url == f"{url}/ui/"
        page.wait_for_selector("#sign-in-form")
        assert page.is_hidden("#nav") and page.is_hidden("#main")  # nothing but the form before signing in
        shoot(page, screenshots, "01-sign-in.png")

        # When a wrong key is tried, Then the page says so and stays on the form
        page.fill("#api-key", "not-a-key")
        page.click("#sign-in-form button")
        page.wait_for_function("document.getElementById('sign-in-error').textContent.includes('unknown API key')")
        assert page.is_hidden("#main")

        # When the user signs in with the key, Then the (empty) list of the key's jobs shows
        page.fill("#api-key", key)
        page.click("#sign-in-form button")
        page.wait_for_selector("text=No jobs yet for this key")
        assert page.is_visible("#nav") and page.is_hidden("#sign-in")

        # When a job is submitted while no worker runs, Then its row shows with an empty bar
        job_id = submit(url, key, str(tiny_model))
        page.wait_for_selector(f'tr[data-job="{job_id}"]')
        assert bar(page, job_id) == ("validating", 0)
        shoot(page, screenshots, "02-jobs-waiting.png")

        # When a worker starts on the tiny model's swarm, Then the bar moves on until the job completes
        settings = runtime.settings.model_copy(update={"initial_peers": shared_swarm.initial_peers,
                                                       "worker_batch_size": 1, "pipeline_lanes": 1,
                                                       # a task per request: each one is counted as it ends
                                                       "continuous_batching": False,
                                                       "sweep_interval": 2.0, "swarm_snapshot_seconds": 1.0})
        worker = start_local_worker(settings, log_dir=tmp_path, name="worker")
        shots = iter(["03-jobs-running.png"])

        def on_change(status: str, done: int) -> None:
            if status == "in_progress" and 0 < done:
                name = next(shots, None)
                if name:
                    shoot(page, screenshots, name)
        seen = watch_until_completed(page, job_id, 240, on_change)
        assert seen[0] == ("validating", 0) and seen[-1] == ("completed", len(PROMPTS)), seen
        done = [count for _, count in seen]
        assert done == sorted(done) and any(0 < count < len(PROMPTS) for count in done), seen  # moved, never back
        row = page.locator(f'tr[data-job="{job_id}"]')
        assert f"{len(PROMPTS)} / {len(PROMPTS)}" in row.inner_text() and "1 line error" in row.inner_text()
        assert "tok/s" in row.inner_text()
        shoot(page, screenshots, "04-jobs-completed.png")

        # When the user opens the job, Then its page shows the line error and offers its output
        page.click(f'tr[data-job="{job_id}"] a')
        page.wait_for_selector(f"h1:has-text('Job {job_id}')")
        errors = page.locator("#errors tbody tr")
        assert errors.count() == 1 and "3" in errors.nth(0).inner_text() and "invalid_json" in errors.nth(0).inner_text()
        shoot(page, screenshots, "05-job.png")
        with page.expect_download() as download:
            page.click("#download-output")
        saved = screenshots / "output.jsonl"
        download.value.save_as(str(saved))
        outputs = [json.loads(x) for x in saved.read_text().splitlines()]
        assert [o["custom_id"] for o in outputs] == [f"req-{i}" for i in range(len(PROMPTS))]

        # When the user opens the swarm page, Then the map shows the two servers the worker saw, all blocks covered
        page.click("nav a[data-view=swarm]")
        page.wait_for_selector("table.grid tr[data-peer]")
        peers = page.locator("table.grid tr[data-peer]")
        assert {peers.nth(i).get_attribute("data-peer") for i in range(peers.count())} == \
            {server.peer_id for server in shared_swarm.servers}
        assert page.locator("table.grid td.cell.online").count() == 6  # 6 blocks, each held by one server
        assert page.locator("table.grid td.cell.missing").count() == 0
        assert "All blocks are served." in page.inner_text("table.grid")
        shoot(page, screenshots, "06-swarm.png")

        # When the user signs out, Then the form is back and the tab holds no key
        page.click("#sign-out")
        assert page.is_visible("#sign-in-form") and page.evaluate("sessionStorage.length") == 0
        assert_clean(page)
    finally:
        if worker is not None:
            worker.terminate()
        api.terminate()


def test_the_api_docs_render_from_local_assets(make_runtime: Callable[..., Runtime], redis_url: str,
                                               serve: Callable[[Runtime], str], page: Any, screenshots: Path) -> None:
    url = serve(make_runtime(broker_url=redis_url))

    page.goto(f"{url}/docs")
    page.wait_for_selector(".swagger-ui .info .title:has-text('swarmbatch')")
    page.wait_for_selector(".opblock-summary-path:has-text('/v1/swarm')")
    shoot(page, screenshots, "07-docs.png")

    assert_clean(page)
