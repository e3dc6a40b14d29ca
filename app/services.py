"""Building the ingestion and search services from settings and the state's components.

Both reuse what the state already holds: one catalog, one blob store, one package stage, the loaded
models and ONE vector index instance (a FAISS directory has a single owner per process).
:func:`start_workers` also settles what a previous run left (claims, staging, index vs catalog), queues
backfill jobs for references that lack a package of a vision tower now in use, and starts
``settings.workers`` background worker threads. The CLI builds the same services with
:func:`app.state.open_state`, without background workers.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from collections.abc import Callable

from rubricsearch.app.settings import MAX_IMAGE_BYTES, Settings, worker_batch_size
from rubricsearch.indexer.blobs import BlobStore
from rubricsearch.indexer.catalog import Catalog
from rubricsearch.indexer.jobs import IngestionRunner, IngestionService, Staging, default_worker_id
from rubricsearch.indexer.jobs.backfill import plan_backfill
from rubricsearch.indexer.jobs.reconcile import repair_payloads
from rubricsearch.indexer.sources import NetGuard, SourceLimits, UrlFetcher
from rubricsearch.rerank.protocol import Reranker
from rubricsearch.rerank.rubric import RerankPolicy, RubricReranker
from rubricsearch.retrieval.embedding import Embedder
from rubricsearch.retrieval.errors import BackendUnavailable
from rubricsearch.retrieval.images import ImageLike, ReferenceImage
from rubricsearch.retrieval.index import VectorIndex
from rubricsearch.retrieval.packages import VisualPackages
from rubricsearch.retrieval.search import SearchService
from rubricsearch.retrieval.search.protocol import ShortlistScorer

log = logging.getLogger("rubricsearch.services")
# An idle worker's claim query once a second costs nothing and starts a new job within a second.
WORKER_POLL_INTERVAL_S = 1.0
# A whole URL download's deadline: long enough for MAX_IMAGE_BYTES on a slow link, short
# enough that a dripping server holds a fetch thread briefly (between bytes: at most 10 s).
URL_TIMEOUT_S = 20.0
# Image hosts and CDNs redirect once or twice; each hop is checked against the address rules again.
URL_MAX_REDIRECTS = 3
# Downloads in flight per worker: enough to keep a GPU batch fed from typical image hosts.
URL_FETCH_THREADS = 8
# Fetched bytes a worker holds until a batch takes them; MAX_IMAGE_BYTES bounds one item.
URL_FETCH_AHEAD_BYTES = 256 * 1024 * 1024
# A zip upload's directory is read whole, and what it unpacks lands on the data disk: more files or bytes go in
# several zips (each entry is bounded by MAX_IMAGE_BYTES).
ZIP_MAX_ENTRIES = 10_000
ZIP_MAX_TOTAL_BYTES = 2048 * 1024 * 1024
# Decoded image pixels per ingestion batch, as the images' headers declare them (a batch keeps at least one image):
# bounds a batch's decoding memory below RUBRICSEARCH_LIMITS__DECODE_PIXEL_BUDGET's default, so requests keep room
# beside it (a budget set lower than this makes a batch wait for the whole budget).
INGEST_BATCH_PIXELS = 100_000_000
# How long a worker may finish its batch after SIGTERM: a batch takes seconds; compose.yaml's stop_grace_period
# (the SIGKILL) is longer.
WORKER_STOP_TIMEOUT_S = 120.0
# What a search does when the request leaves it open (a request names its own top_k, top_n and facet confidence).
DEFAULT_TOP_K = 50
DEFAULT_TOP_N = 10
# Criteria one search may have: each is a reranker pass over the shortlist, so this bounds a search's cost.
MAX_CRITERIA = 12
# Probability a computed facet's chosen value needs to match a `facets.<attribute>` filter or count: the more
# likely value, unless a request names another.
FACET_MIN_CONFIDENCE = 0.5


# -- ingestion ------------------------------------------------------------------------------------------
def source_limits(settings: Settings) -> SourceLimits:
    return SourceLimits(max_item_bytes=settings.image_bytes, max_items=ZIP_MAX_ENTRIES,
                        max_total_bytes=ZIP_MAX_TOTAL_BYTES)


def url_fetcher(settings: Settings) -> UrlFetcher:
    """Public addresses only, plus the operator's ``url_allowed_hosts`` (an internal image server)."""
    allowed = frozenset((h, int(p)) for h, _, p in (e.rpartition(":") for e in settings.ingest.url_allowed_hosts))
    return UrlFetcher(NetGuard(allowed_hosts=allowed), max_bytes=MAX_IMAGE_BYTES,
                      total_timeout=URL_TIMEOUT_S, read_timeout=min(10.0, URL_TIMEOUT_S),
                      max_redirects=URL_MAX_REDIRECTS)


