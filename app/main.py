"""FastAPI assembly: ``create_app(settings)``; heavy resources are built in the lifespan, once.

Run it with ``uvicorn app.main:create_app --factory`` (settings from ``RUBRICSEARCH_*``).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rubricsearch.app import http_limits
from rubricsearch.app.auth import Guard
from rubricsearch.app.docs import install_docs
from rubricsearch.app.errors import BodyTooLarge, error_response, install_error_handlers
from rubricsearch.app.http_limits import RequestLimitMiddleware
from rubricsearch.app.memory import HeapTrimmer, limit_arenas
from rubricsearch.app.metrics import Metrics, MetricsMiddleware
from rubricsearch.app.routers import ROUTER_MODULES
from rubricsearch.app.settings import Settings, get_settings
from rubricsearch.app.state import AppState
from rubricsearch.app.threads import apply_op_threads
from rubricsearch.app.warmup import Warmup

DESCRIPTION = """\
Two-stage multimodal retrieval and reranking with Qwen3-VL, reusing each reference image's vision features.

* `POST /v1/embeddings` is OpenAI-compatible and also takes images: see the request examples.
* `POST /v1/rerank` is Cohere/Jina-shaped, with images and an `instruction`.
* `GET /v1/images/{sha256}/visual-package` returns an ingested image's vision-encoder output in the
  layout a vLLM server started with `--enable-mm-embeds` takes as an `image_embeds` part.

Images are sent as `data:` URLs or referenced by the sha256 of an ingested image: `{"image_id": "<sha256>"}`.
Every error has the body `{"error": {"type", "message", "details"}}`.
"""

TAGS = [
    {"name": "embeddings", "description": "OpenAI-compatible multimodal embeddings."},
    {"name": "rerank", "description": "Multimodal reranking (Qwen3-VL-Reranker)."},
    {"name": "packages", "description": "Visual packages: cached vision-encoder outputs."},
    {"name": "health", "description": "Liveness, readiness and metrics."},
    {"name": "sets", "description": "Reference sets: create, list, delete."},
    {"name": "images",
     "description": "Reference images: upload files or zips, import URLs or folders, list, fetch, delete."},
    {"name": "jobs", "description": "Ingestion jobs: progress (also as Server-Sent Events), errors per item, cancel."},
    {"name": "search",
     "description": "Rubric search: instruction-aware recall, then reranking with per-criterion scores."},
]


class BodyLimitMiddleware:
    """Refuse large bodies early (Content-Length) and cap streamed ones (chunked or lying clients).

    JSON bodies have their own, smaller cap: a JSON body is parsed whole in memory (the bytes, then the
    strings), while uploads stream to staging; over it a request is refused before any of it is read."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_json_bytes: int | None = None) -> None:
        self.app = app
        self.max_request_bytes = max_bytes
        self.max_json_bytes = min(max_bytes, max_json_bytes or max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        declared = headers.get("content-length")
        json_body = "json" in headers.get("content-type", "").lower()
        limit = self.max_json_bytes if json_body else self.max_request_bytes
        if declared is not None:
            if not declared.isdigit():
                await error_response("invalid_input", "invalid Content-Length header")(scope, receive, send)
                return
            if int(declared) > limit:
                await self._refuse(scope, receive, send, limit)
                return
        received = 0
        started = False

        async def capped_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, capped_receive, tracked_send)
        except BodyTooLarge:  # raised outside a route (inside one, the error handlers answer)
            if started:
                raise
            await self._refuse(scope, receive, send, limit)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        response = error_response("payload_too_large", f"request body exceeds the limit of {limit} bytes",
                                  {"limit": limit})
        await response(scope, receive, send)


def _build(settings: Settings) -> AppState:
    """The server's state, then torch's threads per op set on this same thread too: torch fixes a thread's
    OpenMP team the first time it runs an op, so the thread that loaded the models kept two threads per op,
    and on a small CPU box the spare OpenMP thread spun, taking CPU from the requests (docs/performance.md,
    "Measurements behind the code")."""
    built = AppState.build(settings)
    _op_threads(built)
    return built


def _op_threads(built: AppState) -> None:
    embedder = built.embedder_
    apply_op_threads(device=built.settings.models.device,
                     width=embedder.dimension if embedder is not None else None)


# glibc makes 8 arenas per core, and the free bytes they retain grew RSS under churn; 2 keep freed memory
# reusable across the server's threads (docs/hardening.md, "Memory under churn").
MALLOC_ARENA_MAX = 2
# A trim only walks the arenas' free lists; a few seconds apart it is cheap and bounds what one interval retains.
MALLOC_TRIM_INTERVAL_S = 5.0


@asynccontextmanager
async def _own_heap() -> AsyncIterator[None]:
    """The server's own process (not a test sharing its models): keep glibc's heap from holding freed memory."""
    limit_arenas(MALLOC_ARENA_MAX)
    trimmer = HeapTrimmer(MALLOC_TRIM_INTERVAL_S).start()
    try:
        yield
    finally:
        trimmer.stop()


@asynccontextmanager
async def _warming(app: FastAPI, warmup: Warmup) -> AsyncIterator[None]:
    """Serve while ``warmup`` prepares the state, then serve that state (see :mod:`app.warmup`)."""

    def ready(built: AppState) -> None:  # on the thread that built the state, as in _build
        _op_threads(built)
        app.state.rubricsearch = built

    warmup.on_failure.append(lambda _message: app.state.stopping.set())  # event streams end too
    warmup.start(ready)
    try:
        yield
    finally:
        await anyio.to_thread.run_sync(warmup.stop)
        built, app.state.rubricsearch = app.state.rubricsearch, None
        if built is not None:
            await anyio.to_thread.run_sync(built.close)


@asynccontextmanager
async def _built(app: FastAPI, settings: Settings) -> AsyncIterator[None]:
    """Build the state before serving (models loaded in a worker thread) and close it on shutdown."""
    built = await anyio.to_thread.run_sync(_build, settings)
    app.state.rubricsearch = built
    try:
        yield
    finally:
        app.state.rubricsearch = None
        await anyio.to_thread.run_sync(built.close)


def create_app(settings: Settings | None = None, *, state: AppState | None = None,
               warmup: Warmup | None = None) -> FastAPI:
    """Build the app. ``state`` lets tests share loaded models between apps (the caller closes it);
    ``warmup`` serves at once while it prepares the state (the demo's first run trains its models), then
    installs it and closes it on shutdown; without either the lifespan builds one from ``settings`` and
    closes it on shutdown."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if warmup is None and state is not None:  # the caller's state: the caller closes it
            app.state.rubricsearch = state
            yield
            return
        async with _own_heap(), (_warming(app, warmup) if warmup is not None else _built(app, settings)):
            yield

    app = FastAPI(title="rubricsearch", version="0.1.0", description=DESCRIPTION, openapi_tags=TAGS,
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    install_docs(app)
    app.state.settings = settings
    app.state.guard = Guard(settings)
    app.state.stopping = threading.Event()  # set when the server is asked to stop: event streams end
    app.state.rubricsearch = state
    app.state.warmup = warmup
    app.state.metrics = Metrics(lambda: getattr(app.state, "rubricsearch", None))
    install_error_handlers(app)
    for name in ROUTER_MODULES:
        app.include_router(importlib.import_module(name).router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=http_limits.MAX_REQUEST_BYTES,
                       max_json_bytes=settings.limits.max_json_bytes)
    app.add_middleware(RequestLimitMiddleware, max_concurrent=http_limits.MAX_CONCURRENT_REQUESTS,
                       body_timeout_s=http_limits.BODY_TIMEOUT_S)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    return app
