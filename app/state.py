"""The heavy resources of one running app, built once in the FastAPI lifespan and read via typed accessors.

Models are loaded once per process and share one :class:`PackageStore`, so the embedder and the
reranker reuse each other's visual packages when their vision towers are identical. Features wired
later (ingestion workers, the search service) hang off the same object: add a ``"module:function"``
to :data:`SERVICES`; the function gets the state, sets its attribute and may append to ``closers``.
"""

from __future__ import annotations

import fcntl
import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from app.settings import Settings
from indexer.blobs import BlobStore, validate_sha256
from indexer.catalog import Catalog, is_sha_referenced
from rerank.protocol import Reranker
from retrieval.embedding.protocol import Embedder
from retrieval.errors import BackendUnavailable, NotFound
from retrieval.images import StoredImage
from retrieval.index import VectorIndex, make_index
from retrieval.packages import PackageStore, StorageDtype

log = logging.getLogger("rubricsearch.app")

ModelKind = Literal["embedding", "reranker"]
T = TypeVar("T")

# "module:function" entries called with the built state (e.g. "indexer.service:setup"); one line each.
SERVICES: tuple[str, ...] = (
    "app.services:setup_ingestion",
    "app.services:setup_search",
)


@dataclass
class AppState:
    """Everything a request handler needs; see :mod:`app.deps` for the ``Annotated`` accessors."""

    settings: Settings
    catalog: Catalog
    blobs: BlobStore
    packages: PackageStore
    index: VectorIndex
    embedder_: Embedder | None = None
    reranker_: Reranker | None = None
    test_models: bool = False
    ingestion: Any = None  # set by the ingestion service when wired
    search: Any = None  # set by the search service when wired
    extras: dict[str, Any] = field(default_factory=dict)
    closers: list[Callable[[], None]] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    _meter_locks: dict[str, threading.Lock] = field(
        default_factory=lambda: {"embedding": threading.Lock(), "reranker": threading.Lock()}
    )

    # -- typed accessors --------------------------------------------------------------------------
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

    # -- model names ------------------------------------------------------------------------------
    def model_names(self, kind: ModelKind) -> list[str]:
        """Every name accepted for a model: its id, the configured name, their last path parts, aliases."""
        configured = self.settings.embedding_model if kind == "embedding" else self.settings.reranker_model
        aliases = (self.settings.embedding_model_aliases if kind == "embedding"
                   else self.settings.reranker_model_aliases)
        names = [self.model(kind).model_id, configured, *aliases]
        names += [Path(n.rstrip("/")).name for n in names[:2]]
        return list(dict.fromkeys(n for n in names if n))

    def resolve_model(self, kind: ModelKind, name: str | None) -> str:
        """The real model id for a requested name (``None`` = the served model); unknown -> NotFound."""
        real = self.model(kind).model_id
        if name is None or name.strip().lower() in {n.lower() for n in self.model_names(kind)}:
            return real
        raise NotFound(f"model {name!r} is not served here; use {real!r}", model=name, available=[real])

    def metered(self, kind: ModelKind, call: Callable[[], T]) -> tuple[T, int]:
        """Run a model call and return its result with the LM tokens it used, as a difference of the
        model's ``lm_tokens`` counter. API calls are serialised here (the local backends serialise them
        anyway); a background caller (ingestion) using the model at the same moment adds its tokens."""
        model = self.model(kind)
        with self._meter_locks[kind]:
            before = int(model.stats.get("lm_tokens", 0))
            result = call()
            return result, int(model.stats.get("lm_tokens", 0)) - before

    # -- ingested images --------------------------------------------------------------------------
    def require_ingested(self, sha256: str) -> None:
        """NotFound unless some reference set holds the image and its blob is stored."""
        validate_sha256(sha256)
        with self.catalog.read() as session:
            known = is_sha_referenced(session, sha256)
        if not known or not self.blobs.exists(sha256):
            raise NotFound("image not found; ingest it into a reference set first", sha256=sha256)

    def ingested_image(self, sha256: str) -> StoredImage:
        """An image of any reference set (NotFound if not ingested), read and decoded only if its pixels
        are needed: with its package cached, a reference costs a catalog lookup and nothing more."""
        self.require_ingested(sha256)
        limit = max(self.blobs.size(sha256), self.settings.max_image_bytes)  # it passed the limits at ingestion
        return StoredImage(sha256, lambda: self.blobs.get(sha256), max_bytes=limit,
                           max_pixels=self.settings.max_image_pixels)

    # -- readiness and shutdown -------------------------------------------------------------------
    def readiness(self) -> dict[str, bool]:
        checks = {
            "catalog": _safe(self.catalog.is_ready),
            "index": _safe(self.index.health),
            "embedder": self.embedder_ is not None and _safe(self.embedder_.health),
            "reranker": self.reranker_ is not None and _safe(self.reranker_.health),
        }
        for name in ("ingestion", "search"):
            service = getattr(self, name)
            if service is not None and hasattr(service, "health"):
                checks[name] = _safe(service.health)
        return checks

    def close(self) -> None:
        for closer in reversed(self.closers):
            try:
                closer()
            except Exception:  # one failing closer must not keep the others from running
                log.exception("error while closing a service")
        self.closers.clear()
        for step in (self.packages.close, self.index.close, self.catalog.dispose):
            try:
                step()
            except Exception:
                log.exception("error during shutdown")

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def build(cls, settings: Settings, *, models: bool = True, services: bool = True) -> AppState:
        """Open the stores and load the models; ``models=False`` is for tests of model-free routes."""
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        catalog = Catalog.open(settings.catalog_url)
        try:
            blobs = BlobStore(settings.blobs_dir)
            # Write-behind: a new package is usable at once and reaches disk on a writer thread (the store is
            # a cache: a package lost in a crash is recomputed on its next miss).
            packages = PackageStore(settings.packages_dir, memory_bytes=settings.package_memory_bytes,
                                    disk_bytes=settings.package_disk_bytes, storage_dtype=_storage_dtype(settings),
                                    write_behind=True)
            index = _make_index(settings)
        except BaseException:
            catalog.dispose()
            raise
        state = cls(settings=settings, catalog=catalog, blobs=blobs, packages=packages, index=index)
        try:
            if models:
                state.embedder_, emb_test = _load_model(settings, "embedding", packages)
                state.reranker_, rr_test = _load_model(settings, "reranker", packages)
                state.test_models = emb_test or rr_test
            if services:
                run_services(state)
        except BaseException:
            state.close()
            raise
        return state