def worker_id(settings: Settings) -> str:
    """Stable across restarts where only one process can own the data (FAISS), so a restarted server gets
    its own claims back at once instead of waiting for them to go stale."""
    if settings.vector_backend() == "faiss":
        digest = hashlib.sha256(os.fsencode(os.path.realpath(settings.data_dir))).hexdigest()[:12]
        return f"{socket.gethostname()}:{digest}"
    return default_worker_id()


def make_ingestion(settings: Settings, catalog: Catalog, blobs: BlobStore, index: VectorIndex,
                   embedder: Embedder | None, packages: VisualPackages) -> IngestionService:
    """The ingestion service; it indexes only with an embedder whose vision tower runs here."""
    return IngestionService(
        catalog, blobs, index, Staging(settings.data_dir / "staging"),
        embedder=embedder if embedder is not None and embedder.packages.local else None,
        packages=packages,
        limits=source_limits(settings),
        max_archive_bytes=ZIP_MAX_TOTAL_BYTES,
        folder_root=settings.import_root,
        url_fetcher=url_fetcher(settings),
        image_max_bytes=settings.image_bytes,
        image_max_pixels=settings.image_pixels,
    )


def start_workers(settings: Settings, service: IngestionService) -> IngestionRunner | None:
    """Recovery at start-up, backfill planning, then ``settings.workers`` background worker threads."""
    if settings.ingest.workers <= 0 or service.embedder is None:
        repair_payloads(service.catalog, service.index)  # what recover() would have repaired of filters' payloads
        return None
    runner = IngestionRunner(service, worker_id=worker_id(settings), threads=settings.ingest.workers,
                             batch_size=worker_batch_size(settings), batch_pixels=INGEST_BATCH_PIXELS,
                             poll_interval_s=WORKER_POLL_INTERVAL_S, fetch_threads=URL_FETCH_THREADS,
                             fetch_ahead_bytes=URL_FETCH_AHEAD_BYTES)
    report = runner.recover()
    if report.released or report.abandoned or any(not r.consistent for r in report.reconciled):
        log.warning("start-up recovery: %s", report)
    if service.packages is not None:
        plan_backfill(service.catalog, service.packages)
    runner.start()
    return runner


def runner_for(settings: Settings, service: IngestionService, *, batch_size: int | None = None) -> IngestionRunner:
    """A foreground runner (the CLI): processes jobs in the calling thread."""
    if service.embedder is None:
        raise BackendUnavailable("ingestion needs a local embedding model (its vision tower)")
    return IngestionRunner(service, worker_id=worker_id(settings), threads=1,
                           batch_size=batch_size or worker_batch_size(settings),
                           batch_pixels=INGEST_BATCH_PIXELS, fetch_threads=URL_FETCH_THREADS,
                           fetch_ahead_bytes=URL_FETCH_AHEAD_BYTES)


# -- search ---------------------------------------------------------------------------------------------
def reference_resolver(settings: Settings, blobs: BlobStore) -> Callable[[str], ImageLike]:
    """References as lazy handles: with their packages cached nothing is read, decoded or encoded."""

    def resolve(sha: str) -> ImageLike:
        return ReferenceImage(sha, lambda: blobs.get(sha), max_bytes=settings.image_bytes,
                              max_pixels=settings.image_pixels)

    return resolve


def make_search(settings: Settings, embedder: Embedder, reranker: Reranker | None, index: VectorIndex,
                blobs: BlobStore, policy: RerankPolicy | None = None,
                scorer_for: Callable[[str, ShortlistScorer | None], ShortlistScorer | None] | None = None,
                embedder_for: Callable[[str, Embedder], tuple[Embedder, str]] | None = None) -> SearchService:
    """Recall with the embedder, then the reranker's rubric judgements as the second stage (for the query kinds
    its measured ``policy`` reranks); ``scorer_for`` and ``embedder_for`` give a set's active versions in the
    bases' place."""
    return SearchService(embedder, RubricReranker(reranker, policy) if reranker is not None else None, index,
                         reference_resolver(settings, blobs), max_criteria=MAX_CRITERIA, scorer_for=scorer_for,
                         embedder_for=embedder_for)
