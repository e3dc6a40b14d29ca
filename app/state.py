"""The heavy resources of one running app, built once in the FastAPI lifespan and held in typed fields.

Both models register with one package stage (:class:`~retrieval.packages.VisualPackages`), keyed by vision
tower: identical towers share packages, different ones each get theirs at ingestion, and every encode is
counted by model and purpose. :meth:`AppState.build` wires the services explicitly (ingestion with its
workers and backfill, search); the CLI builds the same state without workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from rubricsearch.app.embedder_versions import SetEmbedders
from rubricsearch.app.model_loading import ModelKind, load_embedder, load_reranker, log_towers, register_reranker_tower
from rubricsearch.app.model_versions import SetRerankers
from rubricsearch.app.plugins import first
from rubricsearch.app.refits import Refitter
from rubricsearch.app.services import (
    WORKER_STOP_TIMEOUT_S,
    make_ingestion,
    make_search,
    runner_for,
    start_workers,
    worker_id,
)
from rubricsearch.app.settings import Settings
from rubricsearch.app.training_jobs import TrainingJobs
from rubricsearch.indexer.blobs import BlobStore, validate_sha256
from rubricsearch.indexer.catalog import Catalog, is_sha_referenced
from rubricsearch.indexer.jobs import IngestionRunner, IngestionService
from rubricsearch.indexer.jobs.facets import FacetJobs
from rubricsearch.rerank.protocol import Reranker
from rubricsearch.rerank.rubric import RerankPolicy
from rubricsearch.retrieval.embedding.protocol import Embedder
from rubricsearch.retrieval.errors import BackendUnavailable, NotFound
from rubricsearch.retrieval.images import ReferenceImage
from rubricsearch.retrieval.index import VectorIndex, make_index
from rubricsearch.retrieval.packages import EphemeralPackages, PackageStore, StorageDtype, VisualPackages
from rubricsearch.retrieval.pixel_budget import PixelBudget
from rubricsearch.retrieval.qwen.model.loading import resolve_device
from rubricsearch.retrieval.search import SearchService

log = logging.getLogger("rubricsearch.app")
# A request waits this long for room in the decoded-pixel budget (about one ingestion batch's decoding), then
# gets 503 with Retry-After instead of queueing without bound; ingestion waits as long as it takes.
DECODE_WAIT_S = 2.0
# The share of RUBRICSEARCH_PACKAGES__MEMORY_BYTES kept for query images' packages (search candidates, API images),
# which never go to disk nor evict reference packages: they live for one search, so a quarter holds many.
QUERY_MEMORY_SHARE = 0.25
# The largest set mirrored on a GPU for search: above it the set's search stays on the CPU's index.
VECTOR_DEVICE_MAX_BYTES = 16 * 1024 * 1024 * 1024
# Memory for the graphs FAISS builds for recurring filters that keep few rows of an HNSW set; without one such a
# filter walks the set's graph or scans its rows, so this bounds a cache, not a result.
FAISS_FILTER_GRAPH_BYTES = 1024 * 1024 * 1024
# Below this many references an exact FAISS scan is as fast as HNSW and loses no recall.
FAISS_ANN_THRESHOLD = 50_000
# The GPU copy's number format (auto: float8 e4m3 where the GPU multiplies it, else float16) changes no result:
# its candidates are re-scored in float32.
VECTOR_DEVICE_PRECISION = "auto"
# Where the embedded index searches: auto mirrors a set on the GPU where there is one (faiss-gpu where its build is
# installed, else torch) and searches the CPU's index otherwise. The device changes no result, only the latency: its
# candidates are re-scored exactly in float32 (tests/test_index_congruence.py).
VECTOR_SEARCH_DEVICE = "auto"
T = TypeVar("T")


TEST_LABEL = "offline random-weight test models: results are not meaningful"

@dataclass
class AppState:
    """Everything a request handler needs; see :mod:`app.deps` for the ``Annotated`` accessors."""

    settings: Settings
    catalog: Catalog
    blobs: BlobStore
    packages: VisualPackages
    index: VectorIndex
    embedder_: Embedder | None = None
    reranker_: Reranker | None = None
    rerank_policy: RerankPolicy = field(default_factory=RerankPolicy)  # measured with the reranker's checkpoint
    ingestion_: IngestionService | None = None
    runner: IngestionRunner | None = None  # background workers (None in the CLI and with workers=0)
    search_: SearchService | None = None
    facets_: FacetJobs | None = None  # facet jobs (with a reranker loaded)
    rerankers_: SetRerankers | None = None  # each set's active reranker version (with a reranker loaded)
    embedders_: SetEmbedders | None = None  # each set's active embedder version (with an embedder loaded)
    training_: TrainingJobs | None = None  # fine-tuning jobs (with the model they fine-tune loaded)
    refits: Refitter | None = None  # automatic refits (with background workers and a reranker)
    admission_refusals: int = 0  # requests refused because the model queues were full (/metrics)
    test_models: bool = False
    closers: list[Callable[[], None]] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)

    @property
    def models_label(self) -> str | None:
        """What every surface calls the serving models when they are not the configured ones (None: they are)."""
        if not self.test_models:
            return None
        served = {kind: m.model_id for m, kind in ((self.embedder_, "embedding"), (self.reranker_, "reranker"))
                  if m is not None}
        return first(lambda plugin: plugin.models_label(self.settings.data_dir, served)) or TEST_LABEL

    # -- typed accessors --------------------------------------------------------------------------
    @property
    def facets(self) -> FacetJobs:
        if self.facets_ is None:
            raise BackendUnavailable("facets need the reranker model loaded in this process")
        return self.facets_

    @property
    def rerankers(self) -> SetRerankers:
        if self.rerankers_ is None:
            raise BackendUnavailable("reranker versions need the reranker model loaded in this process")
        return self.rerankers_

    @property
    def embedders(self) -> SetEmbedders:
        if self.embedders_ is None:
            raise BackendUnavailable("embedder versions need the embedding model loaded in this process")
        return self.embedders_

    @property
    def training(self) -> TrainingJobs:
        if self.training_ is None:
            raise BackendUnavailable("training needs the model it fine-tunes loaded in this process")
        return self.training_

    @property
    def embedder(self) -> Embedder:
        if self.embedder_ is None:
            raise BackendUnavailable("the embedding model is not loaded")
        return self.embedder_

    @property
    def reranker(self) -> Reranker:
        if self.reranker_ is None:
            raise BackendUnavailable("the reranker model is not loaded")
        return self.reranker_

    def model(self, kind: ModelKind) -> Embedder | Reranker:
        return self.embedder if kind == "embedding" else self.reranker

    @property
    def store(self) -> PackageStore:
        return self.packages.store

    @property
    def ingestion(self) -> IngestionService:
        if self.ingestion_ is None:
            raise BackendUnavailable("ingestion is not available in this process")
        return self.ingestion_

    @property
    def search(self) -> SearchService:
        if self.search_ is None:
            raise BackendUnavailable("search is not available: the embedding model is not loaded here")
        return self.search_

    # -- model names ------------------------------------------------------------------------------
    def model_names(self, kind: ModelKind) -> list[str]:
        """Every name accepted for a model: its id, the configured name, their last path parts, aliases."""
        models = self.settings.models
        configured = models.embedding_model if kind == "embedding" else models.reranker_model
        aliases = (self.settings.models.embedding_model_aliases if kind == "embedding"
                   else self.settings.models.reranker_model_aliases)
        names = [self.model(kind).model_id, configured, *aliases]
        names += [Path(n.rstrip("/")).name for n in names[:2]]
        return list(dict.fromkeys(n for n in names if n))

    def resolve_model(self, kind: ModelKind, name: str | None) -> str:
        """The real model id for a requested name (``None`` = the served model); unknown -> NotFound."""
        real = self.model(kind).model_id
        if name is None or name.strip().lower() in {n.lower() for n in self.model_names(kind)}:
            return real
        raise NotFound(f"model {name!r} is not served here; use {real!r}", model=name, available=[real])

    def queued_inputs(self) -> dict[str, int]:
        """Inputs waiting for each loaded model's device."""
        return {kind: model.pending() for kind, model in (("embedding", self.embedder_), ("reranker", self.reranker_))
                if model is not None}

    # -- ingested images --------------------------------------------------------------------------
    def require_ingested(self, sha256: str) -> None:
        """NotFound unless some reference set holds the image and its blob is stored."""
        validate_sha256(sha256)
        with self.catalog.read() as session:
            known = is_sha_referenced(session, sha256)
        if not known or not self.blobs.exists(sha256):
            raise NotFound("image not found; ingest it into a reference set first", sha256=sha256)

    def ingested_image(self, sha256: str) -> ReferenceImage:
        """An image of any reference set (NotFound if not ingested), read and decoded only if its pixels
        are needed: with its package cached, a reference costs a catalog lookup and nothing more."""
        self.require_ingested(sha256)
        limit = max(self.blobs.size(sha256), self.settings.image_bytes)  # it passed the limits at ingestion
        return ReferenceImage(sha256, lambda: self.blobs.get(sha256), max_bytes=limit,
                              max_pixels=self.settings.image_pixels)

    # -- readiness and shutdown -------------------------------------------------------------------
    def readiness(self) -> dict[str, bool]:
        checks = {
            "catalog": _safe(self.catalog.is_ready),
            "index": _safe(self.index.health),
            "embedder": self.embedder_ is not None and _safe(self.embedder_.health),
            "reranker": self.reranker_ is not None and _safe(self.reranker_.health),
        }
        if self.ingestion_ is not None:
            checks["ingestion"] = self.ingestion_.paused is None
        if self.search_ is not None:
            checks["search"] = True
        return checks

    def close(self) -> None:
        for closer in reversed(self.closers):
            try:
                closer()
            except Exception:  # one failing closer must not keep the others from running
                log.exception("error while closing a service")
        self.closers.clear()
        for step in (self.packages.store.close, self.index.close, self.catalog.dispose):
            try:
                step()
            except Exception:
                log.exception("error during shutdown")

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def build(cls, settings: Settings, *, embedder: bool = True, reranker: bool = True,
              reranker_tower: bool = False, services: bool = True) -> AppState:
        """Open the stores, load the models and wire the services (:meth:`open`, then :meth:`load`)."""
        state = cls.open(settings)
        try:
            state.load(embedder=embedder, reranker=reranker, reranker_tower=reranker_tower, services=services)
        except BaseException:
            state.close()
            raise
        return state

    @classmethod
    def open(cls, settings: Settings) -> AppState:
        """The stores alone: catalog, blobs, packages and the vector index."""
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        catalog = Catalog.open(settings.catalog_url)
        try:
            blobs = BlobStore(settings.blobs_dir)
            # Write-behind: a new package is usable at once and reaches disk on a writer thread (the store is
            # a cache: a package lost in a crash is recomputed on its next miss, or by a backfill job).
            store = PackageStore(settings.packages_dir, memory_bytes=settings.packages.memory_bytes,
                                 disk_bytes=settings.packages.disk_bytes, storage_dtype=_storage_dtype(settings),
                                 write_behind=True)
            index = _make_index(settings)
        except BaseException:
            catalog.dispose()
            raise
        queries = EphemeralPackages(int(settings.packages.memory_bytes * QUERY_MEMORY_SHARE),
                                    device=store.memory_device)
        state = cls(settings=settings, catalog=catalog, blobs=blobs, packages=VisualPackages(store, queries),
                    index=index)
        state.packages.pixel_budget = PixelBudget(settings.limits.decode_pixel_budget, DECODE_WAIT_S)
        return state

    @classmethod
    def preparing(cls, settings: Settings) -> AppState:
        """The stores with an ingestion service that indexes nothing: it serves the routes that need no model
        (listing and creating sets, jobs, images) while the models are prepared; :meth:`load` completes it."""
        state = cls.open(settings)
        state.ingestion_ = make_ingestion(settings, state.catalog, state.blobs, state.index, None, state.packages)
        return state

    def load(self, *, embedder: bool = True, reranker: bool = True, reranker_tower: bool = False,
             services: bool = True) -> None:
        """Load the models and wire the services.

        ``embedder``/``reranker`` choose the models (the CLI loads only what a command needs; tests of
        model-free routes load none); ``reranker_tower`` registers the reranker's vision tower alone (for
        ingesting processes that do not load the reranker), so ingestion still builds its packages.
        ``services=False`` leaves ingestion and search unwired. Background ingestion workers run when
        ``settings.workers > 0``.
        """
        settings = self.settings
        if embedder:
            self.embedder_, test = load_embedder(settings, self.packages)
            self.closers.append(self.embedder_.close)
            self.test_models |= test
        if reranker:
            self.reranker_, test, self.rerank_policy = load_reranker(settings, self.packages)
            self.closers.append(self.reranker_.close)
            self.test_models |= test
        elif reranker_tower:
            register_reranker_tower(settings, self.packages)  # ingestion builds the reranker's packages
        if embedder or reranker:
            log_towers(self.packages)
        if services:
            self._wire_services()

    def _wire_services(self) -> None:
        self.ingestion_ = make_ingestion(self.settings, self.catalog, self.blobs, self.index, self.embedder_,
                                         self.packages)
        self.closers.append(self.ingestion_.close)
        if self.embedder_ is not None:  # before the workers start: they embed with it
            embedders, base = SetEmbedders(self), self.embedder_
            self.embedders_ = embedders
            self.closers.append(embedders.close)  # after the workers stop (closers run in reverse)
            # a set's new references (and a reconciled set's) are embedded by the embedder that embeds its queries
            self.ingestion_.set_embedders = lambda set_id: embedders.embedder_for(set_id, base)
        self.runner = start_workers(self.settings, self.ingestion_)
        if self.runner is not None:
            runner = self.runner

            def stop() -> None:
                runner.stop(WORKER_STOP_TIMEOUT_S)
                runner.processor.close()

            self.closers.append(stop)  # closers run in reverse: workers stop before the service closes
        if self.reranker_ is not None:
            facets = FacetJobs(self.catalog, self.index, self.reranker_, worker_id=worker_id(self.settings))
            self.facets_ = facets
            self.ingestion_.ended_listeners.append(facets.follow_up)
            self.closers.append(lambda: facets.stop(WORKER_STOP_TIMEOUT_S))
        if self.reranker_ is not None:
            rerankers = SetRerankers(self)
            self.rerankers_ = rerankers
            self.closers.append(rerankers.close)
        if self.reranker_ is not None or self.embedder_ is not None:  # each model's jobs need that model alone
            training = TrainingJobs(self)
            self.training_ = training
            self.closers.append(training.close)  # closers run in reverse: training stops first
        if self.embedder_ is not None:
            embedders = self.embedders
            self.search_ = make_search(self.settings, self.embedder_, self.reranker_, self.index, self.blobs,
                                       self.rerank_policy,
                                       self.rerankers_.scorer_for if self.rerankers_ is not None else None,
                                       embedders.embedder_for)
        if self.runner is not None and self.search_ is not None and self.search_.scorer is not None:
            # a process with background workers follows its sets' judgments (app.refits); the CLI does not
            refits = Refitter(self.catalog, self.search_).start()
            self.refits = refits
            self.closers.append(lambda: refits.stop(WORKER_STOP_TIMEOUT_S))  # before the models close


