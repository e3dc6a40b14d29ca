"""The selector walk's widening, measured per rule in the same run: ``bench/filter_search.py --ef-scales``.

On an HNSW set a filter met for the first time walks the graph with faiss' selector, its efSearch widened by
``retrieval.index.faiss_accel.plans.walk_boost`` = ``FILTER_EF_SCALE`` / sqrt(kept fraction) (clamped to 1..16), or
scans the kept rows where that costs less. The walk keeps only the accepted nodes among those it meets while its beam
counts every node, so how wide it must be for recall is an empirical question, and the full bench's build (the
long part at 1M x 2048) is paid once: after the main cases (its rows print as measured, before their table), this
repeats the walk's cases (a first use, and a new filter over a recurring leaf) for each value given, overriding
``FILTER_EF_SCALE`` in this process for these rows only (a bench knob, never a product setting), the product's
value first. Each row prints the widening and the plan it gives (scan, or walk at an efSearch), p50 /
unfiltered, recall@10 against exact filtered search, and faiss' count of distances computed per walk
(``hnsw_stats.ndis``: the beam's real width; 0 for a scan); the unfiltered walk's recall is printed above them,
the bar a filtered walk's recall is held to.

First-use windows here start past those the main table used, so every query's leaf is still met for the first
time. Truth is read from each query's exact top rows of the whole set, which hold its filtered top-k whenever
the filter keeps enough of them (else the full exact search, as in the main table).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.* from any working directory

from bench.filter_cases import BUCKETS, first_use_filter, query_filter, recall, timed

SHORTLIST = 4096  # each query's exact top rows of the whole set, from which its filtered truths are read


def ordered(product: float, values: list[float]) -> list[float]:
    """The values to run, the product's own first (each once)."""
    return [product] + [v for v in dict.fromkeys(values) if v != product]


def exact_tops(scores: np.ndarray, m: int) -> np.ndarray:
    """Per query, the rows of its ``m`` best scores in the whole set, best first."""
    m = min(m, scores.shape[1])
    part = np.argpartition(-scores, m - 1, axis=1)[:, :m]
    order = np.argsort(-np.take_along_axis(scores, part, axis=1), axis=1)
    return np.take_along_axis(part, order, axis=1)


def filtered_truth(scores: np.ndarray, tops: np.ndarray, j: int, k: int,
                   kept: Callable[[int, np.ndarray], np.ndarray]) -> set[int]:
    """Query j's exact top-k among the rows ``kept(j, rows)`` accepts: the first k kept of its top rows, or the
    full search where fewer than k of them are kept."""
    hits = tops[j][kept(j, tops[j])][:k]
    if len(hits) == k:
        return {int(i) for i in hits}
    rows = np.arange(scores.shape[1])
    s = np.where(kept(j, rows), scores[j], -np.inf)
    top = np.argsort(-s)[:k]
    return {int(i) for i in top if np.isfinite(s[i])}


