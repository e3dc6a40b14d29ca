"""API keys and rate limiting.

Admin keys (``Authorization: Bearer <key>``) are required for every mutation. Search-class routes
(search, embeddings, rerank, visual packages) are open unless ``search_requires_key``; then a search
key or an admin key is needed. On open routes an unknown key is ignored, because OpenAI-style clients
always send one (``api_key="EMPTY"``); everywhere else it is a 401. A presented key is compared with
every configured key using ``hmac.compare_digest`` (no early exit, so timing does not tell which key
nearly matched). Keys are never logged: a principal carries only a short hash of its key.

The web UI logs an admin in once (it checks the key, then :func:`issue_admin_session`): a signed
``rs_session`` cookie holds ``{"admin": true, "csrf": token, "kid": fingerprint}``, where the fingerprint is an
HMAC of the admin key that signed in, keyed by the session secret. A session is valid only while that key is
still configured, so rotating or removing a key ends its sessions on the next request. A cookie alone never
authorises a change: a mutation also needs the session's CSRF token in ``X-CSRF-Token`` (or the form field
``csrf_token``), which another site cannot read, so cross-site form posts are refused.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Depends, Request, Response
from fastapi.security import APIKeyCookie, HTTPAuthorizationCredentials, HTTPBearer
from itsdangerous import BadSignature, URLSafeTimedSerializer
from pydantic import SecretStr

from rubricsearch.app.settings import Settings
from rubricsearch.retrieval.errors import Forbidden, RateLimited, Unauthorized

Role = Literal["anonymous", "search", "admin"]

bearer_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="APIKey",
    description="`Authorization: Bearer <key>`. Admin keys for mutations; search keys when search requires one.",
)


@dataclass(frozen=True)
class Principal:
    """Who is calling; ``key_id`` is a short hash of the key, safe to log and to rate-limit on."""

    role: Role
    key_id: str | None = None
    invalid_key: bool = False  # a key was presented but matches none
    session: bool = False  # authenticated by the web UI's session cookie (mutations then need the CSRF token)

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


ANONYMOUS = Principal("anonymous")


def key_id(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:12]


class KeyRing:
    """The configured keys as bytes; :meth:`identify` checks a token against all of them."""

    def __init__(self, admin: Sequence[SecretStr], search: Sequence[SecretStr]) -> None:
        self._admin = [k.get_secret_value().encode() for k in admin]
        self._search = [k.get_secret_value().encode() for k in search]

    @property
    def has_admin_keys(self) -> bool:
        return bool(self._admin)

    def holds_session_key(self, fingerprint: str, secret: bytes) -> bool:
        """Whether ``fingerprint`` (see :func:`session_key_id`) is one of the configured admin keys'."""
        presented = fingerprint.encode()
        found = False
        for key in self._admin:
            found |= hmac.compare_digest(presented, _fingerprint(secret, key).encode())
        return found

    def identify(self, token: str) -> Principal | None:
        presented = token.encode()
        is_admin = False
        is_search = False
        for key in self._admin:
            is_admin |= hmac.compare_digest(presented, key)
        for key in self._search:
            is_search |= hmac.compare_digest(presented, key)
        if is_admin:
            return Principal("admin", key_id(token))
        if is_search:
            return Principal("search", key_id(token))
        return None


