"""Filtered vector search: recall@k against exact filtered search, and p50 beside the unfiltered search.

One :class:`~retrieval.index.faiss_index.FaissIndex` per search path, at the product's defaults (the CPU path:
exact below ``ann_threshold`` rows, HNSW above; ``device``: the exact search on an accelerator), every row carrying
a payload ``{"bucket": 0..999, "row": i}`` (the bucket drawn at random), so a filter ``bucket < 1000 * f`` keeps
a fraction ``f`` of the set independently of the vectors. Queries are sent one at a time, as the search service
does, and every timed search builds its slot mask (each query gets its own filter object). Per fraction:

* **new filters**: query j also drops one kept row of its own, so no two queries share a mask: what a never-seen filter
  costs (on an HNSW set, the selector walk or the scan of the kept rows);
* **recurring filter** (CPU path): every query keeps the same rows; the first search is timed alone, the second
  starts that filter's own graph in the background (``retrieval.index.filter_graphs``, where the filter keeps
  < 20 % of an HNSW set; its build time is printed apart), then the queries are timed again (steady state).

Truth is exact float32 search over the kept rows (numpy). Build times are printed apart from query times. The
data are drawn on the GPU when there is one (:func:`bench.ann_recall.device_data`: seconds at 1M x 2048).

    .venv/bin/python bench/filter_search.py                                   # 100k x 256, CPU
    python3 bench/filter_search.py --n 1000000 --dim 2048 --paths device,cpu --cpu-n 250000   # GPU box

``--paths device`` measures the accelerator path (a masked half-precision pass, exact re-score) on
``--search-device``; with ``cpu`` there it runs torch's CPU kernels, a correctness check rather than a timing.
``--cpu-n`` builds the CPU index on the first rows only (its HNSW build is the long part at 1M x 2048).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ann_recall import device_data, make_data
from retrieval.index.faiss_index import FaissIndex
from retrieval.index.filters import Filter, parse_filter

BUCKETS = 1000


def defaults() -> dict[str, object]:
    """FaissIndex's own defaults, printed with every run (the bench overrides none unless told)."""
    params = inspect.signature(FaissIndex.__init__).parameters
    names = ("ann_threshold", "hnsw_m", "ef_construction", "ef_search", "exact_filter_rows", "filter_graph_bytes",
             "search_threads")
    return {name: params[name].default for name in names}


def query_filter(fraction: float, j: int, drop: int | None = None) -> Filter:
    """``bucket < 1000 * fraction`` (its bound nudged per query: a new filter object, the same rows), and for a
    new filter ``row != drop`` too (a mask no other query has)."""
    raw: dict[str, Any] = {"must": [{"key": "bucket", "range": {"lt": BUCKETS * fraction - 1e-6 * (j + 1)}}]}
    if drop is not None:
        raw["must_not"] = [{"key": "row", "match": {"value": drop}}]
    f = parse_filter(raw)
    assert f is not None
    return f


def truth(scores: np.ndarray, keep: np.ndarray, k: int) -> set[int]:
    """Rows of the exact top-k of one query's scores among ``keep``."""
    s = np.where(keep, scores, -np.inf)
    top = np.argpartition(-s, min(k, len(s) - 1))[:k]
    return {int(i) for i in top if keep[i]}


def timed(idx: FaissIndex, queries: np.ndarray, k: int, fraction: float | None, drops: np.ndarray | None,
          sync: bool) -> tuple[list[list[str]], list[float]]:
    """Each query searched alone; ``drops``: one row per query that its (new) filter leaves out."""
    import torch

    hits, times = [], []
    for j, q in enumerate(queries):
        flt = None if fraction is None else query_filter(fraction, j, None if drops is None else int(drops[j]))
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        found = idx.search("bench", q, k, filter=flt)[0]
        times.append(time.perf_counter() - t0)
        hits.append([h.id for h in found])
    return hits, times


def recall(hits: list[list[str]], want: list[set[int]], row_of: dict[str, int], k: int) -> float:
    return float(np.mean([len({row_of[h] for h in got} & w) / max(1, min(k, len(w)))
                          for got, w in zip(hits, want, strict=True)]))


