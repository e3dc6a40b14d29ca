"""Filtered vector search: recall@k against exact filtered search, and p50 beside the unfiltered search.

One :class:`~retrieval.index.faiss_index.FaissIndex` at the product's defaults (exact below
``ann_threshold`` rows, HNSW above; ``exact_filter_rows`` below which a filtered HNSW search scans the kept
rows exactly), every row carrying a payload ``{"bucket": 0..999}`` drawn at random, so a filter
``bucket < 1000 * f`` keeps a fraction ``f`` of the set independently of the vectors. Each query gets its own
filter object (the bounds differ by less than a bucket), so every timed search also builds its slot mask, as a
never-seen filter would. Queries are sent one at a time, as the search service does; truth is exact
float32 search over the kept rows (numpy).

    .venv/bin/python bench/filter_search.py                                   # 100k x 256, CPU
    .venv/bin/python bench/filter_search.py --n 1000000 --dim 2048 --data lowrank     # the target size
    python3 bench/filter_search.py --n 1000000 --dim 2048 --device-search torch --search-device cuda   # GPU

``--device-search torch`` measures the accelerator path (a masked half-precision pass, exact re-score);
with ``--search-device cpu`` it runs torch's CPU kernels, a correctness check rather than a timing.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ann_recall import make_data
from retrieval.index.faiss_index import FaissIndex
from retrieval.index.filters import Filter, parse_filter

BUCKETS = 1000


def defaults() -> dict[str, object]:
    """FaissIndex's own defaults, printed with every run (the bench overrides none unless told)."""
    params = inspect.signature(FaissIndex.__init__).parameters
    names = ("ann_threshold", "hnsw_m", "ef_construction", "ef_search", "exact_filter_rows", "search_threads")
    return {name: params[name].default for name in names}


def query_filter(fraction: float, j: int) -> Filter:
    """``bucket < 1000 * fraction``, its bound nudged per query so no two queries share a cached mask."""
    f = parse_filter({"must": [{"key": "bucket", "range": {"lt": BUCKETS * fraction - 1e-6 * (j + 1)}}]})
    assert f is not None
    return f


def exact_truth(base: np.ndarray, keep: np.ndarray, queries: np.ndarray, k: int) -> list[set[int]]:
    rows = np.flatnonzero(keep)
    scores = queries @ base[rows].T
    top = np.argsort(-scores, axis=1)[:, :k]
    return [set(rows[t].tolist()) for t in top]


def timed(idx: FaissIndex, queries: np.ndarray, k: int, fraction: float | None,
          sync: bool) -> tuple[list[list[str]], list[float]]:
    import torch

    hits, times = [], []
    for j, q in enumerate(queries):
        flt = None if fraction is None else query_filter(fraction, j)
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        found = idx.search("bench", q, k, filter=flt)[0]
        times.append(time.perf_counter() - t0)
        hits.append([h.id for h in found])
    return hits, times


def run(args: argparse.Namespace) -> list[dict[str, object]]:
    base, queries = make_data(args.data, args.n, args.queries, args.dim, args.seed)
    ids = [hashlib.sha256(i.to_bytes(8, "little")).hexdigest() for i in range(args.n)]
    row_of = {sha: i for i, sha in enumerate(ids)}
    buckets = np.random.default_rng(args.seed + 1).integers(0, BUCKETS, args.n)
    options: dict[str, object] = {}
    if args.device_search:
        options = {"device_search": args.device_search, "search_device": args.search_device,
                   "device_max_bytes": 1 << 40}
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        idx = FaissIndex(Path(tmp), autoflush=False, **options)  # type: ignore[arg-type]
        idx.create_set("bench", args.dim)
        t0 = time.perf_counter()
        for s in range(0, args.n, 50_000):
            idx.upsert("bench", ids[s:s + 50_000], base[s:s + 50_000])
        build_s = time.perf_counter() - t0
        idx.set_payloads("bench", {sha: {"bucket": int(b)} for sha, b in zip(ids, buckets, strict=True)})
        path = "device " + args.search_device if args.device_search else ("hnsw" if idx.is_ann("bench") else "exact")
        print(f"# built {args.n} x {args.dim} ({args.data}) in {build_s:.1f} s: search path {path}", flush=True)
        sync = bool(args.device_search) and args.search_device.startswith("cuda")
        idx.search("bench", queries[0], args.k)  # warm-up: device mirror
        idx.search("bench", queries[0], args.k, filter=query_filter(0.5, -2))  # warm-up: payload columns
        _, plain = timed(idx, queries, args.k, None, sync)
        p50_plain = float(np.percentile(plain, 50))
        out.append({"filter": "none", "kept": args.n, "p50_ms": p50_plain * 1e3, "ratio": 1.0, "recall": None})
        for fraction in args.fractions:
            keep = buckets < BUCKETS * fraction
            truth = exact_truth(base, keep, queries, args.k)
            hits, times = timed(idx, queries, args.k, fraction, sync)
            recall = np.mean([len({row_of[h] for h in got} & want) / min(args.k, int(keep.sum()))
                              for got, want in zip(hits, truth, strict=True)])
            p50 = float(np.percentile(times, 50))
            out.append({"filter": f"{fraction:.1%}", "kept": int(keep.sum()), "p50_ms": p50 * 1e3,
                        "ratio": p50 / p50_plain, "recall": float(recall)})
        idx.drop_set("bench")
        idx.close()
    return out


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000, help="references in the set")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--data", default="lowrank", choices=["lowrank", "clustered", "uniform"])
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 0.05, 0.005],
                        help="fractions of the set the filters keep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device-search", choices=["torch"], default=None)
    parser.add_argument("--search-device", default="cuda")
    args = parser.parse_args(argv)
    rows = run(args)
    print(f"{'filter':>8} {'kept':>9} {'p50 ms':>8} {'p50 / unfiltered':>17} {'recall@' + str(args.k):>10}")
    for r in rows:
        recall = "-" if r["recall"] is None else f"{r['recall']:.3f}"
        print(f"{r['filter']:>8} {r['kept']:>9} {r['p50_ms']:>8.3f} {r['ratio']:>17.2f} {recall:>10}")
    print(f"\nn={args.n} dim={args.dim} data={args.data} queries={args.queries} k={args.k} "
          f"device_search={args.device_search or 'none'}"
          + (f" on {args.search_device}" if args.device_search else "")
          + "; FaissIndex defaults: " + ", ".join(f"{k}={v}" for k, v in defaults().items()))
    return rows


if __name__ == "__main__":
    main()
