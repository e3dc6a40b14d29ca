"""``/docs`` (Swagger UI) and ``/redoc`` served offline: their assets come from the ``fastapi-offline``
package (a maintained bundle of swagger-ui and redoc), not a CDN, so the pages work with no network.

Redoc's bundle draws its footer logo from cdn.redoc.ly; the app serves the bundle with that address replaced by
an empty inline image, so the page asks no other host for anything (and the browser reports no blocked load)."""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs-assets"
REDOC_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"
BLANK_IMAGE = "data:image/svg+xml,%3Csvg xmlns=%27http://www.w3.org/2000/svg%27/%3E"
# Pages may load nothing from other hosts: a request an asset would still make is stopped in the browser.
OFFLINE_CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline' blob:; style-src 'self' 'unsafe-inline'; "
               "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'")


def _offline(page: HTMLResponse) -> HTMLResponse:
    page.headers["Content-Security-Policy"] = OFFLINE_CSP
    return page


def install_docs(app: FastAPI) -> None:
    """Mount the assets and the two pages (create the app with ``docs_url=None, redoc_url=None``)."""
    static = files("fastapi_offline") / "static"
    redoc_js = (static / "redoc.standalone.js").read_bytes().replace(REDOC_LOGO.encode(), BLANK_IMAGE.encode())

    @app.get(f"{ASSETS}/redoc.standalone.js", include_in_schema=False)  # before the mount, which would serve it
    def redoc_bundle() -> Response:
        return Response(redoc_js, media_type="text/javascript", headers={"Cache-Control": "public, max-age=3600"})

    app.mount(ASSETS, StaticFiles(directory=str(static)), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"
    title = app.title

    @app.get("/docs", include_in_schema=False)
    def swagger() -> HTMLResponse:
        return _offline(get_swagger_ui_html(
            openapi_url=openapi_url, title=f"{title} - API docs",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js", swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon.png", oauth2_redirect_url="/docs/oauth2-redirect",
            swagger_ui_parameters={"validatorUrl": None},  # no badge request to validator.swagger.io
        ))

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    def swagger_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        return _offline(get_redoc_html(
            openapi_url=openapi_url, title=f"{title} - API reference", redoc_js_url=f"{ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{ASSETS}/favicon.png", with_google_fonts=False))
