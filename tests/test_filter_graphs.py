"""Graphs of recurring conditions serve the filters they contain (retrieval/index/faiss_accel/filter_graphs.py).

A graph is built for the rows of a filter's ``must`` leaf seen twice, even when the whole filters never recur;
a later filter whose rows lie inside a graph (and keep at least ``CONTAINED`` of them) walks that graph with a
selector and returns exactly the filtered top-k; a filter keeping a single row outside it never uses it.
The path taken is counted by wrapping :meth:`FilterGraph.candidates` (the real method runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rubricsearch.retrieval.index.faiss_accel import AcceleratedFaissIndex
from rubricsearch.retrieval.index.faiss_accel.filter_graphs import CONTAINED, FilterGraph
from rubricsearch.retrieval.index.faiss_accel.payload_index import PayloadIndex
from rubricsearch.retrieval.index.filters import matches, parse_filter
from tests.test_index_congruence import DIM, assert_hits, exact, sha, unit

N = 800
CATEGORIES = 10  # a category keeps 10 % of the set: under the graph threshold (20 %)


def payload(i: int) -> dict[str, Any]:
    return {"category": f"c{i % CATEGORIES}", "price": (i * 37) % 100, "row": i}


@pytest.fixture
def filled(tmp_path: Path) -> Iterator[tuple[AcceleratedFaissIndex, dict[str, np.ndarray], dict[str, dict[str, Any]]]]:
    # efSearch N and no scans: any path returns the exact filtered top-k, so only the counted path tells them apart
    index = AcceleratedFaissIndex(tmp_path, ann_threshold=100, ef_search=N, filter_scan_ratio=0)
    vecs = unit(np.random.default_rng(3), N)
    ids = [sha(i) for i in range(N)]
    index.create_set("refs", DIM)
    index.upsert("refs", ids, vecs)
    payloads = {ids[i]: payload(i) for i in range(N)}
    index.set_payloads("refs", payloads)
    assert index.is_ann("refs")
    yield index, dict(zip(ids, vecs, strict=True)), payloads
    index.close()


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of rows of each graph a search walked, in order."""
    walked: list[int] = []
    real = FilterGraph.candidates

    def counted(self: FilterGraph, *args: Any) -> Any:
        walked.append(len(self.slots))
        return real(self, *args)

    monkeypatch.setattr(FilterGraph, "candidates", counted)
    return walked


def search(index: AcceleratedFaissIndex, raw: dict[str, Any], query: np.ndarray, k: int = 10) -> list[Any]:
    f = parse_filter(raw)
    assert f is not None
    return index.search("refs", query, k, filter=f)[0]


def boots(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``category = c3`` (80 rows) and ``extra``'s clauses."""
    raw: dict[str, Any] = {"must": [{"key": "category", "match": {"value": "c3"}}]}
    for clause, conditions in (extra or {}).items():
        raw[clause] = raw.get(clause, []) + conditions
    return raw


def test_a_leafs_second_sighting_builds_its_graph(filled, served: list[int]) -> None:
    """Two filters that differ (each excludes another row) but share the leaf ``category = c3``: the second one
    starts a graph of the leaf's rows, and the third new filter over that leaf walks it."""
    index, _, payloads = filled
    q = unit(np.random.default_rng(9), 1)[0]
    for j in (3, 13):
        search(index, boots({"must_not": [{"key": "row", "match": {"value": j}}]}), q)
        index.filter_graphs.wait()
    assert index.filter_graphs.builds == 1 and served == []
    graph = next(iter(index.filter_graphs._ready.values()))
    assert {payloads[sha(int(s))]["category"] for s in graph.slots} == {"c3"} and len(graph.slots) == N // CATEGORIES
    search(index, boots({"must_not": [{"key": "row", "match": {"value": 23}}]}), q)
    assert served == [N // CATEGORIES] and index.filter_graphs.builds == 1


@pytest.mark.parametrize("extra", [
    {"must_not": [{"key": "row", "match": {"value": 33}}]},          # all but one row of the graph
    {"must": [{"key": "price", "range": {"lt": 60}}]},                # ~60 % of it
    {"should": [{"key": "price", "range": {"lt": 20}}, {"key": "price", "range": {"gte": 85}}]},  # 30 %
])
def test_filters_inside_a_graph_walk_it_and_get_the_exact_top_k(filled, served: list[int], extra) -> None:
    index, store, payloads = filled
    for _ in range(2):
        search(index, boots(), unit(np.random.default_rng(1), 1)[0])
    index.filter_graphs.wait()
    assert index.filter_graphs.builds == 1
    f = parse_filter(boots(extra))
    assert f is not None
    keep = {s: v for s, v in store.items() if matches(f, payloads[s])}
    assert CONTAINED * N / CATEGORIES <= len(keep) < N / CATEGORIES
    for q in unit(np.random.default_rng(11), 5):
        assert_hits(search(index, boots(extra), q), exact(keep, q, 10), tol=1e-4)
    assert served == [N // CATEGORIES] * 5


def test_a_filter_not_inside_a_graph_never_walks_it(filled, served: list[int]) -> None:
    """``(c3 but row 33) OR row 7`` keeps as many rows as the graph of ``c3`` but one outside it, the best for the
    query: it must come back, so that graph is not walked; nor is it for a filter keeping too few of its rows."""
    index, store, payloads = filled
    for _ in range(2):
        search(index, boots(), store[sha(7)])
    index.filter_graphs.wait()
    served.clear()
    outside = {"should": [boots({"must_not": [{"key": "row", "match": {"value": 33}}]}),
                          {"key": "row", "match": {"value": 7}}]}
    hits = search(index, outside, store[sha(7)])
    assert hits[0].id == sha(7) and served == []
    few = boots({"must": [{"key": "price", "range": {"lt": 10}}]})  # 10 % of the graph's rows
    f = parse_filter(few)
    assert f is not None
    keep = {s: v for s, v in store.items() if matches(f, payloads[s])}
    assert 0 < len(keep) < CONTAINED * N / CATEGORIES
    q = unit(np.random.default_rng(5), 1)[0]
    assert_hits(search(index, few, q), exact(keep, q, 10), tol=1e-4)
    assert served == []


def test_parts_are_the_leaves_a_filter_requires() -> None:
    """``parts``: each ``must`` leaf (nested ``must`` too), plus their AND where the filter has more than them."""
    payloads: list[dict[str, Any] | None] = [payload(i) for i in range(200)]
    index = PayloadIndex(payloads, np.ones(200, dtype=bool))

    def kept(raw: dict[str, Any]) -> list[int]:
        f = parse_filter(raw)
        assert f is not None
        return [p.kept for p in index.parts(f)]

    c3 = {"key": "category", "match": {"value": "c3"}}
    cheap = {"key": "price", "range": {"lt": 50}}
    assert kept({"must": [c3]}) == [20]
    assert sorted(kept({"must": [c3, {"must": [cheap]}]})) == [20, 100]  # the filter is their AND: not repeated
    assert sorted(kept({"must": [c3, cheap], "must_not": [{"key": "row", "match": {"value": 3}}]})) == [10, 20, 100]
    assert kept({"should": [c3, cheap]}) == [] and kept({"must_not": [c3]}) == []