def _safe(check: Callable[[], bool]) -> bool:
    try:
        return bool(check())
    except Exception:
        return False


def _storage_dtype(settings: Settings) -> StorageDtype:
    """'auto' stores packages in the compute dtype, so cached and uncached paths see the same values."""
    if settings.package_storage_dtype != "auto":
        return settings.package_storage_dtype
    from retrieval.qwen.loading import resolve_device, resolve_dtype

    compute = resolve_dtype(settings.dtype, resolve_device(settings.device))
    return "bfloat16" if str(compute) == "torch.bfloat16" else "float32"


def run_services(state: AppState) -> None:
    """Build the services listed in :data:`SERVICES` on ``state`` (each hook sets its attribute)."""
    for target in SERVICES:
        module, _, func = target.partition(":")
        getattr(importlib.import_module(module), func)(state)


def _make_index(settings: Settings) -> VectorIndex:
    if settings.vector_backend == "qdrant":
        key = settings.qdrant_api_key.get_secret_value() if settings.qdrant_api_key else None
        return make_index("qdrant", url=settings.qdrant_url, api_key=key)
    # The ingestion runner flushes on an interval and at job end; start-up reconcile repairs a crash gap.
    # (autoflush would rewrite the whole set file after every batch.)
    return make_index("faiss", path=settings.faiss_dir, ann_threshold=settings.faiss_ann_threshold, autoflush=False)


def _options(settings: Settings, kind: ModelKind, backend: str, store: PackageStore) -> dict[str, Any]:
    common: dict[str, Any] = {"store": store, "min_pixels": settings.min_pixels, "max_pixels": settings.max_pixels}
    if backend == "local":
        batch = settings.embed_batch_size if kind == "embedding" else settings.rerank_batch_size
        return {**common, "device": settings.device, "dtype": settings.dtype, "batch_size": batch,
                "image_max_bytes": settings.max_image_bytes, "image_max_pixels": settings.max_image_pixels}
    url = settings.vllm_embedding_url if kind == "embedding" else settings.vllm_reranker_url
    key = settings.vllm_api_key.get_secret_value() if settings.vllm_api_key else None
    # VLLMEmbedder / VLLMReranker read the shared store under the fingerprint of the checkpoint's own tower
    # (device/dtype as a local backend would use them) and send hits as image_embeds, misses raw. The
    # embedder also gets a local vision-only worker (when the weights are here): ingestion needs `.vision`.
    return {**common, "base_url": url, "api_key": key, "read_timeout": settings.vllm_timeout_s,
            "max_retries": settings.vllm_max_retries, "max_concurrency": settings.vllm_concurrency,
            "device": settings.device, "dtype": settings.dtype, "local_vision": kind == "embedding",
            "image_max_bytes": settings.max_image_bytes, "image_max_pixels": settings.max_image_pixels}


def _load_model(settings: Settings, kind: ModelKind, store: PackageStore) -> tuple[Any, bool]:
    """Load one model; on failure fall back to an offline test checkpoint when the settings allow it."""
    from retrieval.qwen.checkpoint import is_test_model

    if kind == "embedding":
        from retrieval.embedding import load_embedder as load
        name, backend = settings.embedding_model, settings.embedding_backend
    else:
        from rerank import load_reranker as load  # type: ignore[assignment]
        name, backend = settings.reranker_model, settings.reranker_backend
    try:
        model = load(name, backend=backend, **_options(settings, kind, backend, store))
        return model, backend == "local" and is_test_model(name)
    except Exception as exc:
        if not settings.fallback_to_test_models:
            raise
        log.warning("cannot load the %s model %r (%s); serving an offline TEST checkpoint instead", kind, name, exc)
    path = _ensure_test_model(settings.data_dir / "test-models", kind)
    return load(str(path), backend="local", **_options(settings, kind, "local", store)), True


def _ensure_test_model(root: Path, kind: ModelKind) -> Path:
    """Generate the test checkpoint once; a file lock keeps concurrent workers from writing it twice."""
    from retrieval.qwen.checkpoint import is_test_model, make_test_model

    root.mkdir(parents=True, exist_ok=True)
    path = root / kind
    with open(root / ".lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_test_model(path):
            log.warning("writing an offline %s test checkpoint to %s", kind, path)
            make_test_model(path, kind)
    return path
