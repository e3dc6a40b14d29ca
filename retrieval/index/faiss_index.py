"""Embedded FAISS backend: one index file per set under a directory, exact until big, then HNSW.

Rows live in *slots* (faiss' sequential internal ids). Deleting or replacing an id marks its slot
dead; searches pass a bitmap of live slots to faiss, so a deleted id can never come back, and the
index is rebuilt from its live rows once dead slots pass ``rebuild_ratio``. This works the same for
``IndexFlatIP`` and ``IndexHNSWFlat`` (which cannot delete). Each set is saved as one ``.npz`` (index bytes,
slot ids, live mask, payloads, meta) written to a temp file and ``os.replace``d, so a crash leaves the old or
the new state, never a mix. One process owns a directory (an ``flock`` says so).

This is the reference implementation: a filter is evaluated on each live row's payload and searched exactly over
the kept rows. The default backend (:mod:`retrieval.index.faiss_accel`, loaded by name from the factory) layers the
fast filtered search and the accelerator copy on it through the hooks marked below; it changes speed, never results
beyond HNSW's approximation.
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
from rubricsearch.retrieval.index.faiss_files import (
    SetState,
    apply_payloads,
    live_bitmap,
    load_set,
    new_index,
    omp_threads,
    read_meta,
    save_set,
)
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
    only): OpenMP's spare threads slow a one-query search down on a busy box with few cores,
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
                self._sets[check_set_id(set_id)] = self._new_state(read_meta(file)["dim"])
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
            entry = self._new_state(dim)
            entry.index, entry.dirty = faiss.IndexFlatIP(dim), True
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
            self._dropped(set_id)
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
                self._killed(entry, replaced)
                keep = ~same
                clean_ids = [sha for sha, k in zip(clean_ids, keep, strict=True) if k]
                arr = arr[keep]
            if clean_ids:
                start = len(entry.slot_ids)
                entry.index.add(arr)
                self._added(entry, arr)
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
                self._killed(entry, np.array(slots, dtype=np.int64))
                self._after_write(set_id, entry)

    def set_payloads(self, set_id: str, payloads: Mapping[str, Mapping[str, Any]]) -> None:
        clean = check_payloads(payloads)
        with self._open_set(set_id) as entry:
            if apply_payloads(entry, clean):
                self._payloads_changed(entry)
                entry.dirty = True
                if self.autoflush:
                    self._save(set_id, entry)

    def payloads(self, set_id: str, ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        with self._open_set(set_id) as entry:
            return {sha: dict(entry.payloads.get(sha, {})) for sha in check_ids(ids) if sha in entry.where}

    def _after_write(self, set_id: str, entry: SetState) -> None:
        entry.bitmap = None
        entry.dirty = True
        self._rows_changed(set_id, entry)
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
        self._renumbered(entry)

    def _ann_threshold(self, entry: SetState) -> int:
        """Rows above which the set is served by HNSW."""
        return self.ann_threshold

    # ---------------------------------------------------------------- reads
    def count(self, set_id: str, filter: Filter | None = None) -> int:
        with self._open_set(set_id) as entry:
            return len(entry.where) if filter is None else int(self._kept(entry, filter).sum())

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
            return self._search(set_id, entry, check_queries(query, entry.dim), k, filter)

    def _search(self, set_id: str, entry: SetState, queries: FloatArray, k: int, filter: Filter | None
                ) -> list[list[Hit]]:
        """Unfiltered: the set's index (exact or HNSW) past its dead slots. Filtered: an exact search of the kept
        rows, through a selector over the flat rows (an HNSW set's storage)."""
        kept = None if filter is None else self._kept(entry, filter)
        kk = min(k, len(entry.where) if kept is None else int(kept.sum()))
        if kk == 0 or queries.shape[0] == 0:
            return [[] for _ in range(queries.shape[0])]
        index, params = entry.index, faiss.SearchParameters()
        bits: npt.NDArray[np.uint8] | None
        if kept is not None:
            index = faiss.downcast_index(entry.index.storage) if entry.ann else entry.index
            bits = np.packbits(kept, bitorder="little")
        else:
            if entry.ann:
                params = faiss.SearchParametersHNSW(efSearch=max(self.ef_search, kk))  # type: ignore[attr-defined]
            bits = live_bitmap(entry) if entry.dead else None
        if bits is not None:  # ``bits`` outlives the search: faiss reads it through the selector
            params.sel = faiss.IDSelectorBitmap(len(entry.live), faiss.swig_ptr(bits))
        with omp_threads(self.search_threads):
            scores, slots = index.search(queries, kk, params=params)
        return self._hits(entry, scores, slots)

    def _kept(self, entry: SetState, filter: Filter) -> npt.NDArray[np.bool_]:
        """Per slot, whether it is live and its payload passes ``filter``."""
        kept = np.zeros(len(entry.slot_ids), dtype=bool)
        for sha, slot in entry.where.items():
            kept[slot] = matches(filter, entry.payloads.get(sha, {}))
        return kept

    @staticmethod
    def _hits(entry: SetState, scores: npt.NDArray[np.float32], slots: npt.NDArray[np.int64]) -> list[list[Hit]]:
        return [
            [Hit(entry.slot_ids[s], float(d)) for s, d in zip(row_s, row_d, strict=True) if s >= 0]
            for row_s, row_d in zip(slots, scores, strict=True)
        ]

    # ------------------------------------------------ hooks (a layered index overrides them)
    def _new_state(self, dim: int) -> SetState:
        """A set's empty state (a layered index adds its caches)."""
        return SetState(dim=dim)

    def _added(self, entry: SetState, rows: FloatArray) -> None:
        """Rows were appended to the set's slots."""

    def _killed(self, entry: SetState, slots: npt.NDArray[np.int64]) -> None:
        """Slots died (deleted or replaced ids)."""

    def _rows_changed(self, set_id: str, entry: SetState) -> None:
        """A write changed the set's rows (called before a possible rebuild and save)."""

    def _payloads_changed(self, entry: SetState) -> None:
        """The payloads of some live ids changed."""

    def _renumbered(self, entry: SetState) -> None:
        """The set was rebuilt from its live rows: slots were renumbered."""

    def _dropped(self, set_id: str) -> None:
        """The set was dropped."""

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