def _safe(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception:
        return False


def _storage_dtype(settings: Settings) -> StorageDtype:
    """'auto' stores packages in float8 with a scale per token: 4x smaller than float32 and 2x than bf16,
    at an embedding cosine within rounding of bf16's (docs/performance.md). A package is used as stored from its
    first use on, so cached and uncached paths always see the same values."""
    return "float8_e4m3fn" if settings.packages.storage_dtype == "auto" else settings.packages.storage_dtype


def vector_device(settings: Settings) -> str:
    """The GPU the index's mirrors live on: the models' (``RUBRICSEARCH_MODELS__DEVICE=cuda:1`` puts them on GPU 1,
    beside the query vectors they are multiplied with), or CUDA's current one where the models run on the CPU."""
    device = resolve_device(settings.models.device)
    return str(device) if device.type == "cuda" else "cuda"


def _make_index(settings: Settings) -> VectorIndex:
    if settings.vector_backend() == "qdrant":
        key = settings.vectors.qdrant_api_key.get_secret_value() if settings.vectors.qdrant_api_key else None
        return make_index("qdrant", url=settings.vectors.qdrant_url, api_key=key)
    # The ingestion runner flushes on an interval and at job end; start-up reconcile repairs a crash gap.
    # (autoflush would rewrite the whole set file after every batch.)
    return make_index("faiss", path=settings.faiss_dir, ann_threshold=FAISS_ANN_THRESHOLD, autoflush=False,
                      device_search=VECTOR_SEARCH_DEVICE, search_device=vector_device(settings),
                      device_precision=VECTOR_DEVICE_PRECISION,
                      device_max_bytes=VECTOR_DEVICE_MAX_BYTES, filter_graph_bytes=FAISS_FILTER_GRAPH_BYTES)


def open_state(settings: Settings, *, embedder: bool = False, reranker: bool = False,
               ingest: bool = False) -> AppState:
    """For the CLI: the stores, only the models a command needs, and the services; no background workers.

    ``ingest`` loads the embedder and, unless the reranker is loaded too, its vision tower alone: an
    ingesting process builds packages for every tower in use."""
    return AppState.build(settings.updated({"ingest": {"workers": 0}}), embedder=embedder or ingest,
                          reranker=reranker, reranker_tower=ingest and not reranker)


def foreground_runner(state: AppState, *, batch_size: int | None = None) -> IngestionRunner:
    """A runner that processes jobs in the calling thread (the CLI, tests)."""
    return runner_for(state.settings, state.ingestion, batch_size=batch_size)
