"""The default FAISS backend: the reference :class:`~retrieval.index.faiss_index.FaissIndex` with fast filtered
search and an accelerator copy layered on through its hooks.

A filter is a slot mask from the payload bitmaps (:mod:`.payload_index`), applied inside the search: an
``IDSelectorBitmap`` (exact or HNSW, the walk's beam widened for recall), a masked score matrix (device); an HNSW
set scans the kept rows exactly where that beats a walk (:mod:`.filtered_scan`), and a recurring filter or condition
keeping few rows gets a graph serving filters within it (:mod:`.filter_graphs`). With ``device_search`` a set is also
mirrored on an accelerator (:mod:`.device_search`) and searched there exactly, up to ``device_max_bytes`` per set;
larger sets keep the CPU path (HNSW).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import numpy.typing as npt

from rubricsearch.retrieval.index.faiss_accel.device_search import (
    DeviceMatrix,
    choose,
    make_device_matrix,
    oversampled,
    rescore,
)
from rubricsearch.retrieval.index.faiss_accel.filter_graphs import FilterGraphs
from rubricsearch.retrieval.index.faiss_accel.filtered_scan import SCAN_RATIO
from rubricsearch.retrieval.index.faiss_accel.plans import AccelState, allowed_slots, search_plan
from rubricsearch.retrieval.index.faiss_files import SetState, omp_threads
from rubricsearch.retrieval.index.faiss_index import FaissIndex
from rubricsearch.retrieval.index.filters import Filter
from rubricsearch.retrieval.index.protocol import FloatArray, Hit


def _state(entry: SetState) -> AccelState:
    assert isinstance(entry, AccelState)  # every set of this index is made by _new_state
    return entry


class AcceleratedFaissIndex(FaissIndex):
    """:class:`FaissIndex` with filtered search at the speed of an unfiltered one and an optional device copy."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device_search: str | None = None,
        search_device: str = "cuda",
        device_precision: str = "auto",
        device_max_bytes: int = 16 << 30,
        filter_scan_ratio: float = SCAN_RATIO,
        filter_graph_bytes: int = 1 << 30,
        **options: Any,
    ) -> None:
        # the setting's words ("auto", "cpu") or a kind ("torch", "faiss-gpu"); None: no device copy
        self.device_search = None if device_search is None else choose(device_search)
        self.search_device = search_device
        self.device_precision = device_precision
        self.device_max_bytes = device_max_bytes
        self.filter_scan_ratio = filter_scan_ratio
        super().__init__(path, **options)
        self.filter_graphs = FilterGraphs(filter_graph_bytes, self.hnsw_m, self.ef_construction)

    # ------------------------------------------------------------------ reads
    def count(self, set_id: str, filter: Filter | None = None) -> int:
        with self._open_set(set_id) as entry:
            return len(entry.where) if filter is None else allowed_slots(_state(entry), filter).kept

    def _search(self, set_id: str, entry: SetState, queries: FloatArray, k: int, filter: Filter | None
                ) -> list[list[Hit]]:
        state = _state(entry)
        allowed = None if filter is None else allowed_slots(state, filter)  # alive until faiss has searched
        kk = min(k, len(state.where) if allowed is None else allowed.kept)
        if kk == 0 or queries.shape[0] == 0:
            return [[] for _ in range(queries.shape[0])]
        mirror = self._mirror(state)
        if mirror is not None:
            bits = None if allowed is None else allowed.bits
            return self._rescored(state, queries, mirror.candidates(queries, oversampled(kk), bits), kk)
        graph = None if filter is None else self.filter_graphs.lookup(set_id, state, filter)
        walk_rows = self.filter_scan_ratio * self.ef_search * self.hnsw_m
        with omp_threads(self.search_threads):
            if graph is not None and allowed is not None:
                candidates = graph.candidates(queries, oversampled(kk), self.ef_search, allowed)
                return self._rescored(state, queries, candidates, kk)
            index, params = search_plan(state, allowed, kk, self.ef_search, walk_rows)
            scores, slots = index.search(queries, kk, params=params)
        return self._hits(state, scores, slots)

    def _mirror(self, entry: AccelState) -> DeviceMatrix | None:
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

    def _rescored(self, entry: AccelState, queries: FloatArray, cand: npt.NDArray[np.int64], k: int
                  ) -> list[list[Hit]]:
        """Candidate slots (-1 pads; a device pass's or a filter graph's) re-scored exactly in float32, best k first."""
        out: list[list[Hit]] = []
        for query, row in zip(queries, cand, strict=True):
            row = row[row >= 0]
            slots, scores = rescore(row, entry.index.reconstruct_batch(row), query, k)
            out.append([Hit(entry.slot_ids[int(s)], float(d)) for s, d in zip(slots, scores, strict=True)])
        return out

    def _ann_threshold(self, entry: SetState) -> int:
        """With device search, a set turns HNSW only once it no longer fits the device budget (the device searches
        exactly, faster than a graph on the CPU)."""
        if self.device_search is None:
            return self.ann_threshold
        return max(self.ann_threshold, self.device_max_bytes // (2 * entry.dim))

    # ------------------------------------------------------------------ hooks
    def _new_state(self, dim: int) -> SetState:
        return AccelState(dim=dim)

    def _added(self, entry: SetState, rows: FloatArray) -> None:
        mirror = _state(entry).mirror
        if mirror is not None:
            mirror.append(rows)

    def _killed(self, entry: SetState, slots: npt.NDArray[np.int64]) -> None:
        mirror = _state(entry).mirror
        if mirror is not None:
            mirror.kill(slots)

    def _rows_changed(self, set_id: str, entry: SetState) -> None:
        _state(entry).forget_filters()
        self.filter_graphs.invalidate(set_id)

    def _payloads_changed(self, entry: SetState) -> None:
        _state(entry).forget_filters()

    def _renumbered(self, entry: SetState) -> None:
        _state(entry).mirror = None

    def _dropped(self, set_id: str) -> None:
        self.filter_graphs.invalidate(set_id)

    def close(self) -> None:
        if not self._closed:
            self.filter_graphs.wait()
        super().close()