class RateLimiter:
    """A token bucket per client: ``burst`` requests at once, refilled at ``per_minute``."""

    def __init__(self, per_minute: int, burst: int, *, max_clients: int = 10_000) -> None:
        self.rate = per_minute / 60.0
        self.burst = float(burst)
        self.max_clients = max_clients
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def check(self, client: str) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.pop(client, (self.burst, now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            allowed = tokens >= 1.0
            self._buckets[client] = (tokens - 1.0 if allowed else tokens, now)
            while len(self._buckets) > self.max_clients:
                self._buckets.popitem(last=False)
        if not allowed:
            wait = (1.0 - tokens) / self.rate
            raise RateLimited("too many requests; slow down", retry_after_s=round(wait, 3),
                              limit_per_minute=round(self.rate * 60))


# Requests a client may make at once before RUBRICSEARCH_AUTH__RATE_LIMIT_PER_MINUTE applies: a page of
# thumbnails or a script's first batch passes, a flood does not.
RATE_LIMIT_BURST = 30
FAILED_ATTEMPTS_PER_MINUTE = 10  # wrong Bearer keys and admin sign-ins, per client address


class Guard:
    """Keys plus limiters, built from settings when the app is created (no lifespan needed)."""

    def __init__(self, settings: Settings) -> None:
        self.keys = KeyRing(settings.auth.admin_api_keys, settings.auth.search_api_keys)
        self.search_requires_key = settings.auth.search_requires_key
        self.limiter = RateLimiter(settings.auth.rate_limit_per_minute, RATE_LIMIT_BURST)
        # Guessing keys costs a slot each: a client that sent too many wrong keys gets 429 for the next ones
        # (a right key still passes), as the admin sign-in form limits its attempts.
        self.failed_keys = RateLimiter(FAILED_ATTEMPTS_PER_MINUTE, FAILED_ATTEMPTS_PER_MINUTE)


# -- admin sessions (web UI) -------------------------------------------------------------------------
SESSION_COOKIE = "rs_session"
# An admin signs in once a working day; the API keys, not the cookie, are the lasting credential.
SESSION_MAX_AGE_S = 12 * 3600
CSRF_HEADER = "X-CSRF-Token"
CSRF_FIELD = "csrf_token"
_SESSION_SALT = "rubricsearch.admin-session"
_PROCESS_SECRET = secrets.token_urlsafe(32)  # without settings.session_secret: sessions end with the process

session_cookie = APIKeyCookie(
    name=SESSION_COOKIE, auto_error=False, scheme_name="AdminSession",
    description=f"Web UI admin session; mutations also need the `{CSRF_HEADER}` header from the page.",
)


def _secret(settings: Settings) -> str:
    return settings.auth.session_secret.get_secret_value() if settings.auth.session_secret else _PROCESS_SECRET


def _serializer(settings: Settings) -> URLSafeTimedSerializer:
    return URLSafeTimedSerializer(_secret(settings), salt=_SESSION_SALT)


def _fingerprint(secret: bytes, key: bytes) -> str:
    """A keyed hash of an admin key: the cookie is signed, not encrypted, so it must not carry a plain hash."""
    return hmac.new(secret, b"session-key:" + key, hashlib.sha256).hexdigest()[:32]


def issue_admin_session(response: Response, settings: Settings, key: str) -> str:
    """Log the browser in as admin with ``key`` (call after checking it is an admin key); returns the CSRF
    token for pages. The session lasts while ``key`` stays configured."""
    csrf = secrets.token_urlsafe(32)
    kid = _fingerprint(_secret(settings).encode(), key.encode())
    value = _serializer(settings).dumps({"admin": True, "csrf": csrf, "kid": kid})
    response.set_cookie(SESSION_COOKIE, value, max_age=SESSION_MAX_AGE_S, httponly=True,
                        samesite="strict", secure=settings.auth.session_cookie_secure, path="/")
    return csrf


def clear_session(response: Response) -> None:
    """Log out: drop the cookie (a copy of it stays valid until it expires, as with any signed cookie)."""
    response.delete_cookie(SESSION_COOKIE, path="/")


def read_session(request: Request) -> dict[str, Any] | None:
    """The valid, unexpired session of this request (``{"admin": True, "csrf": str, "kid": str}``) or ``None``;
    a session of an admin key that is no longer configured is ``None``."""
    raw = request.cookies.get(SESSION_COOKIE)
    if not raw:
        return None
    settings = request.app.state.settings
    try:
        data = _serializer(settings).loads(raw, max_age=SESSION_MAX_AGE_S)
    except BadSignature:  # also SignatureExpired
        return None
    if not isinstance(data, dict) or data.get("admin") is not True or not isinstance(data.get("csrf"), str):
        return None
    kid = data.get("kid")
    if not isinstance(kid, str) or not _guard(request).keys.holds_session_key(kid, _secret(settings).encode()):
        return None
    return data


def csrf_token(request: Request) -> str | None:
    """The CSRF token of the request's session (render it into ``<meta name="csrf-token">``)."""
    session = read_session(request)
    return None if session is None else str(session["csrf"])


async def _presented_csrf(request: Request) -> str | None:
    token = request.headers.get(CSRF_HEADER)
    if token:
        return token
    ctype = request.headers.get("content-type", "")
    if ctype.startswith(("application/x-www-form-urlencoded", "multipart/form-data")):
        value = (await request.form()).get(CSRF_FIELD)  # cached: the route reads the same parsed form
        return value if isinstance(value, str) else None
    return None


def _guard(request: Request) -> Guard:
    guard = request.app.state.guard
    assert isinstance(guard, Guard)
    return guard


def current_principal(
    request: Request,
    credentials: HTTPAuthorizationCredentials | None = Depends(bearer_scheme),
    _cookie: str | None = Depends(session_cookie),
) -> Principal:
    """The caller: a Bearer key wins; else a valid admin session; an unknown key is marked ``invalid_key``."""
    if credentials is None:
        if read_session(request) is not None:
            return Principal("admin", "session", session=True)
        return ANONYMOUS
    guard = _guard(request)
    principal = guard.keys.identify(credentials.credentials)
    if principal is None:
        guard.failed_keys.check(f"key:{request.client.host if request.client else 'unknown'}")
        return Principal("anonymous", invalid_key=True)
    return principal


def _missing_key(principal: Principal, what: str) -> Unauthorized:
    if principal.invalid_key:
        return Unauthorized("invalid API key")
    return Unauthorized(f"{what} is required (Authorization: Bearer <key>)")


async def require_admin(request: Request, principal: Principal = Depends(current_principal)) -> Principal:
    guard = _guard(request)
    if not guard.keys.has_admin_keys:
        raise Forbidden("changes are disabled: no admin API key is configured (set RUBRICSEARCH_AUTH__ADMIN_API_KEYS)")
    if principal.role == "anonymous":
        raise _missing_key(principal, "an admin API key")
    if not principal.is_admin:
        raise Forbidden("this API key may not change data; use an admin key")
    if principal.session:
        expected = csrf_token(request)
        presented = await _presented_csrf(request)
        if expected is None or presented is None or not hmac.compare_digest(presented.encode(), expected.encode()):
            raise Forbidden(f"missing or wrong CSRF token: send the page's token in {CSRF_HEADER}")
    return principal


def require_search(request: Request, principal: Principal = Depends(current_principal)) -> Principal:
    guard = _guard(request)
    if guard.search_requires_key and principal.role == "anonymous":
        raise _missing_key(principal, "an API key")
    if not principal.is_admin:
        client = principal.key_id or f"ip:{request.client.host if request.client else 'unknown'}"
        guard.limiter.check(client)
    return principal
