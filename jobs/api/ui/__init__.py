"""The web view at `/ui/`: plain HTML, one vanilla JavaScript file and one stylesheet in static/ (package data; no
build step, nothing fetched from the internet). The page signs in with an API key (kept in the browser's
sessionStorage) and reads the existing REST routes with it as the Bearer header: the key's jobs with live progress
(`GET /v1/batches`), a job's line errors and output (`/v1/batches/{id}`, `/errors`, `/results`), and the swarm map
the workers last published (`GET /v1/swarm`). `/` and `/ui` redirect to `/ui/`.

    static/index.html   the page: sign-in form, navigation, one <main> the script fills
    static/app.js       hash routes #/jobs, #/jobs/ID, #/swarm; polling; DOM built with textContent only
    static/app.css      the look
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"


def add_ui(app: FastAPI) -> None:
    """Serve the web view: /ui/ (the page), /ui/static/* (its script and style), and redirects from / and /ui."""
    app.mount("/ui/static", StaticFiles(directory=STATIC), name="ui-static")

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("ui/", status_code=307)

    @app.get("/ui", include_in_schema=False)
    def ui_without_slash() -> RedirectResponse:
        return RedirectResponse("ui/", status_code=307)

    @app.get("/ui/", include_in_schema=False)
    def ui() -> FileResponse:
        # no-cache: a browser revalidates the page (ETag), so an upgraded API never runs with an old script
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})
