"""The ingestion and search services of a running app, wired from settings onto the shared state.

Both hooks (listed in :data:`app.state.SERVICES`) reuse what the state already holds: one catalog, one
blob store, one package store, the loaded models and ONE vector index instance (a FAISS directory has a
single owner per process). ``setup_ingestion`` also settles what a previous run left (claims, staging,
index vs catalog) and starts ``settings.workers`` background worker threads; closing the state stops them.
The CLI builds the same services with :func:`open_state`, without background workers.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from collections.abc import Callable

from app.settings import Settings
from app.state import AppState, _load_model, run_services
from indexer.jobs import IngestionRunner, IngestionService, Staging, default_worker_id
from indexer.sources import NetGuard, SourceLimits, UrlFetcher
from retrieval.errors import BackendUnavailable
from retrieval.images import ImageLike, StoredImage
from retrieval.search import SearchService

log = logging.getLogger("rubricsearch.services")

RUNNER_KEY = "ingestion_runner"


# -- ingestion ------------------------------------------------------------------------------------------
def source_limits(settings: Settings) -> SourceLimits:
    return SourceLimits(max_item_bytes=settings.max_image_bytes, max_items=settings.zip_max_entries,
                        max_total_bytes=settings.zip_max_total_bytes)


def url_fetcher(settings: Settings) -> UrlFetcher:
    """Public addresses only, plus the operator's ``url_allowed_hosts`` (an internal image server)."""
    allowed = frozenset((h, int(p)) for h, _, p in (e.rpartition(":") for e in settings.url_allowed_hosts))
    return UrlFetcher(NetGuard(allowed_hosts=allowed), max_bytes=settings.url_max_bytes,
                      total_timeout=settings.url_timeout_s, read_timeout=min(10.0, settings.url_timeout_s),
                      max_redirects=settings.url_max_redirects)


def worker_id(settings: Settings) -> str:
    """Stable across restarts where only one process can own the data (FAISS), so a restarted server gets
    its own claims back at once instead of waiting for them to go stale."""
    if settings.worker_id:
        return settings.worker_id
    if settings.vector_backend == "faiss":
        digest = hashlib.sha256(os.fsencode(os.path.realpath(settings.data_dir))).hexdigest()[:12]
        return f"{socket.gethostname()}:{digest}"
    return default_worker_id()


def _package_embedder(state: AppState) -> object | None:
    """The embedder when it can run ingestion here (a local vision tower), else ``None``."""
    embedder = state.embedder_
    if embedder is not None and hasattr(embedder, "vision") and hasattr(embedder, "embed_contents"):
        return embedder
    return None


def make_ingestion(state: AppState) -> IngestionService:
    settings = state.settings
    return IngestionService(
        state.catalog, state.blobs, state.index, Staging(settings.data_dir / "staging"),
        embedder=_package_embedder(state),  # type: ignore[arg-type]
        packages=state.packages,
        limits=source_limits(settings),
        max_archive_bytes=max(settings.zip_max_total_bytes, settings.max_request_bytes),
        folder_root=settings.import_root,
        url_fetcher=url_fetcher(settings),
        image_max_bytes=settings.max_image_bytes,
        image_max_pixels=settings.max_image_pixels,
        default_dimensions=settings.default_dimensions,
    )


def setup_ingestion(state: AppState) -> None:
    """SERVICES hook: the ingestion service, recovery at start-up, and the background workers."""
    service = make_ingestion(state)
    state.ingestion = service
    state.closers.append(service.close)
    if state.settings.workers <= 0 or service.embedder is None:
        return
    settings = state.settings
    runner = IngestionRunner(service, worker_id=worker_id(settings), threads=settings.workers,
                             batch_size=settings.worker_batch_size, poll_interval_s=settings.worker_poll_interval_s)

    def stop() -> None:
        runner.stop(settings.worker_stop_timeout_s)
        runner.processor.close()

    state.closers.append(stop)  # closers run in reverse: workers stop before the service closes
    report = runner.recover()
    if report.released or report.abandoned or any(not r.consistent for r in report.reconciled):
        log.warning("start-up recovery: %s", report)
    runner.start()
    state.extras[RUNNER_KEY] = runner


def ingestion(state: AppState) -> IngestionService:
    service = state.ingestion
    if not isinstance(service, IngestionService):
        raise BackendUnavailable("ingestion is not available in this process")
    return service


def runner_for(state: AppState, *, batch_size: int | None = None) -> IngestionRunner:
    """A foreground runner (the CLI): processes jobs in the calling thread."""
    service = ingestion(state)
    if service.embedder is None:
        raise BackendUnavailable("ingestion needs a local embedding model (its vision tower)")
    return IngestionRunner(service, worker_id=worker_id(state.settings), threads=1,
                           batch_size=batch_size or state.settings.worker_batch_size)


# -- search ---------------------------------------------------------------------------------------------
def reference_resolver(state: AppState) -> Callable[[str], ImageLike]:
    """References as lazy handles: with their packages cached nothing is read, decoded or encoded."""
    settings = state.settings

    def resolve(sha: str) -> ImageLike:
        return StoredImage(sha, lambda: state.blobs.get(sha), max_bytes=settings.max_image_bytes,
                           max_pixels=settings.max_image_pixels)

    return resolve


def setup_search(state: AppState) -> None:
    """SERVICES hook: the search service over the shared index and models (none without an embedder)."""
    embedder = state.embedder_
    if embedder is None or not hasattr(embedder, "embed_contents"):
        return
    state.search = SearchService(embedder, state.reranker_, state.index, reference_resolver(state),  # type: ignore[arg-type]
                                 max_criteria=state.settings.max_criteria)


def search_service(state: AppState) -> SearchService:
    service = state.search
    if not isinstance(service, SearchService):
        raise BackendUnavailable("search is not available: the embedding model is not loaded here")
    return service


# -- for the CLI ----------------------------------------------------------------------------------------
def open_state(settings: Settings, *, embedder: bool = False, reranker: bool = False) -> AppState:
    """The stores, only the models a command needs, and the services; no background workers."""
    settings = settings.model_copy(update={"workers": 0})
    state = AppState.build(settings, models=False, services=False)
    try:
        if embedder:
            state.embedder_, test = _load_model(settings, "embedding", state.packages)
            state.test_models |= test
        if reranker:
            state.reranker_, test = _load_model(settings, "reranker", state.packages)
            state.test_models |= test
        run_services(state)
    except BaseException:
        state.close()
        raise
    return state
