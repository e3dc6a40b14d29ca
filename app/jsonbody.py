"""JSON bodies parsed off the event loop, at a cost bounded by the body cap whatever their shape.

``json.loads`` builds a Python object per value: a 24 MiB body of a million unknown keys, or of eight million
empty arrays, costs gigabytes and seconds before any schema sees it, and pydantic then reports every unknown key.
So before parsing, :func:`check_shape` scans the raw bytes and refuses a body with more values (array items and
object members) than ``MAX_JSON_VALUES``, nested deeper than ``MAX_JSON_DEPTH`` or with more than
:data:`MAX_ESCAPES` escapes (the parser decodes them holding the GIL); the scan keeps nothing, skips
strings in bounded steps (the GIL is handed back between them) and stops at the first value over the limit. The
scan, the parse and the validation against the route's body schema run in a worker thread; what reaches validation
is at most ``MAX_JSON_VALUES`` values.

Every router uses :class:`BoundedJsonRoute`, whose requests parse this way (FastAPI's own body reading calls
:meth:`BoundedJsonRequest.json`, which hands FastAPI the validated model, so its own validation on the event loop
only passes the instance through); a route that reads its body itself calls :func:`parse_json`.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

import anyio
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from rubricsearch.app.errors import CLIENT_CLOSED_REQUEST, BodyTooLarge

# Parser work per body, counted by a byte scan before parsing: far above any request the API takes (a search's
# filter, a batch of embedding inputs); RUBRICSEARCH_LIMITS__MAX_JSON_BYTES bounds the body's size.
MAX_JSON_VALUES = 100_000
# No request schema nests deeper than a few levels (a filter's bool clauses); 64 bounds the parser's recursion.
MAX_JSON_DEPTH = 64
MAX_LISTED_ERRORS = 50  # validation errors a 422 lists; a body with more is refused with their count only

_STRUCTURE = re.compile(rb'[\[\]{},"]')
_QUOTE, _OPEN, _CLOSE = ord('"'), b"[{", b"]}"
_WINDOW = 1 << 20  # bytes one C call looks at: the GIL goes back to the event loop between calls
MAX_ESCAPES = 2_000_000  # backslashes in one body: 61 texts of 32,768 characters written as \u escapes


class JsonTooDeep(json.JSONDecodeError):
    """A decode error, so FastAPI's body reader answers it as it answers malformed JSON (422)."""


def _string_end(body: bytes, pos: int) -> int:
    """The index after the quote that closes the string whose inside starts at ``pos`` (``len(body)`` if none).
    Window by window: escaped backslashes, then escaped quotes, are blanked (same length), so the first quote
    left is the closing one; a window that ends inside an escape is resumed at its backslash."""
    end = len(body)
    while pos < end:
        quote = body.find(b'"', pos, pos + _WINDOW)
        if body.find(b"\\", pos, pos + _WINDOW if quote == -1 else quote) == -1:  # no escape: at memchr speed
            if quote != -1:
                return quote + 1
            pos += _WINDOW
            continue
        window = body[pos : pos + _WINDOW]
        blanked = window.replace(b"\\\\", b"\0\0").replace(b'\\"', b"\0\0")
        quote = blanked.find(b'"')
        if quote != -1:
            return pos + quote + 1
        if len(window) < _WINDOW:
            return end
        pos += len(window) - blanked.endswith(b"\\")
    return end


def _count_escapes(body: bytes) -> None:
    """The parser decodes escapes in one C call that holds the GIL, for as long as the escapes it meets (a body
    of them stalls the event loop), so a body may hold at most :data:`MAX_ESCAPES` backslashes, counted window by
    window."""
    escapes = sum(body.count(b"\\", start, start + _WINDOW) for start in range(0, len(body), _WINDOW))
    if escapes > MAX_ESCAPES:
        raise BodyTooLarge(MAX_ESCAPES, f"the JSON body holds {escapes} escape sequences; at most {MAX_ESCAPES} "
                                        "are accepted (send text as UTF-8, not as \\u escapes)")


