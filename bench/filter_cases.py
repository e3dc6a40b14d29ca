"""The filters, truth and timed searches shared by the filter benches (bench/filter_search.py, its widening sweep
bench/filter_ef_sweep.py and its A/B bench/filter_search_ab.py), so they import one way."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BUCKETS = 1000
STEPS = ("mask", "device", "rescore", "other")


def faiss_class() -> Any:
    """The product's FAISS backend with filtered search: the faiss_accel plug-in, or the FaissIndex of an older
    product (``--product``, the A/B), which held the filter machinery itself."""
    try:
        from rubricsearch.retrieval.index.faiss_accel import AcceleratedFaissIndex
    except ImportError:
        from rubricsearch.retrieval.index.faiss_index import FaissIndex

        return FaissIndex
    return AcceleratedFaissIndex


def defaults() -> dict[str, object]:
    """The FAISS backend's own defaults (its class's and the classes' it layers on), printed with every run (the
    bench overrides none unless told)."""
    params: dict[str, inspect.Parameter] = {}
    for klass in reversed(faiss_class().__mro__):
        if "__init__" in vars(klass):
            params.update(inspect.signature(klass.__init__).parameters)
    names = ("ann_threshold", "hnsw_m", "ef_construction", "ef_search", "filter_scan_ratio", "filter_graph_bytes",
             "search_threads")
    return {name: params[name].default for name in names if name in params}  # an older product may lack some


def query_filter(fraction: float, j: int, drop: int | None = None) -> Any:
    """``bucket < 1000 * fraction`` (its bound nudged per query: a new filter object, the same rows), and for a
    new filter ``row != drop`` too (a mask no other query has)."""
    from rubricsearch.retrieval.index.filters import parse_filter

    raw: dict[str, Any] = {"must": [{"key": "bucket", "range": {"lt": BUCKETS * fraction - 1e-6 * (j + 1)}}]}
    if drop is not None:
        raw["must_not"] = [{"key": "row", "match": {"value": drop}}]
    f = parse_filter(raw)
    assert f is not None
    return f


def first_use_filter(width: int, j: int) -> Any:
    """``j <= rank < j + width``: a window of the rows' random ranks that no other query's leaf covers."""
    from rubricsearch.retrieval.index.filters import parse_filter

    return parse_filter({"must": [{"key": "rank", "range": {"gte": j, "lt": j + width}}]})


def top_buckets(fraction: float) -> int:
    return round(BUCKETS * (1 - fraction))


def recurring_filter(fraction: float, j: int) -> Any:
    """``bucket >= 1000 * (1 - fraction)`` (written ``bucket > that - 1 + a nudge``: a new filter object, the same
    rows every query, not those of :func:`query_filter`)."""
    from rubricsearch.retrieval.index.filters import parse_filter

    return parse_filter({"must": [{"key": "bucket", "range": {"gt": top_buckets(fraction) - 1 + 1e-6 * (j + 1)}}]})


def truth(scores: np.ndarray, keep: np.ndarray, k: int) -> set[int]:
    """Rows of the exact top-k of one query's scores among ``keep``."""
    s = np.where(keep, scores, -np.inf)
    top = np.argpartition(-s, min(k, len(s) - 1))[:k]
    return {int(i) for i in top if keep[i]}


def timed(idx: Any, queries: np.ndarray, k: int, make: Callable[[int], Any], sync: bool,
          steps: dict[str, list[float]] | None = None) -> tuple[list[list[str]], list[float]]:
    """Each query searched alone, query j with the filter ``make(j)`` (built before the clock starts; None: no
    filter); ``steps``: each search's time split as :data:`STEPS` says."""
    import torch

    hits, times = [], []
    with split_steps(idx, steps) as spent:
        for j, q in enumerate(queries):
            flt = make(j)
            if sync:
                torch.cuda.synchronize()
            spent.clear()
            t0 = time.perf_counter()
            found = idx.search("bench", q, k, filter=flt)[0]
            times.append(time.perf_counter() - t0)
            hits.append([h.id for h in found])
            if steps is not None:
                for step in STEPS[:-1]:
                    steps.setdefault(step, []).append(spent.get(step, 0.0))
                steps.setdefault("other", []).append(times[-1] - sum(spent.values()))
    return hits, times


def warmed(idx: Any, queries: np.ndarray, k: int, make: Callable[[int], Any], sync: bool) -> dict[str, Any]:
    """The first search with ``make(0)``, timed alone, and a second sighting of its rows (which starts a graph
    where one is due), then the build waited for: its seconds, or None where none was built."""
    built = idx.filter_graphs.builds
    _, first = timed(idx, queries[:2], k, make, sync)
    idx.filter_graphs.wait()
    graph_s = idx.filter_graphs.last_build_s if idx.filter_graphs.builds > built else None
    return {"first_ms": first[0] * 1e3, "graph_s": graph_s}


@contextmanager
def split_steps(idx: Any, steps: dict[str, list[float]] | None) -> Iterator[dict[str, float]]:
    """Times the steps of ``idx.search`` by wrapping the functions it calls (by name, so an older product's
    search splits the same way); yields the seconds each step took in the current search."""
    spent: dict[str, float] = {}
    if steps is None:
        yield spent
        return
    import sys

    cls = faiss_class()
    mirror = idx._sets["bench"].mirror
    targets: list[tuple[Any, str, str]] = [(sys.modules[cls.__module__], "allowed_slots", "mask"),
                                           (cls, "_rescored", "rescore")]
    if mirror is not None:
        targets.append((type(mirror), "candidates", "device"))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]

    def clocked(fn: Callable[..., Any], step: str) -> Callable[..., Any]:
        def run(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[step] = spent.get(step, 0.0) + time.perf_counter() - t0
        return run

    for (owner, name, step), (_, _, fn) in zip(targets, saved, strict=True):
        setattr(owner, name, clocked(fn, step))
    try:
        yield spent
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def recall(hits: list[list[str]], want: list[set[int]], row_of: dict[str, int], k: int) -> float:
    return float(np.mean([len({row_of[h] for h in got} & w) / max(1, min(k, len(w)))
                          for got, w in zip(hits, want, strict=True)]))


CASES = (("use_", "first use (a new leaf)"), ("new_", "new filter, recurring leaf"), ("", "recurring filter"))
