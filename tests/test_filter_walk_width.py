"""A filter met for the first time on an HNSW set walks the graph with faiss' selector, whose beam of efSearch
candidates counts every node it meets, kept or not. Its beam is widened (``faiss_accel.plans.walk_boost``) so that its
top-k among the kept rows is found as well as the unfiltered walk finds the set's: checked with a beam narrow
enough (efSearch 16, M 8) that the unfiltered walk misses some of its top-k, for filters keeping half and 30 % of
the set, against exact search."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rubricsearch.retrieval.index.faiss_accel import AcceleratedFaissIndex
from rubricsearch.retrieval.index.filters import parse_filter
from tests.test_index_congruence import sha

ROWS, DIM, QUERIES, K = 5000, 32, 200, 10


def lowrank(rng: np.random.Generator, n: int) -> np.ndarray:
    x = (rng.standard_normal((n, DIM)) * np.linspace(1, 0.2, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def walked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AcceleratedFaissIndex, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    base, queries = lowrank(rng, ROWS), lowrank(rng, QUERIES)
    index = AcceleratedFaissIndex(Path(tmp_path_factory.mktemp("walk")), ann_threshold=100, ef_search=16, hnsw_m=8,
                       filter_scan_ratio=0)  # always the walk, never the scan of the kept rows
    index.create_set("s", DIM)
    index.upsert("s", [sha(i) for i in range(ROWS)], base)
    index.set_payloads("s", {sha(i): {"tenth": i % 10} for i in range(ROWS)})
    yield index, base, queries
    index.close()


def recall(index: AcceleratedFaissIndex, base: np.ndarray, queries: np.ndarray, keep: np.ndarray, flt: object) -> float:
    row = {sha(i): i for i in range(ROWS)}
    scores = np.where(keep, queries @ base.T, -np.inf)
    found = [{row[h.id] for h in index.search("s", q, K, filter=flt)[0]} for q in queries]  # type: ignore[arg-type]
    return float(np.mean([len(got & set(np.argsort(-s)[:K].tolist())) / K for got, s in zip(found, scores,
                                                                                           strict=True)]))


@pytest.mark.parametrize("tenths", [5, 3])
def test_a_filtered_walk_finds_its_top_k_as_the_unfiltered_walk_does(
        walked: tuple[AcceleratedFaissIndex, np.ndarray, np.ndarray], tenths: int) -> None:
    index, base, queries = walked
    plain = recall(index, base, queries, np.ones(ROWS, dtype=bool), None)
    assert plain < 0.9  # the beam is narrow enough to miss: else the check below could not fail
    flt = parse_filter({"must": [{"key": "tenth", "range": {"lt": tenths}}]})
    assert recall(index, base, queries, np.arange(ROWS) % 10 < tenths, flt) >= plain
