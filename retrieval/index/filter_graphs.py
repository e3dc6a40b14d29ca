"""Per-filter HNSW graphs of an HNSW set: recurring filters that keep few rows search a graph of only those rows.

A graph walk with a selector computes distances to every node it meets, kept or not, so its cost stays that of
an unfiltered walk while the accepted nodes it meets shrink with the kept fraction: recall falls unless the
beam widens in proportion (at 200k x 512, efSearch 128 keeps recall 0.86 at 5 %; x5 the beam costs x10 the time).
Scanning the kept rows costs their bytes (50k rows of a 1M x 2048 set at 5 % are 400 MB). A graph over the kept
rows alone answers in less than the unfiltered walk, but costs a build, so it is built for a filter seen
**twice** (a recurring one: a category, a supplier), in a background thread, one at a time, while the first
queries take the selector walk or scan. Graphs are keyed by the digest of the filter's slot mask, so two
filters keeping the same rows share one; the vectors are stored as 8-bit scalar codes (a quarter of float32)
and the candidates they give are re-scored exactly from the set's own rows. The cache is bounded in bytes
(least recently used graphs leave first; a build also holds a float32 copy of its rows, 4x its codes, while it
runs) and a set's graphs are dropped on any write to its vectors or slots.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

from retrieval.index.faiss_files import SetState
from retrieval.index.payload_index import SlotMask

GRAPH_FRACTION = 0.2  # filters keeping less of an HNSW set get their own graph once they recur

SEEN = 256  # digests of masks met once, remembered to tell a recurring filter
LINK_BYTES = 2 * 4  # level-0 links per node are 2 x M int32 (upper levels add ~1/M of that)


@dataclass(frozen=True)
class FilterGraph:
    index: Any  # faiss.IndexHNSWSQ over the kept rows, in slot order
    slots: npt.NDArray[np.int64]  # graph row -> set slot
    nbytes: int

    def candidates(self, queries: npt.NDArray[np.float32], n: int, ef_search: int) -> npt.NDArray[np.int64]:
        """``[Q, n]`` set slots nearest by the 8-bit codes (-1 pads), for an exact re-score."""
        n = min(n, len(self.slots))
        params = faiss.SearchParametersHNSW(efSearch=max(ef_search, n))  # type: ignore[attr-defined]
        _, rows = self.index.search(queries, n, params=params)
        out: npt.NDArray[np.int64] = np.where(rows >= 0, self.slots[np.maximum(rows, 0)], -1)
        return out


class FilterGraphs:
    """Byte-bounded LRU cache of :class:`FilterGraph` for one :class:`~retrieval.index.faiss_index.FaissIndex`
    (``budget_bytes`` 0 keeps none); graphs take the set's HNSW ``m`` and ``ef_construction``."""

    def __init__(self, budget_bytes: int, m: int, ef_construction: int) -> None:
        self.budget_bytes = budget_bytes
        self.m = m
        self.ef_construction = ef_construction
        self._lock = threading.Lock()
        self._ready: OrderedDict[tuple[str, bytes], FilterGraph] = OrderedDict()
        self._seen: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._generation: dict[str, int] = {}
        self._builder: threading.Thread | None = None
        self.builds = 0  # graphs built and kept, and the seconds the last one took (tests and benches read them)
        self.last_build_s = 0.0

    def estimate(self, kept: int, dim: int) -> int:
        return kept * (dim + LINK_BYTES * self.m + 8)

    def lookup(self, set_id: str, entry: SetState, mask: SlotMask) -> FilterGraph | None:
        """The graph of this filter's mask if built; else note the sighting and, on the second, start building
        it. None also where the selector walk serves well (not an HNSW set, or the filter keeps much of it)."""
        kept = mask.kept
        if not entry.ann or kept >= GRAPH_FRACTION * len(entry.where):
            return None
        key = (set_id, mask.digest)
        with self._lock:
            graph = self._ready.get(key)
            if graph is not None:
                self._ready.move_to_end(key)
                return graph
            if key not in self._seen:
                self._seen[key] = None
                if len(self._seen) > SEEN:
                    self._seen.popitem(last=False)
                return None
            if self.estimate(kept, entry.dim) > self.budget_bytes or (self._builder and self._builder.is_alive()):
                return None  # too big to keep, or another build running: a later sighting tries again
            del self._seen[key]
            args = (key, entry, self._generation.get(set_id, 0), mask.slots())
            self._builder = threading.Thread(target=self._build, args=args, name=f"filter-graph-{set_id}",
                                             daemon=True)
            self._builder.start()
        return None

    def _build(self, key: tuple[str, bytes], entry: SetState, generation: int,
               slots: npt.NDArray[np.int64]) -> None:
        with entry.lock:  # the rows are copied under the set's lock, then the graph is built without it
            if entry.dropped or entry.index is None or self.generation(key[0]) != generation:
                return
            rows = entry.index.reconstruct_batch(slots)
        started = time.perf_counter()
        index = faiss.IndexHNSWSQ(rows.shape[1], faiss.ScalarQuantizer.QT_8bit,  # type: ignore[arg-type]
                                  self.m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = self.ef_construction
        index.train(rows)
        index.add(rows)
        del rows
        graph = FilterGraph(index, slots, self.estimate(len(slots), index.d))
        with self._lock:
            if self._generation.get(key[0], 0) != generation:
                return
            self._ready[key] = graph
            self.builds += 1
            self.last_build_s = time.perf_counter() - started
            while sum(g.nbytes for g in self._ready.values()) > self.budget_bytes:
                self._ready.popitem(last=False)

    def invalidate(self, set_id: str) -> None:
        """Drop a set's graphs (its vectors or slots changed); a build in flight for it is discarded."""
        with self._lock:
            self._generation[set_id] = self._generation.get(set_id, 0) + 1
            for key in [key for key in self._ready if key[0] == set_id]:
                del self._ready[key]
            for key in [key for key in self._seen if key[0] == set_id]:
                del self._seen[key]

    def generation(self, set_id: str) -> int:
        with self._lock:
            return self._generation.get(set_id, 0)

    def wait(self, timeout: float | None = None) -> None:
        """Return once no build is running (benches time steady state after it; close waits for it)."""
        builder = self._builder
        if builder is not None:
            builder.join(timeout)

    def __len__(self) -> int:
        with self._lock:
            return len(self._ready)
