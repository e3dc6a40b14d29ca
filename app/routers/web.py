"""HTML pages of the web UI: the compare page (``/``), admin sign-in and the admin page (``/admin``).

Pages are rendered on the server only to bootstrap (set list, CSRF token, the test-model banner); all
data changes go through the REST API with the session cookie plus ``X-CSRF-Token``. Every page carries a
strict Content-Security-Policy (no inline script or style), so text that reaches the page cannot run.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from functools import lru_cache
from typing import Annotated, Any

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from rubricsearch.app.auth import (
    FAILED_ATTEMPTS_PER_MINUTE,
    RateLimiter,
    clear_session,
    csrf_token,
    issue_admin_session,
    read_session,
)
from rubricsearch.app.jsonbody import BoundedJsonRoute
from rubricsearch.app.plugins import first, plugins
from rubricsearch.app.services import DEFAULT_TOP_K, DEFAULT_TOP_N, MAX_CRITERIA
from rubricsearch.app.settings import Settings
from rubricsearch.app.state import AppState
from rubricsearch.app.warmup import Warmup
from rubricsearch.indexer.catalog import ImageStatus, count_images, list_sets
from rubricsearch.retrieval.errors import RateLimited
from rubricsearch.web import STATIC_DIR, TEMPLATES_DIR

router = APIRouter(include_in_schema=False, route_class=BoundedJsonRoute)

LOGIN_CSRF_COOKIE = "rs_login_csrf"
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
}

templates = Jinja2Templates(directory=str(TEMPLATES_DIR))
_static = StaticFiles(directory=str(STATIC_DIR))


@lru_cache(maxsize=64)
def _static_version(name: str) -> str:
    """Content hash for cache busting: a changed file gets a new URL, so it may be cached forever."""
    try:
        return hashlib.sha256((STATIC_DIR / name).read_bytes()).hexdigest()[:10]
    except OSError:
        return "0"


def static_url(name: str) -> str:
    return f"/static/{name}?v={_static_version(name)}"


templates.env.globals["static"] = static_url


def _settings(request: Request) -> Settings:
    settings = request.app.state.settings
    assert isinstance(settings, Settings)
    return settings


def _state(request: Request) -> AppState | None:
    state = getattr(request.app.state, "rubricsearch", None)
    return state if isinstance(state, AppState) else None


def render(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    """A page with the shared context (banner flag, CSRF token) and the security headers."""
    state = _state(request)
    warmup = getattr(request.app.state, "warmup", None)
    base: dict[str, Any] = {
        "models_label": state.models_label if state else None,
        "warmup": warmup.progress if state is None and isinstance(warmup, Warmup) else None,
        "csrf_token": csrf_token(request),
        "title": "rubricsearch",
    }
    base.update(context)
    response = templates.TemplateResponse(request, name, base, status_code=status)
    response.headers.update(SECURITY_HEADERS)
    response.headers["Cache-Control"] = "no-store"
    return response


def _set_options(state: AppState | None) -> list[dict[str, Any]]:
    if state is None:
        return []
    with state.catalog.read() as session:
        return [{"id": s.id, "name": s.name, "indexed": count_images(session, s.id)[ImageStatus.INDEXED]}
                for s in list_sets(session)]


@router.get("/", response_class=HTMLResponse)
def compare_page(
    request: Request,
    set_: Annotated[str | None, Query(alias="set", max_length=200)] = None,
    criteria: Annotated[str, Query(max_length=10_000)] = "",
) -> HTMLResponse:
    """The compare page; ``?set=<id or name>&criteria=...`` preselects (links from the admin page, shared URLs)."""
    settings = _settings(request)
    # With search behind a key, set names are not shown to anonymous visitors: the page loads them with the key.
    hide = settings.auth.search_requires_key and read_session(request) is None
    sets = [] if hide else _set_options(_state(request))
    selected = next((s["id"] for s in sets if set_ in (s["id"], s["name"])), None)
    if selected is None:
        selected = next((s["id"] for s in sets if s["indexed"]), sets[0]["id"] if sets else None)
    return render(request, "compare.html", page="compare", title="Compare", sets=sets, selected_set=selected,
                  criteria=criteria, max_criteria=MAX_CRITERIA, default_top_k=DEFAULT_TOP_K,
                  default_top_n=DEFAULT_TOP_N, search_requires_key=settings.auth.search_requires_key,
                  sets_hidden=hide,
                  candidates=[c for plugin in plugins() for c in plugin.compare_candidates(settings.data_dir)])


@router.get("/warmup")
def warmup_status(request: Request) -> dict[str, Any]:
    """What the pages' banner polls while the models are being prepared (a 200, so polling is not an error)."""
    warmup = getattr(request.app.state, "warmup", None)
    ready = _state(request) is not None
    progress = warmup.progress.as_dict() if isinstance(warmup, Warmup) and not ready else None
    return {"ready": ready, "progress": progress,
            "failure": warmup.failure if isinstance(warmup, Warmup) else None}


