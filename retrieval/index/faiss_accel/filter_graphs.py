"""Graphs of an HNSW set's recurring filters and conditions: filters keeping few rows walk a graph of rows they share.

A graph walk with a selector computes distances to every node it meets, kept or not, so its cost stays that of
an unfiltered walk while the accepted nodes it meets shrink with the kept fraction: recall falls unless the
beam widens in proportion, and a beam wide enough costs several times the unfiltered walk (docs/metadata.md,
"Why a graph per recurring filter").
Scanning the kept rows costs their bytes (50k rows of a 1M x 2048 set at 5 % are 400 MB). A graph over the kept
rows alone answers in less than the unfiltered walk, but costs a build, so it is built for rows seen **twice**
in a background thread, one build at a time, while the first queries take the selector walk or scan.

What recurs is often a condition rather than a whole filter (``category = boots`` with a price bound, or a different
exclusion, each time), so, as Qdrant's payload-indexed sub-graphs, the rows of each of a filter's ``must`` leaves
(:meth:`.payload_index.PayloadIndex.parts`) are counted as sightings too, and any graph *containing* a filter's rows
serves it: the walk takes a selector for the filter's rows within the graph, its beam widened as a selector walk's
is, as long as the filter keeps ``CONTAINED`` of the graph's rows (below that a scan of the filter's own rows costs
as little). The smallest containing graph serves; a filter served by one counts no sightings. Graphs are keyed by
the digest of their slot mask, so a filter and a leaf keeping the same rows share one; the vectors are stored as
8-bit scalar codes (a quarter of float32) and the candidates they give are re-scored exactly from the set's own
rows. The cache is bounded in bytes, each graph counted at its resident size (faiss' structures and their measured
overhead; least recently used graphs leave first; a build also holds a float32 copy of its rows, 4x its codes, while
it runs) and a set's graphs are dropped on any write to its vectors or slots. A lookup bisects the set's graphs by
size, so it meets only those a filter could walk.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

from rubricsearch.retrieval.index.faiss_accel.payload_index import Bits, SlotMask
from rubricsearch.retrieval.index.faiss_accel.plans import AccelState, allowed_slots, walk_boost
from rubricsearch.retrieval.index.filters import Filter

GRAPH_FRACTION = 0.2  # rows (a filter's, a condition's) keeping less of an HNSW set get a graph once they recur
CONTAINED = 0.2  # a filter keeping this share of a graph's rows (none outside) walks it (bench/filter_graph_share)

SEEN = 256  # digests of masks (filters', leaves') met once, remembered to tell recurring rows
LINK_BYTES = 2 * 4  # level-0 links per node are 2 x M int32 (upper levels add ~1/M of that)
# What a built graph holds beyond the bytes of faiss' structures (the allocator's slack and what faiss and Python
# keep per object): resident memory stays within GRAPH_FIXED_BYTES + GRAPH_SLACK x the structures' bytes for graphs
# from a few rows to a few thousand (bench/filter_graph_memory.py; its figures: docs/metadata.md, "Filtered search")
GRAPH_FIXED_BYTES, GRAPH_SLACK = 9 << 10, 1.25


def build_graph(rows: npt.NDArray[np.float32], slots: npt.NDArray[np.int64], bits: Bits, m: int,
                ef_construction: int) -> FilterGraph:
    """A graph of ``rows`` (those of ``slots``, kept by the packed mask ``bits``), counted at its resident size."""
    index = faiss.IndexHNSWSQ(rows.shape[1], faiss.ScalarQuantizer.QT_8bit,  # type: ignore[arg-type]
                              m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = ef_construction
    index.train(rows)
    index.add(rows)
    row_slots = faiss.Int64Vector()
    faiss.copy_array_to_vector(slots, row_slots)
    hnsw: Any = index.hnsw
    storage: Any = faiss.downcast_index(index.storage)  # an IndexScalarQuantizer
    structures = (hnsw.neighbors.size() * 4 + hnsw.offsets.size() * 8 + hnsw.levels.size() * 4
                  + hnsw.assign_probas.size() * 8 + hnsw.cum_nneighbor_per_level.size() * 4 + storage.codes.size()
                  + storage.sq.trained.size() * 4 + row_slots.size() * 8)
    return FilterGraph(index, slots, bits, row_slots,
                       GRAPH_FIXED_BYTES + math.ceil(GRAPH_SLACK * structures) + slots.nbytes + bits.nbytes)


@dataclass(frozen=True)
class FilterGraph:
    index: Any  # faiss.IndexHNSWSQ over the kept rows, in slot order
    slots: npt.NDArray[np.int64]  # graph row -> set slot
    bits: Bits  # the kept slots, packed as a SlotMask's bits
    row_slots: Any  # faiss.Int64Vector of ``slots``: a selector over set slots reads graph rows through it
    nbytes: int

    def contains(self, mask: SlotMask) -> bool:
        """Whether ``mask`` keeps no slot outside the graph's (one pass over n/8 bytes; its cost: docs/metadata.md)."""
        return not np.any(mask.bits.view(np.uint64) & ~self.bits.view(np.uint64))

    def candidates(self, queries: npt.NDArray[np.float32], n: int, ef_search: int,
                   mask: SlotMask) -> npt.NDArray[np.int64]:
        """``[Q, n]`` set slots among those ``mask`` (contained) keeps, nearest by the 8-bit codes (-1 pads), for
        an exact re-score; a selector (and a beam widened as a filtered walk's) where it keeps fewer rows."""
        n = min(n, mask.kept)
        params = faiss.SearchParametersHNSW()  # type: ignore[attr-defined]
        params.efSearch = max(math.ceil(ef_search * walk_boost(mask.kept, len(self.slots))), n)
        if mask.kept < len(self.slots):  # the selector reads the filter's bits through graph row -> slot
            in_set = faiss.IDSelectorBitmap(mask.size, faiss.swig_ptr(mask.bits))
            params.sel = faiss.IDSelectorTranslated(self.row_slots, in_set)
        _, rows = self.index.search(queries, n, params=params)
        out: npt.NDArray[np.int64] = np.where(rows >= 0, self.slots[np.maximum(rows, 0)], -1)
        return out


