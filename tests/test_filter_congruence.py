"""Filtered search, one suite for every vector index backend (FAISS exact, FAISS HNSW, FAISS with the device
search run by torch on the CPU, in float16 and float8, and Qdrant local mode).

Every backend must return exactly the brute-force top-k of the ids whose payload passes the filter, as
:func:`retrieval.index.filters.matches` judges them; filters keep from most to almost none of the set, so a
backend that trimmed an unfiltered top-k, or ignored a clause, fails. Each must also say which of some ids are in
the set and kept by the filter (``matching``) exactly as :func:`matches` judges them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rubricsearch.retrieval.errors import InvalidMetadata
from rubricsearch.retrieval.index import VectorIndex, make_index
from rubricsearch.retrieval.index.faiss_accel.filter_graphs import FilterGraphs
from rubricsearch.retrieval.index.faiss_accel.payload_index import PayloadIndex
from rubricsearch.retrieval.index.filters import Filter, facet_payload, matches, parse_filter
from tests.test_index_congruence import DIM, assert_hits, exact, sha, unit

BACKENDS = ["faiss", "faiss-reference", "faiss-reference-hnsw", "faiss-hnsw", "faiss-hnsw-scan",
            "faiss-device", "faiss-device-fp8", "qdrant",
            pytest.param("faiss-device-cuda", marks=pytest.mark.gpu)]  # the mask on a GPU (float8 on Hopper)
N = 600
COLOURS = ["red", "green", "blue", "black"]


def open_backend(backend: str, root: Path) -> VectorIndex:
    match backend:
        case "faiss":
            return make_index("faiss", path=root / "f")
        case "faiss-reference":  # the plain index: each row's payload judged by `matches`, then an exact search
            return make_index("faiss-reference", path=root / "f")
        case "faiss-reference-hnsw":  # the same over an HNSW set's flat rows
            return make_index("faiss-reference", path=root / "f", ann_threshold=100)
        case "faiss-hnsw":  # the graph walk with a selector: scans never win
            return make_index("faiss", path=root / "f", ann_threshold=100, ef_search=N, filter_scan_ratio=0)
        case "faiss-hnsw-graph":  # no scans: a recurring filter keeping < 20 % gets its own graph
            return make_index("faiss", path=root / "f", ann_threshold=100, filter_scan_ratio=0)
        case "faiss-hnsw-scan":  # every filter scans its rows' 8-bit codes (the product's choice at this size)
            return make_index("faiss", path=root / "f", ann_threshold=100)
        case "faiss-device":
            return make_index("faiss", path=root / "f", device_search="torch", search_device="cpu")
        case "faiss-device-cuda":
            return make_index("faiss", path=root / "f", device_search="torch", search_device="cuda")
        case "faiss-device-fp8":
            return make_index("faiss", path=root / "f", device_search="torch", search_device="cpu",
                              device_precision="float8")
        case _:
            return make_index("qdrant", path=":memory:", batch_size=128)


def payload(i: int) -> dict[str, Any]:
    """Metadata whose fields vary independently of the vectors; every third has no `price`."""
    out: dict[str, Any] = {"colour": COLOURS[i % 4], "size": i % 10, "tags": [f"t{i % 3}", f"u{i % 7}"],
                           "rare": i % 97 == 0, "code": str(i % 5) if i % 50 else i % 5, "dims": [i % 5, i % 11]}
    if i % 3:
        out["price"] = (i * 37 % 1000) / 10.0
    if i % 4 != 1:  # computed facets, as the facet job mirrors them (the rest have none yet)
        out.update(facet_payload({"ears": {"value": ["round", "folded", "upright"][i % 3], "p": (i * 13 % 100) / 100}}))
    return out


FILTERS: list[dict[str, Any]] = [
    {"must": [{"key": "colour", "match": {"value": "red"}}]},                               # 25 %
    {"must": [{"key": "colour", "match": {"any": ["red", "blue"]}}],
     "must_not": [{"key": "size", "match": {"value": 3}}]},
    {"should": [{"key": "tags", "match": {"value": "u3"}}, {"key": "rare", "match": {"value": True}}]},
    {"must": [{"key": "price", "range": {"gte": 13.7, "lt": 25}}]},  # ~7 %, both bounds held by a row
    {"must_not": [{"key": "price", "range": {"gt": 0}}]},                                  # missing keys pass
    {"must": [{"key": "size", "match": {"value": 7}}, {"key": "tags", "match": {"value": "t1"}},
              {"should": [{"key": "colour", "match": {"value": "green"}},
                          {"key": "price", "range": {"lte": 30}}]}]},                      # < 2 %
    {"must": [{"key": "code", "match": {"value": "1"}}]},                                 # a string, not 1
    {"must": [{"key": "code", "match": {"value": 1}}]},                                   # nothing matches
    {"must": [{"key": "colour", "match": {"value": "violet"}}]},                          # nothing matches
    {"must": [{"key": "dims", "range": {"gte": 4, "lte": 4}}]},                           # lists of numbers
    {"must": [{"key": "code", "match": {"any": [0, "3"]}}]},                              # one key, two types
    {"must": [{"key": "facets.ears", "match": {"value": "round"}, "min_confidence": 0.6}]},  # a facet, ~10 %
    {"must_not": [{"key": "facets.ears", "match": {"any": ["round", "folded"]}}]},         # default threshold
]


Filled = tuple[VectorIndex, dict[str, np.ndarray], dict[str, dict]]


def fill(backend: str, root: Path) -> Filled:
    index = open_backend(backend, root)
    rng = np.random.default_rng(7)
    vecs = unit(rng, N)
    ids = [sha(i) for i in range(N)]
    index.create_set("refs", DIM)
    index.upsert("refs", ids, vecs)
    payloads = {ids[i]: payload(i) for i in range(N)}
    index.set_payloads("refs", payloads)
    # writes after the payloads: a delete drops one, a re-upsert keeps one, a replaced vector keeps its payload
    index.delete("refs", [ids[0], ids[4]])
    index.upsert("refs", [ids[8], ids[12]], np.stack([vecs[8], unit(rng, 1)[0]]))
    store = {sha_: vecs[i] for i, sha_ in enumerate(ids) if i not in (0, 4)}
    store[ids[12]] = index.vectors("refs", [ids[12]])[ids[12]]
    del payloads[ids[0]], payloads[ids[4]]
    return index, store, payloads


@pytest.fixture(scope="module", params=BACKENDS)
def filled(request, tmp_path_factory) -> Iterator[Filled]:
    """One filled index per backend for the read-only tests."""
    filled = fill(request.param, tmp_path_factory.mktemp(request.param))
    yield filled
    filled[0].close()


@pytest.mark.parametrize("raw", FILTERS, ids=range(len(FILTERS)))
def test_filtered_search_is_exact_top_k_of_matching(filled, raw: dict[str, Any]) -> None:
    index, store, payloads = filled
    f = parse_filter(raw)
    assert f is not None
    keep = {s: v for s, v in store.items() if matches(f, payloads[s])}
    assert index.count("refs", f) == len(keep)
    queries = unit(np.random.default_rng(11), 4)
    for q, got in zip(queries, index.search("refs", queries, 10, filter=f), strict=True):
        assert_hits(got, exact(keep, q, 10) if keep else [], tol=1e-4)


@pytest.mark.parametrize("raw", [None, *FILTERS], ids=range(len(FILTERS) + 1))
def test_matching_says_which_ids_the_filter_keeps(filled, raw: dict[str, Any] | None) -> None:
    """Which of some ids are in the set and pass the filter, asked of them alone: ids kept and filtered out in one
    call, deleted and never-added ids never, one id as the identical-image search asks, all at once (Qdrant in
    several batches); every backend agrees with :func:`matches`."""
    index, store, payloads = filled
    f = parse_filter(raw)
    kept = [s for s in store if f is None or matches(f, payloads[s])]
    out = sorted(set(store) - set(kept))
    absent = [sha(0), sha(4), sha("never-added")]  # deleted after their payloads were set, never added
    asked = kept[::9] + out[::9] + absent
    assert index.matching("refs", [s.upper() for s in asked], f) == set(kept[::9])
    assert index.matching("refs", [*absent, *store, *kept[:5]], f) == set(kept)
    for s in [*kept[:2], *out[:2], absent[2]]:
        assert index.matching("refs", [s], f) == ({s} & set(kept))
    assert index.matching("refs", [], f) == set()


def test_recurring_filters_search_their_own_graph_exactly(tmp_path: Path) -> None:
    """The second search with a filter keeping few rows of an HNSW set builds a graph of its rows (or of a
    ``must`` leaf's, which contains them); searches then return exactly the top-k of the matching rows from it; a
    write to the set drops every graph."""
    index: Any
    index, store, payloads = fill("faiss-hnsw-graph", tmp_path)
    queries = unit(np.random.default_rng(11), 4)
    rows_of = {}  # the rows of every filter, must leaf and AND of must leaves: what a graph may hold
    for raw in FILTERS:
        f = parse_filter(raw)
        assert f is not None
        keep = {s: v for s, v in store.items() if matches(f, payloads[s])}
        leaves = [c for c in f.must if not isinstance(c, Filter)]
        for part in [f, Filter(must=tuple(leaves)), *(Filter(must=(leaf,)) for leaf in leaves)]:
            rows_of[frozenset(s for s in store if matches(part, payloads[s]))] = raw
        for _ in range(2):
            index.search("refs", queries, 10, filter=f)
        index.filter_graphs.wait()
        for q, got in zip(queries, index.search("refs", queries, 10, filter=f), strict=True):
            assert_hits(got, exact(keep, q, 10) if keep else [], tol=1e-4)
    index.filter_graphs.wait()
    ids = index.ids("refs")
    by_slot = index._sets["refs"].slot_ids
    graphed = [frozenset(by_slot[s] for s in g.slots) for g in index.filter_graphs._ready.values()]
    assert len(graphed) >= 4 and index.filter_graphs.builds == len(graphed)
    assert all(rows <= ids and rows in rows_of for rows in graphed)
    index.delete("refs", [sorted(store)[0]])
    assert len(index.filter_graphs) == 0
    index.close()


def test_filter_graphs_stay_within_their_byte_budget(tmp_path: Path) -> None:
    graph = FilterGraphs(0, 32, 80).estimate(15, DIM)  # a 15-row graph's bytes, at about its counted size
    index: Any = make_index("faiss", path=tmp_path, ann_threshold=100, filter_scan_ratio=0,
                            filter_graph_bytes=int(2.5 * graph))
    rng = np.random.default_rng(3)
    ids = [sha(i) for i in range(N)]
    index.create_set("refs", DIM)
    index.upsert("refs", ids, unit(rng, N))
    index.set_payloads("refs", {sha_: {"size": i % 40} for i, sha_ in enumerate(ids)})
    for size, repeat in [(1, 2), (2, 2), (3, 1), (1, 1), (4, 2), (2, 2)]:  # 15 rows each: two graphs fit
        f = parse_filter({"must": [{"key": "size", "match": {"value": size}}]})
        for _ in range(repeat):
            index.search("refs", unit(rng, 1), 5, filter=f)
        index.filter_graphs.wait()
    # size 2's graph was the least recently used when size 4's came, so it left and was built again
    assert index.filter_graphs.builds == 4 and len(index.filter_graphs) == 2
    index.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_payload_changes_are_seen(backend: str, tmp_path: Path) -> None:
    index, store, _ = fill(backend, tmp_path)
    red = parse_filter({"must": [{"key": "colour", "match": {"value": "red"}}]})
    some = sorted(store)[:3]
    index.set_payloads("refs", {some[0]: {"colour": "red"}, some[1]: {}, sha("never-added"): {"colour": "red"}})
    assert sha("never-added") not in index.ids("refs")
    hits = {h.id for h in index.search("refs", store[some[0]], N, filter=red)[0]}
    assert some[0] in hits and some[1] not in hits
    assert index.count("refs", red) == len(hits)
    assert index.matching("refs", [*some[:2], sha("never-added")], red) == {some[0]}
    index.close()


def test_payload_index_agrees_with_matches() -> None:
    """Every filter's mask, composed from the inverted index, is what :func:`matches` says slot by slot: on a
    fresh index, then again from its cached leaves, and on dead slots (never kept)."""
    payloads: list[dict[str, Any] | None] = [payload(i) for i in range(300)] + [None, {}]
    live = np.array([p is not None for p in payloads])
    index = PayloadIndex(payloads, live)
    for _ in range(2):  # the second round composes every filter from cached leaves
        for raw in FILTERS:
            f = parse_filter(raw)
            assert f is not None
            want = np.array([p is not None and matches(f, p) for p in payloads])
            mask = index.mask(f)
            assert mask.slots().tolist() == np.flatnonzero(want).tolist(), raw
            assert mask.kept == int(want.sum())


# 40 slots: postings serve most leaves, set bit by bit; 2000: dense columns serve more; 50 000: a tenth of the set is
# still scattered from postings, through a boolean mask
@pytest.mark.parametrize("n", [40, 2000, 50_000])
def test_leaves_resolve_by_the_rows_they_cover(n: int) -> None:
    """Ranges resolve to the sorted numbers they cover (their cache key): bounds written differently give the
    same rows, close bounds covering other numbers do not; dense and sparse leaves agree with :func:`matches`."""
    payloads: list[dict[str, Any] | None] = [{"x": i % 10, "y": float(i % 7) / 2} for i in range(n)]
    index = PayloadIndex(payloads, np.ones(n, dtype=bool))
    bounds = [{"lt": 5}, {"lte": 4.5}, {"lt": 4.0001}, {"lte": 4}, {"gt": 0, "lt": 1.5}, {"gte": 1, "lte": 1},
              {"gt": 8.5}, {"gt": 9}, {"gte": -1, "lt": 100}, {"lt": 0}]
    for bound in bounds:
        for key in ("x", "y"):
            f = parse_filter({"must": [{"key": key, "range": bound}]})
            assert f is not None
            want = [matches(f, p) for p in payloads if p is not None]
            assert index.mask(f).slots().tolist() == np.flatnonzero(want).tolist(), (key, bound)


def test_bool_and_int_never_meet() -> None:
    f = parse_filter({"must": [{"key": "x", "match": {"value": True}}]})
    assert f is not None and matches(f, {"x": True}) and not matches(f, {"x": 1})
    assert PayloadIndex([{"x": 1}], np.ones(1, dtype=bool)).mask(f).kept == 0


@pytest.mark.parametrize(("raw", "names"), [
    ({"must": [{"key": "a", "match": {"regex": "x"}}]}, "'regex'"),
    ({"must": [{"key": "a", "range": {"between": [1, 2]}}]}, "'between'"),
    ({"must": [{"key": "a", "geo": {}}]}, "'geo'"),
    ({"filter": []}, "'filter'"),
    ({"must": {"key": "a"}}, "filter.must[0]"),
    ({"must": [{"key": "a", "match": {"value": 1.5}}]}, "filter.must[0].match.value"),
    ({"must": [{"key": "a b", "match": {"value": 1}}]}, "filter.must[0].key"),
    ({"must": [{"key": "a", "match": {"any": []}}]}, "filter.must[0].match.any"),
    ({"should": [{"key": "a", "range": {"gt": "3"}}]}, "filter.should[0].range.gt"),
    ("category=boots", "filter"),
])
def test_malformed_filters_name_the_problem(raw: Any, names: str) -> None:
    with pytest.raises(InvalidMetadata) as err:
        parse_filter(raw)
    assert names in err.value.message


def test_empty_filter_is_no_filter() -> None:
    assert parse_filter({}) is None and parse_filter(None) is None
    assert parse_filter({"must": []}) is None
    assert isinstance(parse_filter({"must": {"key": "a", "match": {"value": "x"}}}), Filter)


def test_the_server_bounds_filter_graphs_by_its_constant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rubricsearch.app.settings import Settings
    from rubricsearch.app.state import _make_index

    monkeypatch.setattr("rubricsearch.app.state.FAISS_FILTER_GRAPH_BYTES", 64 << 20)
    index: Any = _make_index(Settings(_env_file=None, data_dir=tmp_path))
    assert index.filter_graphs.budget_bytes == 64 << 20
    index.close()


def test_scans_follow_the_cost_model_and_writes(tmp_path: Path) -> None:
    """An HNSW set scans a filter's rows exactly where the cost model says a scan beats the widened walk (few kept
    rows) and walks otherwise; the scan reads the set's rows as they are after upserts and deletes."""
    from rubricsearch.retrieval.index.faiss_accel import AcceleratedFaissIndex
    from rubricsearch.retrieval.index.faiss_accel.filtered_scan import RowScan
    from rubricsearch.retrieval.index.faiss_accel.plans import allowed_slots, search_plan

    index = AcceleratedFaissIndex(tmp_path, ann_threshold=100, ef_search=8, hnsw_m=8)  # a walk costs ~64 rows x boost
    rng = np.random.default_rng(5)
    vecs = unit(rng, N)
    ids = [sha(i) for i in range(N)]
    index.create_set("refs", DIM)
    index.upsert("refs", ids, vecs)
    index.set_payloads("refs", {s: {"size": i % 50} for i, s in enumerate(ids)})
    half = parse_filter({"must": [{"key": "size", "range": {"lt": 25}}]})  # 300 rows: the walk
    few = parse_filter({"must": [{"key": "size", "match": {"value": 7}}]})  # 12 rows: the scan
    assert half is not None and few is not None
    entry = index._sets["refs"]
    walk_rows = index.filter_scan_ratio * index.ef_search * index.hnsw_m
    assert not isinstance(search_plan(entry, allowed_slots(entry, half), 5, 8, walk_rows)[0], RowScan)
    assert isinstance(search_plan(entry, allowed_slots(entry, few), 5, 8, walk_rows)[0], RowScan)
    new = [sha(N + i) for i in range(3)]
    query = unit(rng, 1)[0]
    index.upsert("refs", new, np.stack([query, query, query]))  # the best rows for `query`, added last
    index.set_payloads("refs", {s: {"size": 7} for s in new})
    index.delete("refs", [new[2], ids[7]])
    keep = {s: vecs[i] for i, s in enumerate(ids) if i % 50 == 7 and i != 7} | {s: query for s in new[:2]}
    assert isinstance(search_plan(entry, allowed_slots(entry, few), 5, 8, walk_rows)[0], RowScan)
    assert_hits(index.search("refs", query, 5, filter=few)[0], exact(keep, query, 5), tol=1e-4)
    index.close()
