"""Embedded FAISS backend: one index file per set under a directory, exact until big, then HNSW.

Rows live in *slots* (faiss' sequential internal ids). Deleting or replacing an id marks its slot
dead; searches pass a bitmap of live slots to faiss, so a deleted id can never come back, and the
index is rebuilt from its live rows once dead slots pass ``rebuild_ratio``. This works the same for
``IndexFlatIP`` and ``IndexHNSWFlat`` (which cannot delete). Each set is saved as one ``.npz`` (index bytes,
slot ids, live mask, payloads, meta) written to a temp file and ``os.replace``d, so a crash leaves the old or
the new state, never a mix. One process owns a directory (an ``flock`` says so).

With ``device_search`` a set is also mirrored on an accelerator (:mod:`retrieval.index.device_search`)
and searched there exactly, up to ``device_max_bytes`` per set; larger sets keep the CPU path (HNSW).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

from rubricsearch.retrieval.errors import BackendUnavailable, Conflict, NotFound
from rubricsearch.retrieval.index.device_search import DeviceMatrix, make_device_matrix, oversampled, rescore
from rubricsearch.retrieval.index.faiss_files import (
    SetState,
    allowed_slots,
    apply_payloads,
    load_set,
    new_index,
    omp_threads,
    read_meta,
    save_set,
    search_plan,
)
from rubricsearch.retrieval.index.filter_graphs import FilterGraphs
from rubricsearch.retrieval.index.filtered_scan import SCAN_RATIO
from rubricsearch.retrieval.index.filters import Filter, matches
from rubricsearch.retrieval.index.protocol import (
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

SUFFIX = ".idx.npz"


class FaissIndex:
    """:class:`~retrieval.index.protocol.VectorIndex` on faiss-cpu, persisted under ``path``.

    ``autoflush`` saves a set after every write (durable, simple); bulk ingestion of large sets can
    turn it off and call :meth:`flush` at its checkpoints, since a save rewrites the whole set.
    ``search_threads`` caps faiss' OpenMP threads inside :meth:`search` (for the calling thread
    only): one-query searches ran several times slower with OpenMP on a busy 2-core box,
    and concurrent requests already use the cores. ``None`` keeps faiss' default.

    A filter is a slot mask applied inside the search: an ``IDSelectorBitmap`` (exact or HNSW), a masked score matrix
    (device); an HNSW set scans the kept rows exactly where that beats a walk (:mod:`.filtered_scan`), and a
    recurring filter or condition keeping few rows gets a graph serving filters within it (:mod:`.filter_graphs`).
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
        device_search: str | None = None,
        search_device: str = "cuda",
        device_precision: str = "auto",
        device_max_bytes: int = 16 << 30,
        filter_scan_ratio: float = SCAN_RATIO,
        filter_graph_bytes: int = 1 << 30,
    ) -> None:
        self.path = Path(path)
        self.ann_threshold = ann_threshold
        self.hnsw_m = hnsw_m
        self.ef_construction = ef_construction
        self.ef_search = ef_search
        self.rebuild_ratio = rebuild_ratio
        self.autoflush = autoflush
        self.search_threads = search_threads
        self.device_search = device_search
        self.search_device = search_device
        self.device_precision = device_precision
        self.device_max_bytes = device_max_bytes
        self.filter_scan_ratio = filter_scan_ratio
        self.filter_graphs = FilterGraphs(filter_graph_bytes, hnsw_m, ef_construction)
        self._lock = threading.Lock()
        self._sets: dict[str, SetState] = {}
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
                self._sets[check_set_id(set_id)] = SetState(dim=read_meta(file)["dim"])
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
            entry = SetState(dim=dim, index=faiss.IndexFlatIP(dim), dirty=True)
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
            self.filter_graphs.invalidate(set_id)
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
        """A set's dimension, fixed at its creation: read without its lock (searches hold that one)."""
        entry = self._entry(set_id)
        if entry.dropped:
            raise NotFound(f"vector set {set_id!r} does not exist", set_id=set_id)
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
                replaced = old[present & ~same]
                entry.live[replaced] = False
                if entry.mirror is not None:
                    entry.mirror.kill(replaced)
                keep = ~same
                clean_ids = [sha for sha, k in zip(clean_ids, keep, strict=True) if k]
                arr = arr[keep]
            if clean_ids:
                start = len(entry.slot_ids)
                entry.index.add(arr)
                if entry.mirror is not None:
                    entry.mirror.append(arr)
                entry.slot_ids.extend(clean_ids)
                entry.live = np.concatenate([entry.live, np.ones(len(clean_ids), dtype=bool)])
                entry.where.update((sha, start + i) for i, sha in enumerate(clean_ids))
                self._after_write(set_id, entry)

    def delete(self, set_id: str, ids: Iterable[str]) -> None:
        with self._open_set(set_id) as entry:
            gone = [sha for sha in check_ids(ids) if sha in entry.where]
            slots = [entry.where.pop(sha) for sha in gone]
            for sha in gone:
                entry.payloads.pop(sha, None)
            if slots:
                entry.live[slots] = False
                if entry.mirror is not None:
                    entry.mirror.kill(slots)
                self._after_write(set_id, entry)

    def set_payloads(self, set_id: str, payloads: Mapping[str, Mapping[str, Any]]) -> None:
        clean = check_payloads(payloads)
        with self._open_set(set_id) as entry:
            if apply_payloads(entry, clean):
                entry.dirty = True
                if self.autoflush:
                    self._save(set_id, entry)

    def payloads(self, set_id: str, ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        with self._open_set(set_id) as entry:
            return {sha: dict(entry.payloads.get(sha, {})) for sha in check_ids(ids) if sha in entry.where}

    def _after_write(self, set_id: str, entry: SetState) -> None:
        entry.bitmap = None
        entry.payload_index = None
        entry.masks.clear()
        entry.dirty = True
        self.filter_graphs.invalidate(set_id)
        live = len(entry.where)
        if (not entry.ann and live > self._ann_threshold(entry)) or (
            entry.dead and entry.dead > self.rebuild_ratio * len(entry.slot_ids)
        ):
            self._rebuild(entry)
        if self.autoflush:
            self._save(set_id, entry)

    def _rebuild(self, entry: SetState) -> None:
        """Re-create the index from live rows, choosing exact or HNSW by size (with hysteresis)."""
        slots = np.flatnonzero(entry.live)
        vectors = entry.index.reconstruct_batch(slots) if slots.size else np.zeros((0, entry.dim), np.float32)
        threshold = self._ann_threshold(entry)
        entry.ann = len(slots) > (threshold // 2 if entry.ann else threshold)
        entry.index = new_index(entry.dim, entry.ann, self.hnsw_m, self.ef_construction)
        if slots.size:
            entry.index.add(np.ascontiguousarray(vectors, dtype=np.float32))
        entry.slot_ids = [entry.slot_ids[s] for s in slots]
        entry.where = {sha: i for i, sha in enumerate(entry.slot_ids)}
        entry.live = np.ones(len(slots), dtype=bool)
        entry.bitmap = None
        entry.mirror = None  # slots were renumbered

    def _ann_threshold(self, entry: SetState) -> int:
        """Rows above which the set is served by HNSW: with device search, only once the set no longer fits
        the device budget (the device searches exactly, faster than a graph on the CPU)."""
        if self.device_search is None:
            return self.ann_threshold
        return max(self.ann_threshold, self.device_max_bytes // (2 * entry.dim))

    # ---------------------------------------------------------------- reads
    def count(self, set_id: str, filter: Filter | None = None) -> int:
        with self._open_set(set_id) as entry:
            return len(entry.where) if filter is None else allowed_slots(entry, filter).kept

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

    def matching(self, set_id: str, ids: Iterable[str], filter: Filter | None = None) -> set[str]:
        """Each id's payload judged by :func:`~retrieval.index.filters.matches`, which the slot masks agree with:
        O(ids), where a mask would first index the payloads of every row."""
        with self._open_set(set_id) as entry:
            present = {sha for sha in check_ids(ids) if sha in entry.where}
            return present if filter is None else {s for s in present if matches(filter, entry.payloads.get(s, {}))}

    def is_ann(self, set_id: str) -> bool:
        """Whether the set is currently served by the HNSW index (for tests and admin pages)."""
        with self._open_set(set_id) as entry:
            return entry.ann

    def search(self, set_id: str, query: npt.ArrayLike, k: int, filter: Filter | None = None) -> list[list[Hit]]:
        k = check_k(k)
        with self._open_set(set_id) as entry:
            queries = check_queries(query, entry.dim)
            allowed = None if filter is None else allowed_slots(entry, filter)  # alive until faiss has searched
            kk = min(k, len(entry.where) if allowed is None else allowed.kept)
            if kk == 0 or queries.shape[0] == 0:
                return [[] for _ in range(queries.shape[0])]
            mirror = self._mirror(entry)
            if mirror is not None:
                bits = None if allowed is None else allowed.bits
                return self._rescored(entry, queries, mirror.candidates(queries, oversampled(kk), bits), kk)
            graph = None if filter is None else self.filter_graphs.lookup(set_id, entry, filter)
            walk_rows = self.filter_scan_ratio * self.ef_search * self.hnsw_m
            with omp_threads(self.search_threads):
                if graph is not None and allowed is not None:
                    candidates = graph.candidates(queries, oversampled(kk), self.ef_search, allowed)
                    return self._rescored(entry, queries, candidates, kk)
                index, params = search_plan(entry, allowed, kk, self.ef_search, walk_rows)
                scores, slots = index.search(queries, kk, params=params)
            return [
                [Hit(entry.slot_ids[s], float(d)) for s, d in zip(row_s, row_d, strict=True) if s >= 0]
                for row_s, row_d in zip(slots, scores, strict=True)
            ]

    def _mirror(self, entry: SetState) -> DeviceMatrix | None:
        """The set on the accelerator (built now if needed), or None: no device search, or too big."""
        if self.device_search is None:
            return None
        if entry.mirror is None:
            if len(entry.slot_ids) * entry.dim * 2 > self.device_max_bytes:
                return None
            mirror = make_device_matrix(self.device_search, entry.dim, self.search_device, self.device_precision)
            if entry.slot_ids:
                mirror.append(entry.index.reconstruct_n(0, len(entry.slot_ids)))
                mirror.kill(np.flatnonzero(~entry.live))
            entry.mirror = mirror
        return entry.mirror

    def _rescored(self, entry: SetState, queries: FloatArray, cand: npt.NDArray[np.int64], k: int) -> list[list[Hit]]:
        """Candidate slots (-1 pads; a device pass's or a filter graph's) re-scored exactly in float32, best k first."""
        out: list[list[Hit]] = []
        for query, row in zip(queries, cand, strict=True):
            row = row[row >= 0]
            slots, scores = rescore(row, entry.index.reconstruct_batch(row), query, k)
            out.append([Hit(entry.slot_ids[int(s)], float(d)) for s, d in zip(slots, scores, strict=True)])
        return out

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
        self.filter_graphs.wait()
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
    def _open_set(self, set_id: str, *, load: bool = True) -> Iterator[SetState]:
        """Hold a set's lock, loading it from disk on first use."""
        entry = self._entry(set_id)
        with entry.lock:
            if entry.dropped:
                raise NotFound(f"vector set {set_id!r} does not exist", set_id=set_id)
            if load and entry.index is None:
                load_set(self._file(set_id), entry)
            yield entry

    def _entry(self, set_id: str) -> SetState:
        """A set's state (its lock not taken); NotFound for a set never created or gone."""
        check_set_id(set_id)
        with self._lock:
            self._check_open()
            entry = self._sets.get(set_id)
        if entry is None:
            raise NotFound(f"vector set {set_id!r} does not exist", set_id=set_id)
        return entry

    def _file(self, set_id: str) -> Path:
        return self.path / (set_id + SUFFIX)

    def _save(self, set_id: str, entry: SetState) -> None:
        save_set(self.path, self._file(set_id), entry)