def check_shape(body: bytes, *, max_values: int, max_depth: int) -> None:
    """Refuse ``body`` if it holds more than ``max_values`` values or nests deeper than ``max_depth`` (the count
    is of commas and openings outside strings, so it never undercounts), or more than :data:`MAX_ESCAPES`
    escapes. Malformed JSON is left to the parser."""
    _count_escapes(body)
    values = depth = 0
    pos, end = 0, len(body)
    find = _STRUCTURE.search
    while pos < end:
        m = find(body, pos, pos + _WINDOW)
        if m is None:
            pos += _WINDOW
            continue
        char = body[m.start()]
        pos = m.end()
        if char == _QUOTE:
            pos = _string_end(body, pos)
            continue
        if char in _OPEN:
            depth += 1
            if depth > max_depth:
                raise JsonTooDeep(f"the body is nested deeper than {max_depth} levels", "", m.start())
        elif char in _CLOSE:
            depth -= 1
            continue
        values += 1
        if values > max_values:
            raise BodyTooLarge(max_values, f"the JSON body holds more than {max_values} values "
                                           "(array items and object members)")


def refuse_many_errors(exc: ValidationError) -> None:
    """Refuse a body with more than :data:`MAX_LISTED_ERRORS` errors without listing them: pydantic builds one
    Python dict per error on request, holding the GIL all the while (a body of unknown keys would stall the
    event loop), so past the limit only the count is reported."""
    count = exc.error_count()
    if count > MAX_LISTED_ERRORS:
        raise StarletteHTTPException(422, f"the body has {count} validation errors (unknown keys or wrong types); "
                                          f"send a body with at most {MAX_LISTED_ERRORS} to have them listed")


class InvalidBody(RequestValidationError, StarletteHTTPException):
    """The body failed the route's schema in the worker thread: answered as FastAPI answers a body that fails
    validation (the ``RequestValidationError`` handler comes first in its class order); an HTTP exception too,
    so FastAPI's body reader lets it through unchanged."""

    def __init__(self, exc: ValidationError) -> None:
        RequestValidationError.__init__(self, [{**e, "loc": ("body", *e["loc"])}
                                               for e in exc.errors(include_url=False)])
        StarletteHTTPException.__init__(self, 422)


def _check_and_load(body: bytes, max_values: int, max_depth: int, schema: TypeAdapter[Any] | None = None) -> Any:
    """``body`` checked, parsed and, with ``schema``, validated as FastAPI validates a body (``from_attributes``):
    then the validated value, which FastAPI's own validation passes through as it is (a model instance is not
    validated again), so nothing of the body is validated on the event loop."""
    check_shape(body, max_values=max_values, max_depth=max_depth)
    value = json.loads(body)
    if schema is None:
        return value
    try:
        return schema.validate_python(value, from_attributes=True)
    except ValidationError as exc:
        refuse_many_errors(exc)
        raise InvalidBody(exc) from None


async def parse_json(request: Request, body: bytes, schema: TypeAdapter[Any] | None = None) -> Any:
    """``body`` checked and parsed in a worker thread, with this module's limits; with ``schema``,
    validated there too (:func:`_check_and_load`)."""
    return await anyio.to_thread.run_sync(_check_and_load, body, MAX_JSON_VALUES, MAX_JSON_DEPTH, schema)


class ClientGone(ClientDisconnect, StarletteHTTPException):
    """The client hung up while FastAPI read the body. FastAPI's body reader turns any error but an HTTP exception
    into a 400, so this is one; the app's ClientDisconnect handler answers it (first in its class order)."""

    def __init__(self) -> None:
        ClientDisconnect.__init__(self)
        StarletteHTTPException.__init__(self, CLIENT_CLOSED_REQUEST)


class BoundedJsonRequest(Request):
    """``json()`` is the body parsed and, where the route has one JSON body parameter, validated: its model; a
    hang-up while the body (JSON or a form) is read is a :class:`ClientGone`."""

    schema: TypeAdapter[Any] | None = None

    async def stream(self) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in super().stream():
                yield chunk
        except ClientDisconnect:
            raise ClientGone() from None

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = await parse_json(self, await self.body(), self.schema)
        return self._json


class BoundedJsonRoute(APIRoute):
    """A route whose request bodies are parsed (and checked against its body schema) by
    :class:`BoundedJsonRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        # FastAPI's own validator of this route's body (a private attribute of its ModelField), where the body is
        # one parameter (several are validated one by one, from the parsed dict, by FastAPI itself)
        field = getattr(self, "body_field", None)
        embed = getattr(getattr(field, "field_info", None), "embed", False)
        single = len(self.dependant.body_params) == 1 and not embed
        schema = getattr(field, "_type_adapter", None) if single else None

        async def bounded(request: Request) -> Response:
            bounded_request = BoundedJsonRequest(request.scope, request.receive)
            bounded_request.schema = schema
            return await handler(bounded_request)

        return bounded