def sweep(idx: Any, args: argparse.Namespace, queries: np.ndarray, scores: np.ndarray, buckets: np.ndarray,
          ranks: np.ndarray, ctx: dict[str, Any]) -> list[dict[str, Any]]:
    """The walk's cases per kept fraction in ``args.ef_kept`` and value in ``args.ef_scales`` (printed as they
    are measured, so a run cut short keeps them); ``ctx`` as for ``measure_fraction``."""
    from rubricsearch.retrieval.index.faiss_accel import plans

    t0 = time.perf_counter()
    product = plans.FILTER_EF_SCALE
    ctx = {**ctx, "tops": exact_tops(scores, SHORTLIST), "k": args.k}
    print(f"\nwidening rule (bench-only override of plans.FILTER_EF_SCALE; product {product} first): "
          f"efSearch {idx.ef_search} x value / sqrt(kept fraction), clamped to 1..{plans.FILTER_EF_BOOST:g}")
    print(f"{'':>31} | {'first use (a new leaf)':^36} | {'new filter, recurring leaf':^36}")
    print(f"{'filter':>6} {'value':>6} {'x':>6} {'plan':>10} | "
          + " | ".join(f"{'p50 ms':>8} {'/ unf.':>7} {'recall':>6} {'dist/q':>11}" for _ in CASES), flush=True)
    plain = walk_case(idx, queries, scores, "", lambda j: None, lambda j, r: np.ones(len(r), dtype=bool), ctx)
    print(f"{'none':>6} {'':>6} {'':>6} {f'walk {idx.ef_search}':>10} | {plain['p50_ms']:8.3f} {plain['ratio']:7.2f} "
          f"{plain['recall']:6.3f} {plain['ndis']:11.0f} |  (the unfiltered walk, for reference)", flush=True)
    rows: list[dict[str, Any]] = []
    try:
        for fraction in args.ef_kept:
            for i, value in enumerate(ordered(product, args.ef_scales)):
                plans.FILTER_EF_SCALE = value
                start = (i + 2) * (len(queries) + 2)  # past every window used before: each leaf met the first time
                row = walk_row(idx, queries, scores, buckets, fraction, ranks, start, ctx)
                row.update(filter=f"{fraction:.1%}", ef_scale=value)
                print(f"{row['filter']:>6} {value:6.3g} {row['boost']:6.2f} {row['plan']:>10} | " + " | ".join(
                    f"{row[c + 'p50_ms']:8.3f} {row[c + 'ratio']:7.2f} {row[c + 'recall']:6.3f} {row[c + 'ndis']:11.0f}"
                    if c + "p50_ms" in row else f"{'- (its leaf gets a graph)':>36}" for c in CASES), flush=True)
                rows.append(row)
    finally:
        plans.FILTER_EF_SCALE = product
    print(f"# widening rows in {time.perf_counter() - t0:.1f} s", flush=True)
    return rows


CASES = ("use_", "new_")


def walk_row(idx: Any, queries: np.ndarray, scores: np.ndarray, buckets: np.ndarray, fraction: float,
             ranks: np.ndarray, start: int, ctx: dict[str, Any]) -> dict[str, Any]:
    """Both cases for filters keeping ``fraction`` of the set at the current FILTER_EF_SCALE: first-use
    windows of the ranks from ``start``, and ``bucket < 1000 * fraction AND row != drop_j`` (only where that leaf
    is walked with a selector, not served by a graph of its own)."""
    from rubricsearch.retrieval.index.faiss_accel import plans
    from rubricsearch.retrieval.index.faiss_accel.filter_graphs import GRAPH_FRACTION

    keep = buckets < BUCKETS * fraction
    n, nq, width = len(keep), len(queries), int(keep.sum())
    boost = plans.walk_boost(width, n)
    ef = max(math.ceil(idx.ef_search * boost), ctx["k"])
    walk_rows = idx.filter_scan_ratio * idx.ef_search * idx.hnsw_m
    drops = np.flatnonzero(keep)[np.arange(nq) % width]
    row: dict[str, Any] = {"path": "cpu", "n": n, "kept": width, "boost": boost,
                           "plan": "scan" if width <= walk_rows * boost else f"walk {ef}"}
    row.update(walk_case(idx, queries, scores, "use_", lambda j: first_use_filter(width, start + j),
                         lambda j, r: (ranks[r] >= start + j) & (ranks[r] < start + j + width), ctx))
    if width >= GRAPH_FRACTION * n:  # a smaller leaf recurring gets a graph of its own: no selector walk to widen
        row.update(walk_case(idx, queries, scores, "new_", lambda j: query_filter(fraction, j, int(drops[j])),
                             lambda j, r: keep[r] & (r != drops[j]), ctx))
    return row


def walk_case(idx: Any, queries: np.ndarray, scores: np.ndarray, name: str, make: Callable[[int], Any],
              kept: Callable[[int, np.ndarray], np.ndarray], ctx: dict[str, Any]) -> dict[str, Any]:
    """One case's p50, its ratio to the unfiltered p50, recall@k, and faiss' distances computed per query."""
    import faiss

    stats, k = faiss.cvar.hnsw_stats, ctx["k"]
    stats.reset()
    hits, times = timed(idx, queries, k, make, ctx["sync"])
    ndis = stats.ndis / len(queries)
    want = [filtered_truth(scores, ctx["tops"], j, k, kept) for j in range(len(queries))]
    p50 = float(np.percentile(times, 50))
    return {f"{name}p50_ms": p50 * 1e3, f"{name}ratio": p50 / ctx["p50_plain"],
            f"{name}recall": recall(hits, want, ctx["row_of"], k), f"{name}ndis": ndis}
