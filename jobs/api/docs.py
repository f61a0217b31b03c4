"""`/docs` (Swagger UI) with its script and style served by the API itself, so it works on a network without the
internet (FastAPI's default loads them from a CDN). The files come from the `fastapi-offline` package (MIT; Swagger UI
itself is Apache-2.0), read from its installed folder. There is no `/redoc`: ReDoc's page loads its logo from
cdn.redoc.ly, and the OpenAPI document stays at /openapi.json for any other viewer."""
from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = Path(fastapi_offline.__file__).parent / "static"
ASSETS_URL = "/docs-assets"


def add_docs(app: FastAPI) -> None:
    """Serve /docs and /docs/oauth2-redirect from local assets; the app must be made with docs_url=None and
    redoc_url=None."""
    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"
    title = app.title

    @app.get("/docs", include_in_schema=False)
    def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(openapi_url=root + openapi_url, title=f"{title} - Swagger UI",
                                   oauth2_redirect_url=root + "/docs/oauth2-redirect",
                                   swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
                                   swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
                                   swagger_ui_parameters={"validatorUrl": None})  # no badge from validator.swagger.io

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()
