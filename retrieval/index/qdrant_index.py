"""Qdrant backend: one collection per set, for a Qdrant server or qdrant-client's local mode.

Point ids are UUIDs made from the first 32 hex digits of the image sha256, so re-upserting an image
overwrites its point; the full sha256 travels in the payload, the image's metadata under its ``meta`` key,
where filters (:mod:`retrieval.index.filters`, Qdrant's own JSON) reach it as ``meta.<key>``. Server calls
are retried with exponential backoff on transient failures and then surface as ``BackendUnavailable``. Local mode
(``path=`` a folder or ``":memory:"``) is what the tests run, since no server runs here.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from rubricsearch.retrieval.errors import BackendUnavailable, Conflict, InvalidInput, NotFound, require
from rubricsearch.retrieval.index.filters import Condition, Filter, Match
from rubricsearch.retrieval.index.protocol import (
    SET_ID_RE,
    FloatArray,
    Hit,
    check_dim,
    check_ids,
    check_k,
    check_payloads,
    check_queries,
    check_set_id,
    check_vectors,
)

T = TypeVar("T")
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
SCROLL_PAGE = 1024
META = "meta"


def point_id(sha256: str) -> str:
    """Deterministic point id: a UUID from the first 128 bits of the sha256."""
    return str(uuid.UUID(hex=sha256[:32]))


class QdrantIndex:
    """:class:`~retrieval.index.protocol.VectorIndex` on Qdrant collections named ``prefix + set_id``."""

    def __init__(
        self,
        url: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float = 10.0,
        path: str | None = None,
        prefix: str = "rubricsearch_",
        batch_size: int = 256,
        retries: int = 3,
        backoff_s: float = 0.5,
        exact: bool = False,
        hnsw_ef: int | None = None,
    ) -> None:
        if (url is None) == (path is None):
            raise InvalidInput("QdrantIndex needs exactly one of url= (server) or path= (a local folder or ':memory:')")
        if batch_size < 1:
            raise InvalidInput(f"batch_size must be positive, got {batch_size}")
        qdrant_client = require("qdrant_client", "qdrant")
        self._models: Any = require("qdrant_client.models", "qdrant")
        self._exc: Any = require("qdrant_client.http.exceptions", "qdrant")
        self.prefix = prefix
        self.batch_size = batch_size
        self.retries = retries if url is not None else 0  # local mode has nothing transient
        self.backoff_s = backoff_s
        self.server = url is not None
        # Local mode is always brute force and warns about search params, so only servers get them.
        use_params = self.server and (exact or hnsw_ef is not None)
        self._search_params = self._models.SearchParams(exact=exact, hnsw_ef=hnsw_ef) if use_params else None
        # Local mode is a single sqlite-backed object: serialise calls and allow any thread.
        self._local_lock: threading.Lock | None = None if self.server else threading.Lock()
        self._dims: dict[str, int] = {}
        try:
            if url is not None:
                self._client = qdrant_client.QdrantClient(
                    url=url, api_key=api_key, timeout=math.ceil(timeout), check_compatibility=False
                )
            elif path == ":memory:":
                self._client = qdrant_client.QdrantClient(location=":memory:")
            else:
                self._client = qdrant_client.QdrantClient(path=path, force_disable_check_same_thread=True)
        except RuntimeError as exc:  # local folder already opened by another client
            raise BackendUnavailable(f"cannot open Qdrant storage {path}: {exc}") from exc

    # ----------------------------------------------------------------- sets
    def create_set(self, set_id: str, dim: int) -> None:
        name = self._name(set_id)
        dim = check_dim(dim)
        if not self._call(lambda: self._client.collection_exists(name)):
            vectors = self._models.VectorParams(size=dim, distance=self._models.Distance.DOT)
            try:
                self._call(lambda: self._client.create_collection(name, vectors_config=vectors))
                self._dims[set_id] = dim
                return
            except Exception:
                if not self._call(lambda: self._client.collection_exists(name)):
                    raise  # a real failure, not a concurrent create
        existing = self.dim(set_id)
        if existing != dim:
            raise Conflict(f"set {set_id!r} already exists with dimension {existing}, not {dim}", set_id=set_id)

    def drop_set(self, set_id: str) -> None:
        name = self._name(set_id)
        self._dims.pop(set_id, None)
        if not self._call(lambda: self._client.delete_collection(name), set_id):
            raise NotFound(f"vector set {set_id!r} does not exist", set_id=set_id)

    def has_set(self, set_id: str) -> bool:
        name = self._name(set_id)
        return bool(self._call(lambda: self._client.collection_exists(name)))

    def list_sets(self) -> dict[str, int]:
        collections = self._call(lambda: self._client.get_collections().collections)
        names = [c.name[len(self.prefix) :] for c in collections if c.name.startswith(self.prefix)]
        names = [n for n in names if SET_ID_RE.match(n)]  # skip foreign collections sharing the prefix
        return {set_id: self.dim(set_id) for set_id in sorted(names)}

    def dim(self, set_id: str) -> int:
        name = self._name(set_id)
        if set_id not in self._dims:
            info = self._call(lambda: self._client.get_collection(name), set_id)
            self._dims[set_id] = int(info.config.params.vectors.size)
        return self._dims[set_id]

    # --------------------------------------------------------------- writes
    def upsert(self, set_id: str, ids: Sequence[str], vectors: npt.ArrayLike) -> None:
        name = self._name(set_id)
        clean_ids, arr = check_vectors(ids, vectors, self.dim(set_id))
        for start in range(0, len(clean_ids), self.batch_size):
            chunk = clean_ids[start : start + self.batch_size]
            kept = self._payloads(name, set_id, chunk)  # an upsert replaces the point; its metadata stays
            batch = self._models.Batch(
                ids=[point_id(sha) for sha in chunk],
                vectors=arr[start : start + self.batch_size].tolist(),
                payloads=[{"set_id": set_id, "sha256": sha, META: kept.get(sha, {})} for sha in chunk],
            )
            self._call(partial(self._client.upsert, name, points=batch, wait=True), set_id)

    def set_payloads(self, set_id: str, payloads: Mapping[str, Mapping[str, Any]]) -> None:
        name = self._name(set_id)
        clean = check_payloads(payloads)
        self.dim(set_id)  # NotFound for an unknown set
        shas = list(clean)
        for start in range(0, len(shas), self.batch_size):
            chunk = shas[start : start + self.batch_size]
            present = self._payloads(name, set_id, chunk, present=True)
            ops = [self._models.SetPayloadOperation(set_payload=self._models.SetPayload(
                payload={META: clean[sha]}, points=[point_id(sha)])) for sha in chunk if sha in present]
            if ops:
                self._call(partial(self._client.batch_update_points, name, update_operations=ops, wait=True),
                           set_id)

    def payloads(self, set_id: str, ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        name = self._name(set_id)
        shas = check_ids(ids)
        self.dim(set_id)  # NotFound for an unknown set
        out: dict[str, dict[str, Any]] = {}
        for start in range(0, len(shas), self.batch_size):
            out.update(self._payloads(name, set_id, shas[start : start + self.batch_size], present=True))
        return out

    def _payloads(self, name: str, set_id: str, shas: Sequence[str], *,
                  present: bool = False) -> dict[str, dict[str, Any]]:
        """Stored metadata of those ids in the set (``present``: every stored id, even without metadata)."""
        fetch = partial(self._client.retrieve, name, ids=[point_id(sha) for sha in shas],
                        with_payload=["sha256", META], with_vectors=False)
        wanted = set(shas)
        out: dict[str, dict[str, Any]] = {}
        for record in self._call(fetch, set_id):
            sha = str(record.payload["sha256"])
            meta = record.payload.get(META) or {}
            if sha in wanted and (meta or present):
                out[sha] = dict(meta)
        return out

    def delete(self, set_id: str, ids: Iterable[str]) -> None:
        name = self._name(set_id)
        clean = check_ids(ids)
        self.dim(set_id)  # NotFound for an unknown set, even with nothing to delete
        for start in range(0, len(clean), self.batch_size):
            chunk = clean[start : start + self.batch_size]
            selector = self._models.PointIdsList(points=[point_id(sha) for sha in chunk])
            self._call(partial(self._client.delete, name, points_selector=selector, wait=True), set_id)

    # ---------------------------------------------------------------- reads
    def count(self, set_id: str, filter: Filter | None = None) -> int:
        name = self._name(set_id)
        native = None if filter is None else self._filter(filter)
        return int(self._call(lambda: self._client.count(name, count_filter=native, exact=True).count, set_id))

    def ids(self, set_id: str) -> set[str]:
        name = self._name(set_id)
        out: set[str] = set()
        offset: Any = None
        while True:
            page = partial(
                self._client.scroll,
                name,
                limit=SCROLL_PAGE,
                offset=offset,
                with_payload=["sha256"],
                with_vectors=False,
            )
            records, offset = self._call(page, set_id)
            out.update(str(r.payload["sha256"]) for r in records)
            if offset is None:
                return out

    def vectors(self, set_id: str, ids: Iterable[str]) -> dict[str, FloatArray]:
        name = self._name(set_id)
        wanted = list(dict.fromkeys(check_ids(ids)))
        self.dim(set_id)  # NotFound for an unknown set, even when asked for nothing
        out: dict[str, FloatArray] = {}
        for start in range(0, len(wanted), self.batch_size):
            chunk = wanted[start : start + self.batch_size]
            fetch = partial(
                self._client.retrieve,
                name,
                ids=[point_id(sha) for sha in chunk],
                with_payload=["sha256"],
                with_vectors=True,
            )
            for record in self._call(fetch, set_id):
                sha = str(record.payload["sha256"])
                if sha in chunk:  # never hand back another image that shares the 128-bit point id
                    out[sha] = np.asarray(record.vector, dtype=np.float32)
        return out

    def matching(self, set_id: str, ids: Iterable[str], filter: Filter | None = None) -> set[str]:
        """A scroll whose filter is the request's and a ``has_id`` of the ids' points: Qdrant judges only them."""
        name = self._name(set_id)
        wanted = list(dict.fromkeys(check_ids(ids)))
        self.dim(set_id)  # NotFound for an unknown set, even when asked for nothing
        m = self._models
        out: set[str] = set()
        for start in range(0, len(wanted), self.batch_size):
            chunk = wanted[start : start + self.batch_size]
            points = m.HasIdCondition(has_id=[point_id(sha) for sha in chunk])
            native = m.Filter(must=[points] if filter is None else [points, self._filter(filter)])
            page = partial(self._client.scroll, name, scroll_filter=native, limit=len(chunk),
                           with_payload=["sha256"], with_vectors=False)
            records, _ = self._call(page, set_id)
            # never another image that shares the 128-bit point id
            out.update(sha for r in records if (sha := str(r.payload["sha256"])) in chunk)
        return out

    def search(self, set_id: str, query: npt.ArrayLike, k: int, filter: Filter | None = None) -> list[list[Hit]]:
        name = self._name(set_id)
        k = check_k(k)
        queries = check_queries(query, self.dim(set_id))
        if queries.shape[0] == 0:
            return []
        native = None if filter is None else self._filter(filter)
        requests = [
            self._models.QueryRequest(query=row.tolist(), limit=k, filter=native, with_payload=["sha256"],
                                      params=self._search_params)
            for row in queries
        ]
        responses = self._call(lambda: self._client.query_batch_points(name, requests=requests), set_id)
        return [[Hit(str(p.payload["sha256"]), float(p.score)) for p in r.points] for r in responses]

    # ------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        """Every write already waited for the store's acknowledgement; nothing is buffered here."""

    def close(self) -> None:
        self._client.close()

    def health(self) -> bool:
        try:
            self._call(lambda: self._client.get_collections(), retries=0)
        except BackendUnavailable:
            return False
        return True

    # -------------------------------------------------------------- helpers
    def _filter(self, f: Filter) -> Any:
        """The filter as Qdrant's own models, keys moved under the payload's ``meta`` object."""
        m = self._models

        def condition(c: Condition) -> Any:
            if isinstance(c, Filter):
                return self._filter(c)
            key = f"{META}.{c.key}"
            if not isinstance(c, Match):
                return m.FieldCondition(key=key, range=m.Range(gt=c.gt, gte=c.gte, lt=c.lt, lte=c.lte))
            if not c.any:
                return m.FieldCondition(key=key, match=m.MatchValue(value=c.values[0]))
            if all(isinstance(v, str) for v in c.values) or all(type(v) is int for v in c.values):
                return m.FieldCondition(key=key, match=m.MatchAny(any=list(c.values)))
            # MatchAny takes one type of strings or integers; a mixed list is the same "any" as a should
            return m.Filter(should=[m.FieldCondition(key=key, match=m.MatchValue(value=v)) for v in c.values])

        return m.Filter(must=[condition(c) for c in f.must] or None,
                        should=[condition(c) for c in f.should] or None,
                        must_not=[condition(c) for c in f.must_not] or None)

    def _name(self, set_id: str) -> str:
        return self.prefix + check_set_id(set_id)

    def _call(self, fn: Callable[[], T], set_id: str | None = None, *, retries: int | None = None) -> T:
        """Run one client call: retry transient failures, translate the rest into domain errors."""
        budget = self.retries if retries is None else retries
        attempt = 0
        while True:
            try:
                if self._local_lock is None:
                    return fn()
                with self._local_lock:
                    return fn()
            except Exception as exc:
                status = getattr(exc, "status_code", None)
                missing = status == 404 or (isinstance(exc, ValueError) and "not found" in str(exc))
                if missing and set_id is not None:
                    self._dims.pop(set_id, None)
                    raise NotFound(f"vector set {set_id!r} does not exist", set_id=set_id) from exc
                if status in (400, 422):
                    raise InvalidInput(f"Qdrant rejected the request: {exc}") from exc
                if status in (401, 403):
                    raise BackendUnavailable(
                        f"Qdrant refused the credentials (HTTP {status}): check the API key"
                    ) from exc
                if not self._transient(exc, status):
                    if isinstance(exc, self._exc.UnexpectedResponse):
                        raise BackendUnavailable(f"Qdrant answered HTTP {status}: {exc}") from exc
                    raise
                if attempt >= budget:
                    raise BackendUnavailable(f"Qdrant is unavailable after {attempt + 1} attempt(s): {exc}") from exc
                time.sleep(self.backoff_s * 2**attempt)
                attempt += 1

    def _transient(self, exc: Exception, status: int | None) -> bool:
        if isinstance(exc, self._exc.UnexpectedResponse):
            return status in TRANSIENT_STATUS
        return isinstance(exc, self._exc.ResponseHandlingException | ConnectionError | TimeoutError) or (
            type(exc).__module__.startswith(("httpx", "httpcore"))
        )
