"""Embedded FAISS backend: one index file per set under a directory, exact until big, then HNSW.

Rows live in *slots* (faiss' sequential internal ids). Deleting or replacing an id marks its slot
dead; searches pass a bitmap of live slots to faiss, so a deleted id can never come back, and the
index is rebuilt from its live rows once dead slots pass ``rebuild_ratio``. This works the same for
``IndexFlatIP`` and ``IndexHNSWFlat`` (which cannot delete). Each set is saved as one ``.npz``
(index bytes, slot ids, live mask, meta) written to a temp file and ``os.replace``d, so a crash
leaves the old or the new state, never a mix. One process owns a directory (an ``flock`` says so).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

from retrieval.errors import BackendUnavailable, Conflict, NotFound
from retrieval.index.protocol import (
    FloatArray,
    Hit,
    check_dim,
    check_ids,
    check_k,
    check_queries,
    check_set_id,
    check_vectors,
)

SUFFIX = ".idx.npz"
FORMAT_VERSION = 1


@dataclass
class _Set:
    dim: int
    ann: bool = False
    index: Any = None  # faiss.Index once loaded; None until first use of a set found on disk
    slot_ids: list[str] = field(default_factory=list)
    live: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=bool))
    where: dict[str, int] = field(default_factory=dict)  # live id -> slot
    bitmap: npt.NDArray[np.uint8] | None = None  # packed live mask, cached between writes
    dirty: bool = False
    dropped: bool = False
    lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def dead(self) -> int:
        return len(self.slot_ids) - len(self.where)


class FaissIndex:
    """:class:`~retrieval.index.protocol.VectorIndex` on faiss-cpu, persisted under ``path``.

    ``autoflush`` saves a set after every write (durable, simple); bulk ingestion of large sets can
    turn it off and call :meth:`flush` at its checkpoints, since a save rewrites the whole set.
    ``search_threads`` caps faiss' OpenMP threads inside :meth:`search` (for the calling thread
    only): one-query searches ran several times slower with OpenMP on a busy 2-core box,
    and concurrent requests already use the cores. ``None`` keeps faiss' default.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        ann_threshold: int = 50_000,
        hnsw_m: int = 32,
        ef_construction: int = 80,
        ef_search: int = 128,
        rebuild_ratio: float = 0.25,
        autoflush: bool = True,
        search_threads: int | None = 1,
    ) -> None:
        self.path = Path(path)
        self.ann_threshold = ann_threshold
        self.hnsw_m = hnsw_m
        self.ef_construction = ef_construction
        self.ef_search = ef_search
        self.rebuild_ratio = rebuild_ratio
        self.autoflush = autoflush
        self.search_threads = search_threads
        self._lock = threading.Lock()
        self._sets: dict[str, _Set] = {}
        self._closed = False
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lockfile = open(self.path / ".lock", "a+b")  # noqa: SIM115 - held until close()
        except OSError as exc:
            raise BackendUnavailable(f"cannot open FAISS index directory {self.path}: {exc}") from exc
        try:
            fcntl.flock(self._lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._lockfile.close()
            raise BackendUnavailable(
                f"FAISS index directory {self.path} is in use by another FaissIndex or process; "
                "close it first (one owner per directory)"
            ) from exc
        try:
            for stale in self.path.glob(".*.tmp"):  # left by a crash mid-save; the old file is intact
                stale.unlink(missing_ok=True)
            for file in sorted(self.path.glob("*" + SUFFIX)):
                set_id = file.name[: -len(SUFFIX)]
                self._sets[check_set_id(set_id)] = _Set(dim=self._read_meta(file)["dim"])
        except BaseException:
            self._lockfile.close()
            raise

    # ----------------------------------------------------------------- sets
    def create_set(self, set_id: str, dim: int) -> None:
        check_set_id(set_id)
        dim = check_dim(dim)
        with self._lock:
            self._check_open()
            existing = self._sets.get(set_id)
            if existing is not None:
                if existing.dim != dim:
                    raise Conflict(
                        f"set {set_id!r} already exists with dimension {existing.dim}, not {dim}",
                        set_id=set_id,
                    )
                return
            entry = _Set(dim=dim, index=faiss.IndexFlatIP(dim), dirty=True)
            self._sets[set_id] = entry
        if self.autoflush:
            with entry.lock:
                if not entry.dropped:
                    self._save(set_id, entry)

    def drop_set(self, set_id: str) -> None:
        with self._lock:
            self._check_open()
            entry = self._sets.pop(check_set_id(set_id), None)
            if entry is None:
                raise NotFound(f"vector set {set_id!r} does not exist", set_id=set_id)
        with entry.lock:
            entry.dropped = True
            entry.index = None
            (self.path / (set_id + SUFFIX)).unlink(missing_ok=True)

    def has_set(self, set_id: str) -> bool:
        with self._lock:
            self._check_open()
            return check_set_id(set_id) in self._sets

    def list_sets(self) -> dict[str, int]:
        with self._lock:
            self._check_open()
            return {set_id: entry.dim for set_id, entry in self._sets.items()}

    def dim(self, set_id: str) -> int:
        with self._open_set(set_id, load=False) as entry:
            return entry.dim

    # --------------------------------------------------------------- writes
    def upsert(self, set_id: str, ids: Sequence[str], vectors: npt.ArrayLike) -> None:
        with self._open_set(set_id) as entry:
            clean_ids, arr = check_vectors(ids, vectors, entry.dim)
            if not clean_ids:
                return
            old = np.array([entry.where.get(sha, -1) for sha in clean_ids], dtype=np.int64)
            present = old >= 0
            if present.any():
                # Re-ingesting the same image is common; leave identical rows in place.
                same = np.zeros(len(clean_ids), dtype=bool)
                stored = entry.index.reconstruct_batch(old[present])
                same[present] = (stored == arr[present]).all(axis=1)
                entry.live[old[present & ~same]] = False
                keep = ~same
                clean_ids = [sha for sha, k in zip(clean_ids, keep, strict=True) if k]
                arr = arr[keep]
            if clean_ids:
                start = len(entry.slot_ids)
                entry.index.add(arr)
                entry.slot_ids.extend(clean_ids)
                entry.live = np.concatenate([entry.live, np.ones(len(clean_ids), dtype=bool)])
                entry.where.update((sha, start + i) for i, sha in enumerate(clean_ids))
                self._after_write(set_id, entry)

    def delete(self, set_id: str, ids: Iterable[str]) -> None:
        with self._open_set(set_id) as entry:
            slots = [entry.where.pop(sha) for sha in check_ids(ids) if sha in entry.where]
            if slots:
                entry.live[slots] = False
                self._after_write(set_id, entry)

    def _after_write(self, set_id: str, entry: _Set) -> None:
        entry.bitmap = None
        entry.dirty = True
        live = len(entry.where)
        if (not entry.ann and live > self.ann_threshold) or (
            entry.dead and entry.dead > self.rebuild_ratio * len(entry.slot_ids)
        ):
            self._rebuild(entry)
        if self.autoflush:
            self._save(set_id, entry)

    def _rebuild(self, entry: _Set) -> None:
        """Re-create the index from live rows, choosing exact or HNSW by size (with hysteresis)."""
        slots = np.flatnonzero(entry.live)
        vectors = entry.index.reconstruct_batch(slots) if slots.size else np.zeros((0, entry.dim), np.float32)
        entry.ann = len(slots) > (self.ann_threshold // 2 if entry.ann else self.ann_threshold)
        entry.index = self._new_index(entry.dim, entry.ann)
        if slots.size:
            entry.index.add(np.ascontiguousarray(vectors, dtype=np.float32))
        entry.slot_ids = [entry.slot_ids[s] for s in slots]
        entry.where = {sha: i for i, sha in enumerate(entry.slot_ids)}
        entry.live = np.ones(len(slots), dtype=bool)
        entry.bitmap = None

    def _new_index(self, dim: int, ann: bool) -> Any:
        if not ann:
            return faiss.IndexFlatIP(dim)
        index = faiss.IndexHNSWFlat(dim, self.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = self.ef_construction
        return index

    # ---------------------------------------------------------------- reads
    def count(self, set_id: str) -> int:
        with self._open_set(set_id) as entry:
            return len(entry.where)

    def ids(self, set_id: str) -> set[str]:
        with self._open_set(set_id) as entry:
            return set(entry.where)

    def vectors(self, set_id: str, ids: Iterable[str]) -> dict[str, FloatArray]:
        with self._open_set(set_id) as entry:
            wanted = [sha for sha in dict.fromkeys(check_ids(ids)) if sha in entry.where]
            if not wanted:
                return {}
            rows = entry.index.reconstruct_batch(np.array([entry.where[sha] for sha in wanted], dtype=np.int64))
            return dict(zip(wanted, rows, strict=True))

    def is_ann(self, set_id: str) -> bool:
        """Whether the set is currently served by the HNSW index (for tests and admin pages)."""
        with self._open_set(set_id) as entry:
            return entry.ann

    def search(self, set_id: str, query: npt.ArrayLike, k: int) -> list[list[Hit]]:
        k = check_k(k)
        with self._open_set(set_id) as entry:
            queries = check_queries(query, entry.dim)
            kk = min(k, len(entry.where))
            if kk == 0 or queries.shape[0] == 0:
                return [[] for _ in range(queries.shape[0])]
            params: Any = (
                faiss.SearchParametersHNSW()  # type: ignore[attr-defined]
                if entry.ann
                else faiss.SearchParameters()
            )
            if entry.ann:
                params.efSearch = max(self.ef_search, kk)
            bitmap = None
            if entry.dead:
                if entry.bitmap is None:
                    entry.bitmap = np.packbits(entry.live, bitorder="little")
                bitmap = entry.bitmap  # kept referenced while faiss reads it
                params.sel = faiss.IDSelectorBitmap(len(entry.live), faiss.swig_ptr(bitmap))
            with _omp_threads(self.search_threads):
                scores, slots = entry.index.search(queries, kk, params=params)
            del bitmap
            return [
                [Hit(entry.slot_ids[s], float(d)) for s, d in zip(row_s, row_d, strict=True) if s >= 0]
                for row_s, row_d in zip(slots, scores, strict=True)
            ]

    # ------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        with self._lock:
            self._check_open()
            items = list(self._sets.items())
        for set_id, entry in items:
            with entry.lock:
                if entry.dirty and not entry.dropped:
                    self._save(set_id, entry)

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        with self._lock:
            self._closed = True
            self._sets.clear()
            self._lockfile.close()  # releases the flock

    def health(self) -> bool:
        return not self._closed and self.path.is_dir() and os.access(self.path, os.W_OK)

    # -------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailable("the FAISS index has been closed")

    @contextlib.contextmanager
    def _open_set(self, set_id: str, *, load: bool = True) -> Iterator[_Set]:
        """Hold a set's lock, loading it from disk on first use."""
        check_set_id(set_id)
        with self._lock:
            self._check_open()
            entry = self._sets.get(set_id)
        if entry is None:
            raise NotFound(f"vector set {set_id!r} does not exist", set_id=set_id)
        with entry.lock:
            if entry.dropped:
                raise NotFound(f"vector set {set_id!r} does not exist", set_id=set_id)
            if load and entry.index is None:
                self._load(set_id, entry)
            yield entry

    def _file(self, set_id: str) -> Path:
        return self.path / (set_id + SUFFIX)

    @staticmethod
    def _read_meta(file: Path) -> dict[str, Any]:
        try:
            with np.load(file, allow_pickle=False) as data:
                meta: dict[str, Any] = json.loads(data["meta"].tobytes())
        except Exception as exc:
            raise BackendUnavailable(f"cannot read FAISS index file {file}: {exc}") from exc
        if meta.get("format") != FORMAT_VERSION:
            raise BackendUnavailable(f"{file} has unknown index format {meta.get('format')!r}")
        return meta

    def _load(self, set_id: str, entry: _Set) -> None:
        file = self._file(set_id)
        with np.load(file, allow_pickle=False) as data:
            meta = json.loads(data["meta"].tobytes())
            index = faiss.deserialize_index(np.ascontiguousarray(data["index"]))
            slot_ids = data["ids"].astype(str).tolist()
            live = data["live"].astype(bool)
        if index.d != entry.dim or index.ntotal != len(slot_ids) or len(live) != len(slot_ids):
            raise BackendUnavailable(f"{file} is inconsistent (dimension or row count)")
        entry.index, entry.ann = index, bool(meta["ann"])
        entry.slot_ids, entry.live = slot_ids, live
        entry.where = {sha: i for i, sha in enumerate(slot_ids) if live[i]}

    def _save(self, set_id: str, entry: _Set) -> None:
        meta = {"format": FORMAT_VERSION, "dim": entry.dim, "ann": entry.ann, "count": len(entry.where)}
        fd, tmp = tempfile.mkstemp(prefix=f".{set_id}.", suffix=".tmp", dir=self.path)
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(
                    fh,
                    meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                    index=faiss.serialize_index(entry.index),
                    ids=np.array(entry.slot_ids, dtype="S64"),
                    live=entry.live,
                )
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self._file(set_id))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        entry.dirty = False


@contextlib.contextmanager
def _omp_threads(n: int | None) -> Iterator[None]:
    """Set OpenMP's thread count for this thread only (an OpenMP per-thread setting) and restore it."""
    if n is None:
        yield
        return
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(n)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)