def _first_slot(bits: Bits) -> int:
    byte = int(np.flatnonzero(bits)[0])
    return byte * 8 + (int(bits[byte]) & -int(bits[byte])).bit_length() - 1


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
        self._sizes: dict[str, list[tuple[int, bytes]]] = {}  # per set, (rows, digest) of its graphs, ascending
        self._held = 0  # bytes of the graphs in _ready
        self._builder: threading.Thread | None = None
        self.builds = 0  # graphs built and kept, and the seconds the last one took (tests and benches read them)
        self.last_build_s = 0.0

    def estimate(self, kept: int, dim: int) -> int:
        """A graph's bytes before it is built (its packed slot mask, n/8, aside): what decides whether it fits."""
        return GRAPH_FIXED_BYTES + math.ceil(GRAPH_SLACK * kept * (dim + LINK_BYTES * self.m + 8)) + 8 * kept

    def lookup(self, set_id: str, entry: AccelState, filter: Filter) -> FilterGraph | None:
        """The smallest graph containing this filter's rows, if one is built (and it keeps ``CONTAINED`` of them);
        else note the sightings of the filter's rows and of its ``must`` leaves' and, on the second sighting of
        any, start building the largest such. None also where the selector walk serves (not an HNSW set, or the
        filter keeps much of it). The caller holds the set's lock and has resolved the filter's mask."""
        mask = allowed_slots(entry, filter)  # cached by the search that resolved it
        live = len(entry.where)
        if not entry.ann or mask.kept >= GRAPH_FRACTION * live:
            return None
        with self._lock:
            best = self._containing(set_id, mask)
            if best is not None:
                return best
            recurring: list[SlotMask] = []
            parts = [p for p in [mask, *self._parts(entry, filter)] if 0 < p.kept < GRAPH_FRACTION * live]
            for part in {p.digest: p for p in parts}.values():
                key = (set_id, part.digest)
                if key in self._ready:
                    continue  # built, but this filter keeps too few of its rows to walk it
                if key in self._seen:
                    recurring.append(part)
                else:
                    self._seen[key] = None
                    if len(self._seen) > SEEN:
                        self._seen.popitem(last=False)
            fits = [p for p in recurring if self.estimate(p.kept, entry.dim) <= self.budget_bytes]
            if not fits or (self._builder and self._builder.is_alive()):
                return None  # too big to keep, or another build running: a later sighting tries again
            part = max(fits, key=lambda p: p.kept)  # the largest serves the most filters
            key = (set_id, part.digest)
            del self._seen[key]
            args = (key, entry, self._generation.get(set_id, 0), part)
            self._builder = threading.Thread(target=self._build, args=args, name=f"filter-graph-{set_id}",
                                             daemon=True)
            self._builder.start()
        return None

    def _containing(self, set_id: str, mask: SlotMask) -> FilterGraph | None:
        """The smallest graph of the set holding every row of ``mask`` and keeping ``CONTAINED`` of it: only graphs
        of ``kept .. kept / CONTAINED`` rows are looked at (a bisection of the set's graphs by size), and of those
        only the ones holding the mask's first slot are compared bit by bit. Called under ``_lock``."""
        sizes = self._sizes.get(set_id)
        if not sizes:
            return None
        first: int | None = None
        for rows, digest in sizes[bisect.bisect_left(sizes, (mask.kept, b"")):]:
            if CONTAINED * rows > mask.kept:
                break
            if first is None:
                first = _first_slot(mask.bits)
            graph = self._ready[(set_id, digest)]
            if graph.bits[first >> 3] >> (first & 7) & 1 and graph.contains(mask):
                self._ready.move_to_end((set_id, digest))
                return graph
        return None

    def _keep(self, key: tuple[str, bytes], graph: FilterGraph) -> None:
        self._ready[key] = graph
        self._held += graph.nbytes
        bisect.insort(self._sizes.setdefault(key[0], []), (len(graph.slots), key[1]))
        while self._held > self.budget_bytes and self._ready:
            self._drop(next(iter(self._ready)))

    def _drop(self, key: tuple[str, bytes]) -> None:
        graph = self._ready.pop(key)
        self._held -= graph.nbytes
        self._sizes[key[0]].remove((len(graph.slots), key[1]))

    @staticmethod
    def _parts(entry: AccelState, filter: Filter) -> list[SlotMask]:
        assert entry.payload_index is not None  # built by allowed_slots
        return entry.payload_index.parts(filter)

    def _build(self, key: tuple[str, bytes], entry: AccelState, generation: int,
               mask: SlotMask) -> None:
        slots = mask.slots()
        with entry.lock:  # the rows are copied under the set's lock, then the graph is built without it
            if entry.dropped or entry.index is None or self.generation(key[0]) != generation:
                return
            rows = entry.index.reconstruct_batch(slots)
        started = time.perf_counter()
        graph = build_graph(rows, slots, mask.bits, self.m, self.ef_construction)
        del rows
        with self._lock:
            if self._generation.get(key[0], 0) != generation:
                return
            self._keep(key, graph)
            self.builds += 1
            self.last_build_s = time.perf_counter() - started

    def invalidate(self, set_id: str) -> None:
        """Drop a set's graphs (its vectors or slots changed); a build in flight for it is discarded."""
        with self._lock:
            self._generation[set_id] = self._generation.get(set_id, 0) + 1
            for key in [key for key in self._ready if key[0] == set_id]:
                self._drop(key)
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