def measure(path: str, args: argparse.Namespace, base: np.ndarray, queries: np.ndarray, scores: np.ndarray,
            buckets: np.ndarray) -> list[dict[str, Any]]:
    """Build one index over ``base`` for ``path`` and time the unfiltered and filtered searches."""
    n = len(base)
    ids = [hashlib.sha256(i.to_bytes(8, "little")).hexdigest() for i in range(n)]
    row_of = {sha: i for i, sha in enumerate(ids)}
    buckets = buckets[:n]
    options: dict[str, Any] = {} if args.ann_threshold is None else {"ann_threshold": args.ann_threshold}
    if path == "device":
        options = {"device_search": "torch", "search_device": args.search_device, "device_max_bytes": 1 << 40}
    sync = path == "device" and args.search_device.startswith("cuda")
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        idx = FaissIndex(Path(tmp), autoflush=False, **options)
        idx.create_set("bench", base.shape[1])
        t0 = time.perf_counter()
        for s in range(0, n, 50_000):
            idx.upsert("bench", ids[s:s + 50_000], base[s:s + 50_000])
            if (s + 50_000) % 250_000 == 0:
                print(f"#   {path}: {s + 50_000} rows in {time.perf_counter() - t0:.0f} s", flush=True)
        build_s = time.perf_counter() - t0
        idx.set_payloads("bench", {sha: {"bucket": int(b), "row": i} for i, (sha, b) in enumerate(zip(ids, buckets,
                                                                                                   strict=True))})
        kind = f"device {args.search_device}" if path == "device" else ("hnsw" if idx.is_ann("bench") else "exact")
        print(f"# {path}: built {n} x {base.shape[1]} ({args.data}) in {build_s:.1f} s: search path {kind}",
              flush=True)
        idx.search("bench", queries[0], args.k)  # warm-up: device mirror
        idx.search("bench", queries[0], args.k, filter=query_filter(0.5, -2, -1))  # warm-up: payload columns
        _, plain = timed(idx, queries, args.k, None, None, sync)
        p50_plain = float(np.percentile(plain, 50))
        out.append({"path": path, "n": n, "filter": "none", "kept": n, "p50_ms": p50_plain * 1e3, "ratio": 1.0})
        for fraction in args.fractions:
            keep = buckets < BUCKETS * fraction
            row: dict[str, Any] = {"path": path, "n": n, "filter": f"{fraction:.1%}", "kept": int(keep.sum())}
            kept_rows = np.flatnonzero(keep)
            drops = kept_rows[np.arange(len(queries)) % len(kept_rows)]
            want = [truth(sc, keep & (np.arange(n) != d), args.k) for sc, d in zip(scores, drops, strict=True)]
            before = idx.filter_graphs.builds
            hits, times = timed(idx, queries, args.k, fraction, drops, sync)
            new_p50 = float(np.percentile(times, 50))
            idx.filter_graphs.wait()
            row.update(new_graphs=idx.filter_graphs.builds - before, new_p50_ms=new_p50 * 1e3,
                       new_ratio=new_p50 / p50_plain, new_recall=recall(hits, want, row_of, args.k))
            if path != "device":
                want = [truth(sc, keep, args.k) for sc in scores]
                built = idx.filter_graphs.builds
                _, first = timed(idx, queries[:2], args.k, fraction, None, sync)  # the 2nd starts a graph
                idx.filter_graphs.wait()
                graph_s = idx.filter_graphs.last_build_s if idx.filter_graphs.builds > built else None
                row.update(first_ms=first[0] * 1e3, graph_s=graph_s, graphs=idx.filter_graphs.builds)
                hits, times = timed(idx, queries, args.k, fraction, None, sync)
                p50 = float(np.percentile(times, 50))
                row.update(p50_ms=p50 * 1e3, ratio=p50 / p50_plain, recall=recall(hits, want, row_of, args.k))
            out.append(row)
        idx.drop_set("bench")
        idx.close()
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    import torch

    if args.search_device.startswith("cuda") and torch.cuda.is_available():
        base, queries = device_data(args.data, args.n, args.queries, args.dim, args.seed, args.search_device)
    else:
        base, queries = make_data(args.data, args.n, args.queries, args.dim, args.seed)
    buckets = np.random.default_rng(args.seed + 1).integers(0, BUCKETS, args.n)
    scores = np.concatenate([queries @ base[s:s + 100_000].T for s in range(0, args.n, 100_000)], axis=1)
    print(f"# data {args.n} x {args.dim} and exact scores in {time.perf_counter() - t0:.1f} s", flush=True)
    rows: list[dict[str, Any]] = []
    for path in args.paths:
        n = args.n if path == "device" else min(args.cpu_n or args.n, args.n)
        rows += measure(path, args, base[:n], queries, scores[:, :n], buckets)
    return rows


def cell(row: dict[str, Any], key: str, fmt: str) -> str:
    return "-" if row.get(key) is None else format(row[key], fmt)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000, help="references in the set")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--data", default="lowrank", choices=["lowrank", "clustered", "uniform"])
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 0.05, 0.005],
                        help="fractions of the set the filters keep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paths", type=lambda s: s.split(","), default=["cpu"],
                        help="comma-separated: cpu (exact or HNSW by size), device (torch on --search-device)")
    parser.add_argument("--search-device", default="cuda")
    parser.add_argument("--cpu-n", type=int, default=None, help="build the CPU index on the first rows only")
    parser.add_argument("--ann-threshold", type=int, default=None,
                        help="rows above which the CPU index is HNSW (default: FaissIndex's; smoke tests lower it)")
    args = parser.parse_args(argv)
    if not set(args.paths) <= {"cpu", "device"}:
        parser.error(f"--paths takes cpu and/or device, not {args.paths}")
    rows = run(args)
    print(f"{'path':>6} {'n':>8} {'filter':>6} {'kept':>8} | {'new filters: p50 ms':>19} {'/ unfilt.':>9} "
          f"{'recall':>6} | {'recurring: 1st ms':>17} {'graph s':>7} {'p50 ms':>7} {'/ unfilt.':>9} {'recall':>6}")
    for r in rows:
        plain = r["filter"] == "none"
        print(f"{r['path']:>6} {r['n']:>8} {r['filter']:>6} {r['kept']:>8} | "
              f"{cell(r, 'p50_ms' if plain else 'new_p50_ms', '.3f'):>19} "
              f"{cell(r, 'ratio' if plain else 'new_ratio', '.2f'):>9} {cell(r, 'new_recall', '.3f'):>6} | "
              f"{cell(r, 'first_ms', '.3f'):>17} {cell(r, 'graph_s', '.2f'):>7} "
              f"{'' if plain else cell(r, 'p50_ms', '.3f'):>7} {'' if plain else cell(r, 'ratio', '.2f'):>9} "
              f"{cell(r, 'recall', '.3f'):>6}")
    print(f"\nn={args.n} cpu_n={args.cpu_n or args.n} dim={args.dim} data={args.data} queries={args.queries} "
          f"k={args.k} paths={','.join(args.paths)} search_device={args.search_device}"
          + ("" if args.ann_threshold is None else f" ann_threshold={args.ann_threshold} (not the default)")
          + "; FaissIndex defaults: "
          + ", ".join(f"{k}={v}" for k, v in defaults().items()))
    return rows


if __name__ == "__main__":
    main()
