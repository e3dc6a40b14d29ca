"""The FAISS filter caches are bounded by what they hold: whole filters' slot masks by their bytes, under a digest
of the filter (its JSON may be megabytes), and filter graphs at their resident size, found by size without
meeting every graph of the set."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest

import rubricsearch.retrieval.index.faiss_accel.plans as plans
from rubricsearch.retrieval.index.faiss_accel import AcceleratedFaissIndex
from rubricsearch.retrieval.index.faiss_accel.filter_graphs import (
    GRAPH_FIXED_BYTES,
    FilterGraph,
    FilterGraphs,
    build_graph,
)
from rubricsearch.retrieval.index.faiss_accel.payload_index import SlotMask, pack, popcount
from rubricsearch.retrieval.index.filters import parse_filter
from tests.test_index_congruence import DIM, sha, unit

N = 300


@pytest.fixture
def index(tmp_path: Path) -> Any:
    idx = AcceleratedFaissIndex(tmp_path)
    ids = [sha(i) for i in range(N)]
    idx.create_set("refs", DIM)
    idx.upsert("refs", ids, unit(np.random.default_rng(5), N))
    idx.set_payloads("refs", {s: {"n": i, "tag": f"t{i % 7}"} for i, s in enumerate(ids)})
    yield idx
    idx.close()


def test_mask_cache_keys_are_digests_however_large_the_filter(index: AcceleratedFaissIndex) -> None:
    words = ["w" * 1000 + str(i) for i in range(256)]
    huge = {"must": [{"key": f"k{c}", "match": {"any": words}} for c in range(63)]
            + [{"key": "n", "range": {"gte": 0}}]}
    f = parse_filter(huge)
    assert f is not None and len(f.cache_key()) > 16_000_000
    for _ in range(2):
        index.count("refs", f)
    entry = index._sets["refs"]
    assert [len(key) for key in entry.masks] == [16]


def test_mask_cache_is_bounded_by_bytes_least_recently_used_first(index: AcceleratedFaissIndex,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    entry = index._sets["refs"]
    index.count("refs", parse_filter({"must": [{"key": "n", "range": {"gte": 0}}]}))
    mask_bytes = next(iter(entry.masks.values())).bits.nbytes
    monkeypatch.setattr(plans, "MASK_CACHE_BYTES", 3 * mask_bytes)
    filters = [parse_filter({"must": [{"key": "n", "range": {"gte": i}}]}) for i in range(10)]
    for f in filters:
        index.count("refs", f)
        index.count("refs", filters[0])  # used again each time: it stays
        assert sum(m.bits.nbytes for m in entry.masks.values()) <= 3 * mask_bytes
    assert len(entry.masks) == 3
    assert filters[0] is not None
    assert hashlib.blake2b(filters[0].cache_key().encode(), digest_size=16).digest() in entry.masks


def _graph(rows: int, slots: np.ndarray, size: int) -> FilterGraph:
    vectors = unit(np.random.default_rng(rows), len(slots))
    keep = np.zeros(size, dtype=bool)
    keep[slots] = True
    return build_graph(vectors, slots.astype(np.int64), pack(keep), 8, 40)


def test_graphs_are_counted_at_least_at_faiss_size() -> None:
    for rows in (10, 60):
        graph = _graph(rows, np.arange(rows), 1000)
        serialized = faiss.serialize_index(graph.index).nbytes  # codes, links, levels, offsets, trained ranges
        assert graph.nbytes >= GRAPH_FIXED_BYTES + serialized + graph.slots.nbytes + graph.bits.nbytes


def test_a_lookup_meets_only_graphs_a_filter_could_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    size = 4000
    graphs = FilterGraphs(1 << 30, 8, 40)
    rng = np.random.default_rng(7)
    for g in range(120):  # graphs of every size from 5 to 600 rows, none holding slot 0 but the 200-row ones
        rows = 5 + 5 * (g % 120)
        slots = np.sort(rng.choice(np.arange(1, size), rows, replace=False))
        if rows == 200:
            slots = np.concatenate([[0], slots[1:]])
        graphs._keep(("refs", bytes([g]) * 16), _graph(rows, slots, size))
    target = next(g for g in graphs._ready.values() if len(g.slots) == 200)
    keep = np.zeros(size, dtype=bool)
    keep[target.slots[:100]] = True
    mask = SlotMask(pack(keep), size, popcount(pack(keep)))
    met: list[int] = []
    real = FilterGraph.contains

    def counted(self: FilterGraph, m: SlotMask) -> bool:
        met.append(len(self.slots))
        return real(self, m)

    monkeypatch.setattr(FilterGraph, "contains", counted)
    with graphs._lock:
        found = graphs._containing("refs", mask)
    assert found is target and met == [200]
    assert graphs._held == sum(g.nbytes for g in graphs._ready.values())
    graphs.invalidate("refs")
    assert graphs._held == 0 and graphs._sizes["refs"] == []