# -- admin sign-in ------------------------------------------------------------------------------------
def _login_page(request: Request, *, error: str | None = None, status: int = 200) -> HTMLResponse:
    """The sign-in form with a fresh double-submit token (hidden field + SameSite=Strict cookie)."""
    settings = _settings(request)
    token = secrets.token_urlsafe(32)
    response = render(request, "admin_login.html", status, page="admin", title="Admin sign-in", login_csrf=token,
                      error=error, admin_configured=request.app.state.guard.keys.has_admin_keys,
                      key_file=first(lambda plugin: plugin.admin_key_file(settings.data_dir)))
    response.set_cookie(LOGIN_CSRF_COOKIE, token, max_age=3600, httponly=True, samesite="strict",
                        secure=_secure(request, settings), path="/admin")
    return response


def _secure(request: Request, settings: Settings) -> bool:
    return settings.auth.session_cookie_secure or request.url.scheme == "https"


def _login_limiter(request: Request) -> RateLimiter:
    limiter = getattr(request.app.state, "web_login_limiter", None)
    if not isinstance(limiter, RateLimiter):
        limiter = RateLimiter(FAILED_ATTEMPTS_PER_MINUTE, FAILED_ATTEMPTS_PER_MINUTE)
        request.app.state.web_login_limiter = limiter
    return limiter


def _same(a: str | None, b: str | None) -> bool:
    return bool(a) and bool(b) and hmac.compare_digest(str(a).encode(), str(b).encode())


@router.get("/admin", response_class=HTMLResponse)
def admin_page(request: Request) -> HTMLResponse:
    if read_session(request) is None:
        return _login_page(request)
    return render(request, "admin.html", page="admin", title="Admin")


@router.get("/admin/login")
def login_form() -> RedirectResponse:
    return RedirectResponse("/admin", status_code=303)


@router.post("/admin/login", response_model=None)
def login(
    request: Request,
    key: Annotated[str, Form(max_length=4096)] = "",
    csrf: Annotated[str, Form(alias="csrf_token", max_length=256)] = "",
) -> Response:
    """Check an admin key (constant-time, against every configured key) and start a session."""
    if not _same(csrf, request.cookies.get(LOGIN_CSRF_COOKIE)):
        return _login_page(request, error="The sign-in form expired. Please try again.", status=403)
    client = request.client.host if request.client else "unknown"
    try:
        _login_limiter(request).check(f"login:{client}")
    except RateLimited:
        return _login_page(request, error="Too many sign-in attempts. Wait a minute and try again.", status=429)
    keys = request.app.state.guard.keys
    if not keys.has_admin_keys:
        return _login_page(request, error="No admin API key is configured on this server.", status=403)
    principal = keys.identify(key)  # hmac.compare_digest against each configured key
    if principal is None or not principal.is_admin:
        return _login_page(request, error="That is not an admin key.", status=401)
    response = RedirectResponse("/admin", status_code=303)
    issue_admin_session(response, _settings(request), key)
    response.delete_cookie(LOGIN_CSRF_COOKIE, path="/admin")
    return response


@router.post("/admin/logout", response_model=None)
def logout(request: Request, csrf: Annotated[str, Form(alias="csrf_token", max_length=256)] = "") -> Response:
    """End the session; the form's CSRF token must match, so another site cannot sign the admin out."""
    expected = csrf_token(request)
    if expected is not None and not _same(csrf, expected):
        return render(request, "admin.html", 403, page="admin", title="Admin",
                      error="The sign-out form expired; reload the page and try again.")
    response = RedirectResponse("/admin", status_code=303)
    clear_session(response)
    return response


# -- static files ----------------------------------------------------------------------------------------
@router.get("/static/{path:path}", response_model=None)
async def static(request: Request, path: str) -> Response:
    """Static assets (StaticFiles checks the path stays inside web/static); versioned URLs are immutable."""
    try:
        response = await _static.get_response(path, request.scope)
    except HTTPException as exc:  # missing files and paths leaving the folder
        return Response("not found", status_code=exc.status_code, media_type="text/plain")
    if response.status_code == 200:
        versioned = request.query_params.get("v") == _static_version(path)
        response.headers["Cache-Control"] = "public, max-age=31536000, immutable" if versioned else "no-cache"
        response.headers["X-Content-Type-Options"] = "nosniff"
    return response
