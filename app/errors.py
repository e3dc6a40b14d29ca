"""One JSON error envelope for every failure, and the one table that maps error kinds to HTTP statuses.

Every error leaves the server as ``{"error": {"type": <kind>, "message": str, "details": {...}}}``:
domain errors (``retrieval.errors``), request validation, routing (404/405), body limits (413) and
unexpected exceptions (500, without internals). Clients switch on ``type``, never on the text.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DataError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from rubricsearch.retrieval.errors import RubricSearchError, disk_full

log = logging.getLogger("rubricsearch.api")

# The single kind -> status table. Domain kinds come from retrieval/errors.py; the others name
# failures the HTTP layer itself detects.
STATUS_BY_KIND: dict[str, int] = {
    "invalid_input": 400,
    "invalid_image": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "method_not_allowed": 405,
    "not_acceptable": 406,
    "request_timeout": 408,
    "conflict": 409,
    "package_mismatch": 409,
    "payload_too_large": 413,
    "unsupported_media_type": 415,
    "validation_error": 422,
    "invalid_metadata": 422,
    "rate_limited": 429,
    "header_too_large": 431,
    "internal_error": 500,
    "missing_extra": 501,
    "backend_unavailable": 503,
    "overloaded": 503,
    "insufficient_storage": 507,
}
_KIND_BY_STATUS: dict[int, str] = {}
for _kind, _status in STATUS_BY_KIND.items():
    _KIND_BY_STATUS.setdefault(_status, _kind)

SAFE_INTERNAL_MESSAGE = "internal server error; the incident was logged"
DISK_FULL_MESSAGE = ("the server's disk is full: this change needs space; free some (deleting images or sets still "
                     "works) and retry")
CLIENT_CLOSED_REQUEST = 499  # never sent: the status the metrics and access log record for a vanished client
DB_INT_MAX = 2**63 - 1  # catalog ids and cursors are signed 64-bit integers (SQLite and PostgreSQL bigint)


class BodyTooLarge(StarletteHTTPException):
    """An HTTPException, so FastAPI's body reader re-raises it instead of answering a generic 400."""

    def __init__(self, limit: int, message: str | None = None) -> None:
        super().__init__(413, message or f"request body exceeds the limit of {limit} bytes")
        self.limit = limit


def status_for_kind(kind: str) -> int:
    return STATUS_BY_KIND.get(kind, 500)


def status_for(exc: RubricSearchError) -> int:
    """The status of a domain error; a subclass with an unlisted kind inherits its parent's status."""
    for cls in type(exc).__mro__:
        kind = getattr(cls, "kind", None)
        if isinstance(kind, str) and kind in STATUS_BY_KIND:
            return STATUS_BY_KIND[kind]
    return 500


def kind_for_status(status: int) -> str:
    if status in _KIND_BY_STATUS:
        return _KIND_BY_STATUS[status]
    return "invalid_input" if 400 <= status < 500 else "internal_error"


def error_body(kind: str, message: str, details: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {"error": {"type": kind, "message": message, "details": _jsonable(dict(details or {}))}}


def error_response(
    kind: str,
    message: str,
    details: Mapping[str, Any] | None = None,
    *,
    status: int | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(kind, message, details),
        status_code=status if status is not None else status_for_kind(kind),
        headers=dict(headers or {}),
    )


def _jsonable(value: Any) -> Any:
    """Details must serialise whatever a raiser put in them (paths, tuples, exceptions)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    return str(value)


def _headers_for(kind: str, details: Mapping[str, Any]) -> dict[str, str]:
    if kind == "unauthorized":
        return {"WWW-Authenticate": "Bearer"}
    if kind in ("rate_limited", "overloaded", "backend_unavailable") and "retry_after_s" in details:
        return {"Retry-After": str(max(1, int(float(details["retry_after_s"]) + 0.999)))}
    return {}


async def _domain_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RubricSearchError)
    status = status_for(exc)
    if status >= 500:
        log.warning("%s %s -> %s (%s): %s", request.method, request.url.path, status, exc.kind, exc.message)
    return error_response(exc.kind, exc.message, exc.details, status=status,
                          headers=_headers_for(exc.kind, exc.details))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = kind_for_status(exc.status_code)
    if exc.status_code == 404 and exc.detail in (None, "Not Found"):
        message = f"no route for {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail) if exc.detail else kind.replace("_", " ")
    headers = dict(exc.headers or {})
    headers.update(_headers_for(kind, {}))
    details = {"limit": exc.limit} if isinstance(exc, BodyTooLarge) else None
    return error_response(kind, message, details, status=exc.status_code, headers=headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """422 with pydantic's locations and messages; never the offending input (it may be huge or secret)."""
    assert isinstance(exc, RequestValidationError)
    errors = [
        {"loc": [str(p) for p in err.get("loc", ())], "msg": _message(err), "type": str(err.get("type", ""))}
        for err in exc.errors()[:50]
    ]
    first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
    where = ".".join(p for p in first["loc"] if p != "body") or "request"
    return error_response("validation_error", f"{where}: {first['msg']}", {"errors": errors})


def _message(err: Mapping[str, Any]) -> str:
    """pydantic's message; for malformed JSON the parser's own reason (FastAPI says only "JSON decode error")."""
    ctx = err.get("ctx")
    if err.get("type") == "json_invalid" and isinstance(ctx, Mapping) and ctx.get("error"):
        return f"invalid JSON: {ctx['error']}"
    return str(err.get("msg", "")).removeprefix("Value error, ")


async def _too_deep(request: Request, exc: Exception) -> JSONResponse:
    """JSON nested deeper than the parser's recursion limit is malformed input, not a server fault."""
    return error_response("validation_error", "the request body is nested deeper than the JSON parser allows")


async def _out_of_range(request: Request, exc: Exception) -> JSONResponse:
    """A number too large for the catalog's 64-bit integers (a safety net: the schemas bound them)."""
    return error_response("invalid_input", "a number in the request is out of range", {"max": DB_INT_MAX})


async def _unstorable(request: Request, exc: Exception) -> JSONResponse:
    """A value the database refuses to compare or store, e.g. a NUL character in a name or id on PostgreSQL
    (a safety net: stored strings are NUL-free in the schemas). The database's text is not echoed."""
    log.warning("%s %s: the database refused a value: %s", request.method, request.url.path,
                str(getattr(exc, "orig", exc)).splitlines()[0][:200])
    return error_response("invalid_input", "a value in the request cannot be stored or looked up "
                          "(NUL characters and out-of-range numbers are refused)")


async def _storage_error(request: Request, exc: Exception) -> JSONResponse:
    """A full disk (or database storage) is a state, not a fault: 507, and deletes still work to free space."""
    if disk_full(exc):
        log.warning("%s %s -> 507: the disk is full (%s)", request.method, request.url.path, exc)
        return error_response("insufficient_storage", DISK_FULL_MESSAGE)
    return await _unexpected(request, exc)


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client hung up before its request was read: nothing to answer, and no fault of the server (499, as
    nginx logs it; not a 500 in the metrics)."""
    log.info("%s %s: the client disconnected before the request was read", request.method, request.url.path)
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response("internal_error", SAFE_INTERNAL_MESSAGE)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RubricSearchError, _domain_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(RecursionError, _too_deep)
    app.add_exception_handler(OverflowError, _out_of_range)
    app.add_exception_handler(DataError, _unstorable)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.add_exception_handler(OSError, _storage_error)
    app.add_exception_handler(OperationalError, _storage_error)
    app.add_exception_handler(Exception, _unexpected)
