"""`/docs` (Swagger UI) and `/redoc` with their scripts and styles served by the API itself, so both work on a
network without the internet (FastAPI's defaults load them from a CDN). The files come from the `fastapi-offline`
package (Swagger UI: Apache-2.0; ReDoc: MIT), read from its installed folder; nothing here fetches anything."""
from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = Path(fastapi_offline.__file__).parent / "static"
ASSETS_URL = "/docs-assets"


def add_docs(app: FastAPI) -> None:
    """Serve /docs, /docs/oauth2-redirect and /redoc from local assets; the app must be made with docs_url=None and
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

    @app.get("/redoc", include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(openapi_url=root + openapi_url, title=f"{title} - ReDoc",
                              redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
                              redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png", with_google_fonts=False)
