"""HTTP-layer limits on a real uvicorn server (the product's protocol and middleware, loopback only): oversized or
too many headers are 431, slow or silent headers and stalled bodies are 408 and the connection is closed, requests
over the concurrency limit are 503 with Retry-After, and keep-alive connections and event streams are unaffected."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import uvicorn

import rubricsearch.app.http_limits as http_limits
from rubricsearch.app.http_limits import RequestLimitMiddleware, server_config
from rubricsearch.app.main import create_app
from rubricsearch.app.state import AppState
from tests.api_helpers import built_state

pytestmark = pytest.mark.timeout(120)
# the constants of app/http_limits.py made small, so that the tests are quick
LIMITS = {"MAX_HEADER_BYTES": 8192, "MAX_HEADERS": 30, "HEADER_TIMEOUT_S": 0.6, "BODY_TIMEOUT_S": 0.6}
MAX_CONCURRENT_REQUESTS = 3


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
          ) -> Iterator[AppState]:
    yield from built_state(tmp_path_factory, "http-limits", tiny_embedding_dir, tiny_reranker_dir)


@pytest.fixture(scope="module")
def port(state: AppState) -> Iterator[int]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {**LIMITS, "MAX_CONCURRENT_REQUESTS": MAX_CONCURRENT_REQUESTS}.items():
            patch.setattr(http_limits, name, value)
        settings = state.settings
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        config = server_config(create_app(settings, state=state), settings, host="127.0.0.1", port=0,
                               log_config=None, log_level="warning", lifespan="on")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        yield sock.getsockname()[1]
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@contextmanager
def connect(port: int) -> Iterator[socket.socket]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        yield conn


def read_all(conn: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    chunks = []
    while chunk := conn.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def status_and_body(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body.startswith(b"{") else {}


def get(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: x\r\n{extra}\r\n".encode()


def test_a_header_section_over_the_limit_is_431_and_closed(port: int) -> None:
    with connect(port) as conn:
        conn.sendall(get("/healthz", f"x-big: {'a' * 20_000}\r\nconnection: close\r\n"))
        status, body = status_and_body(read_all(conn))
    assert status == 431 and body["error"]["type"] == "header_too_large"
    with connect(port) as conn:  # one just under it passes
        conn.sendall(get("/healthz", f"x-big: {'a' * 7000}\r\nconnection: close\r\n"))
        assert status_and_body(read_all(conn))[0] == 200


def test_too_many_header_fields_are_431(port: int) -> None:
    many = "".join(f"x-h{i}: v\r\n" for i in range(40))
    with connect(port) as conn:
        conn.sendall(get("/healthz", many + "connection: close\r\n"))
        status, body = status_and_body(read_all(conn))
    assert status == 431 and "30 header fields" in body["error"]["message"]
    few = "".join(f"x-h{i}: v\r\n" for i in range(20))
    with connect(port) as conn:
        conn.sendall(get("/healthz", few + "connection: close\r\n"))
        assert status_and_body(read_all(conn))[0] == 200


def test_silent_and_slow_header_connections_are_closed(port: int) -> None:
    t0 = time.monotonic()
    with connect(port) as silent, connect(port) as slow:
        slow.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
        for _ in range(4):  # a header byte every 0.25 s: never complete within the deadline
            time.sleep(0.25)
            try:
                slow.sendall(b"x")
            except OSError:
                break
        for conn in (silent, slow):
            status, body = status_and_body(read_all(conn))
            assert status == 408 and body["error"]["type"] == "request_timeout"
    assert time.monotonic() - t0 < 5


def test_a_stalled_body_is_408_and_closed(port: int) -> None:
    with connect(port) as conn:
        conn.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 20000000\r\n\r\n{\"input\": \"a")
        t0 = time.monotonic()
        status, body = status_and_body(read_all(conn))
    assert status == 408 and body["error"]["type"] == "request_timeout"
    assert time.monotonic() - t0 < 5


def test_keep_alive_requests_outlive_the_header_deadline(port: int) -> None:
    """Requests on one connection, spaced past the header deadline each time: every one is answered."""
    with connect(port) as conn:
        for _ in range(3):
            conn.sendall(get("/healthz"))
            raw = b""
            while b"\r\n\r\n" not in raw or not raw.endswith(b"}"):
                raw += conn.recv(65536)
            assert raw.startswith(b"HTTP/1.1 200")
            time.sleep(0.8)  # longer than HEADER_TIMEOUT_S here, shorter than uvicorn's keep-alive of 5 s


def test_requests_over_the_concurrency_limit_are_503(port: int) -> None:
    holders = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
    try:
        for conn in holders:  # three requests in flight, each waiting for its body
            conn.sendall(b"POST /v1/sets HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 100\r\n\r\n{")
        time.sleep(0.2)
        with connect(port) as conn:
            conn.sendall(get("/healthz", "connection: close\r\n"))
            raw = read_all(conn)
        status, body = status_and_body(raw)
        assert status == 503 and body["error"]["type"] == "overloaded" and b"retry-after: 1" in raw.lower()
    finally:
        for conn in holders:
            conn.close()
    time.sleep(0.8)  # their bodies time out; the slots come back
    with connect(port) as conn:
        conn.sendall(get("/healthz", "connection: close\r\n"))
        assert status_and_body(read_all(conn))[0] == 200


def test_the_body_timeout_ends_with_the_body() -> None:
    """After the last body message, ``receive`` waits for a disconnect as long as it takes (event streams)."""
    calls: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls.append((await receive())["type"])
        with anyio.move_on_after(0.3):
            calls.append((await receive())["type"])

    async def receive() -> dict[str, Any]:
        if not calls:
            return {"type": "http.request", "body": b"", "more_body": False}
        await anyio.sleep(10)
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        pass

    middleware = RequestLimitMiddleware(app, max_concurrent=1, body_timeout_s=0.05)
    anyio.run(middleware, {"type": "http"}, receive, send)
    assert calls == ["http.request"] and middleware.in_flight == 0
