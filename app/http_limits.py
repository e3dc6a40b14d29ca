"""Limits of the HTTP layer: header size, count and read deadline per connection, body read timeout and the
number of requests in flight.

uvicorn bounds none of the first three (it held an oversized header section, any number of header fields and
silent sockets open), so
:func:`server_config` runs it with :class:`LimitedHttpProtocol`, httptools' protocol with those checks: a request
whose header section grows past :data:`MAX_HEADER_BYTES` or :data:`MAX_HEADERS` is answered 431, one whose headers
are not complete :data:`HEADER_TIMEOUT_S` after its first byte (or after the connection opened) 408, and the
connection is closed. :class:`RequestLimitMiddleware` bounds the body (:data:`BODY_TIMEOUT_S` without a byte while
the body is still coming: 408) and the requests being handled at once (over
MAX_CONCURRENT_REQUESTS: 503 ``overloaded`` with Retry-After). A reverse proxy in front
should bound the same (docs/hardening.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import uvicorn
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rubricsearch.app.errors import error_body, error_response
from rubricsearch.app.settings import Settings

# The API's requests carry about ten header fields in a few hundred bytes; these bounds leave room for proxies'
# and browsers' additions while refusing the 64 MiB / 100,000-header sections uvicorn would hold.
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 100
# Any client sends its headers within a second of its first byte; one taking longer is holding a connection.
HEADER_TIMEOUT_S = 10.0
# A pause between body bytes, not the upload's length: a slow link still sends a byte within seconds.
BODY_TIMEOUT_S = 30.0
# The largest request body: a request carries images or one zip (its staging is bounded by this); larger
# collections import from a server folder or from URLs, which stream item by item.
MAX_REQUEST_BYTES = 256 * 1024 * 1024
# Requests handled at once, event streams included; more get 503 `overloaded` with Retry-After. Far above what the
# models serve at once (admission control refuses model work earlier), it bounds the threads and memory requests hold.
MAX_CONCURRENT_REQUESTS = 256
# Open connections uvicorn serves (requests on more get its plain 503): a few per client, with idle keep-alives.
MAX_CONNECTIONS = 1024


class BodyTimeout(StarletteHTTPException):
    """Raised in ``receive``: an HTTPException, so FastAPI's body reader passes it on to the error handlers."""

    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"no request body byte for {seconds:g} s; the connection is closed",
                         headers={"Connection": "close"})


def _raw_response(status: int, reason: str, kind: str, message: str) -> bytes:
    body = json.dumps(error_body(kind, message)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


class LimitedHttpProtocol(HttpToolsProtocol):
    """httptools' protocol with a header deadline and caps on header bytes and count (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_bytes = 0
        self._header_count = self._header_size = 0
        self._headers_done = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._refusal: bytes | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _refuse(self, response: bytes) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.write(response)
            self.transport.close()

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        self._refuse(_raw_response(408, "Request Timeout", "request_timeout",
                                   f"the request headers did not arrive within {HEADER_TIMEOUT_S:g} s"))

    def data_received(self, data: bytes) -> None:
        reading_headers = not self._headers_done
        if reading_headers:
            self._arm()  # also a keep-alive connection's next request
        super().data_received(data)
        if reading_headers and not self._headers_done and not self.transport.is_closing():
            self._header_bytes += len(data)  # the parser holds the partial header section: bound it
            if self._header_bytes > MAX_HEADER_BYTES:
                self._refuse(_too_large(f"the request headers exceed {MAX_HEADER_BYTES} bytes"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = self._header_size = 0
        self._headers_done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._header_size += len(name) + len(value) + 4
        if self._header_count > MAX_HEADERS:
            self._refusal = _too_large(f"the request has more than {MAX_HEADERS} header fields")
        elif self._header_size > MAX_HEADER_BYTES:  # a whole section that came in one read
            self._refusal = _too_large(f"the request headers exceed {MAX_HEADER_BYTES} bytes")
        if self._refusal is not None:
            raise ValueError("header limit")  # the parser stops; uvicorn answers via send_400_response
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self._header_bytes = 0
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        self._headers_done = False  # the connection waits for its next request (uvicorn's keep-alive timer)
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        if self._refusal is not None:
            self._refuse(self._refusal)
            return
        super().send_400_response(msg)


def _too_large(message: str) -> bytes:
    return _raw_response(431, "Request Header Fields Too Large", "header_too_large", message)


class GracefulServer(uvicorn.Server):
    """uvicorn's server that tells the app when it is asked to stop (``stopping``: event streams end then, so the
    graceful shutdown need not wait for them) and exits with status 0 after SIGTERM or SIGINT: a requested stop
    is a clean exit (uvicorn re-raises the signal, so the process died of it, 143)."""

    def __init__(self, config: uvicorn.Config, stopping: threading.Event) -> None:
        super().__init__(config)
        self.stopping = stopping

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.stopping.set()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        inner = super().capture_signals()
        inner.__enter__()
        try:
            yield
        finally:
            self._captured_signals.clear()  # uvicorn's list of signals to raise again on the way out
            inner.__exit__(None, None, None)


def server_config(app: ASGIApp, settings: Settings, *, host: str, port: int, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration with the HTTP limits of ``settings`` (``options``: more uvicorn options)."""
    return uvicorn.Config(app, host=host, port=port, http=LimitedHttpProtocol,
                          limit_concurrency=MAX_CONNECTIONS, **options)


class RequestLimitMiddleware:
    """Requests in flight at most ``max_concurrent`` (503 ``overloaded`` beyond); a request body that stalls for
    ``body_timeout_s`` is 408 (only while the body is still coming: event streams wait on ``receive`` for the
    client's disconnect, which is no body)."""

    def __init__(self, app: ASGIApp, max_concurrent: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_concurrent = max_concurrent
        self.body_timeout_s = body_timeout_s
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_concurrent:
            response = error_response("overloaded", "too many requests in flight; retry shortly",
                                      {"limit": self.max_concurrent, "retry_after_s": 1}, headers={"Retry-After": "1"})
            await response(scope, receive, send)
            return
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                with anyio.fail_after(self.body_timeout_s):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout(self.body_timeout_s) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        self.in_flight += 1
        try:
            await self.app(scope, timed_receive, send)
        finally:
            self.in_flight -= 1
