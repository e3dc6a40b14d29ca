"""Filtered vector search: recall@k against exact filtered search, and p50 beside the unfiltered search.

One :class:`~retrieval.index.faiss_accel.AcceleratedFaissIndex` per search path, at the product's defaults (the CPU
path: exact below ``ann_threshold`` rows, HNSW above; ``device``: the exact search on an accelerator), every row
carrying a payload ``{"bucket": 0..999, "rank": a permutation of the rows, "row": i}`` (bucket and rank drawn at
random), so a filter ``bucket < 1000 * f`` keeps a fraction ``f`` of the set independently of the vectors. Queries
are sent one at a time, as the search service does, and every timed search builds its slot mask (each query gets its
own filter object). Per fraction, three cases, each printed with its first search and its p50:

* **first use**: query j keeps the rows whose rank lies in a window of its own (``j <= rank < j + f * n``), a
  condition never seen before, so nothing built earlier can serve it: the leaf's bitmap, then on an HNSW set the
  selector walk or the scan of the kept rows;
* **new filter, recurring leaf**: ``bucket < 1000 * f`` and, for query j, ``row != drop_j``: no two queries share a
  mask, but they share the leaf. Its first search is timed alone, the second sighting of the leaf starts its graph
  (``retrieval.index.faiss_accel.filter_graphs``, where it keeps < 20 % of an HNSW set; its build time is printed
  apart), then the queries are timed (steady state: each walks the leaf's graph with a selector for its own rows);
* **recurring filter** (CPU path): ``bucket >= 1000 * (1 - f)`` (other rows), the same filter every query: first
  search, then its graph's build, then steady state.

Truth is exact float32 search over each query's kept rows (numpy). Build times are printed apart from query times.
The data are drawn on the GPU when there is one (:func:`bench.ann_recall.device_data`: seconds at 1M x 2048).

    .venv/bin/python bench/filter_search.py                                   # 100k x 256, CPU
    python3 bench/filter_search.py --n 1000000 --dim 2048 --paths device,cpu --cpu-n 250000   # GPU box

``--paths device`` measures the accelerator path (a masked half-precision pass, exact re-score) on
``--search-device``; with ``cpu`` there it runs torch's CPU kernels, a correctness check rather than a timing.
``--cpu-n`` builds the CPU index on the first rows only (its HNSW build is the long part at 1M x 2048).

Per fraction, the first-use and new filters' searches are also split into steps (median ms): ``mask`` (the
filter's slot mask from the set's payload index), ``device`` (the accelerator pass with that mask, read-back
included), ``rescore`` (exact float32 re-scoring) and ``other`` (the rest of ``search``: on the CPU path, faiss' own
search, or a filter graph's walk).

``--ef-scales 0.25,0.75,1`` then repeats the selector walk's cases (at ``--ef-kept``, default 50 %) per value
of the walk's widening rule, overriding ``faiss_accel.plans.FILTER_EF_SCALE`` for those rows only
(bench/filter_ef_sweep.py).

``--against REF`` (bench/filter_search_ab.py) runs the same bench (this file) on an older product too, each arm in
its own process, one after the other, and prints both tables and their p50s side by side: REF is a folder holding
that product's ``retrieval/`` (e.g. ``git archive REF retrieval | tar -x -C old``), or a git ref exported with
``git archive``.

    python3 bench/filter_search.py --n 1000000 --dim 2048 --paths device --against 60508c1   # A/B on the GPU box
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# the product (retrieval/) is imported inside functions: ``--product DIR`` puts an older one first on the path

from bench.filter_cases import (  # noqa: E402
    BUCKETS,
    CASES,
    STEPS,
    defaults,
    faiss_class,
    first_use_filter,
    query_filter,
    recall,
    recurring_filter,
    timed,
    top_buckets,
    truth,
    warmed,
)


def measure(path: str, args: argparse.Namespace, base: np.ndarray, queries: np.ndarray, scores: np.ndarray,
            buckets: np.ndarray, ranks: np.ndarray) -> list[dict[str, Any]]:
    """Build one index over ``base`` for ``path`` and time the unfiltered and filtered searches."""

    n = len(base)
    ids = [hashlib.sha256(i.to_bytes(8, "little")).hexdigest() for i in range(n)]
    row_of = {sha: i for i, sha in enumerate(ids)}
    buckets = buckets[:n]
    ranks = np.argsort(ranks[:n])  # a permutation of the first n rows
    options: dict[str, Any] = {} if args.ann_threshold is None else {"ann_threshold": args.ann_threshold}
    if args.filter_scan_ratio is not None:
        options["filter_scan_ratio"] = args.filter_scan_ratio
    if path == "device":
        options = {"device_search": "torch", "search_device": args.search_device, "device_max_bytes": 1 << 40}
    sync = path == "device" and args.search_device.startswith("cuda")
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        idx = faiss_class()(Path(tmp), autoflush=False, **options)
        idx.create_set("bench", base.shape[1])
        t0 = time.perf_counter()
        for s in range(0, n, 50_000):
            idx.upsert("bench", ids[s:s + 50_000], base[s:s + 50_000])
            if (s + 50_000) % 250_000 == 0:
                print(f"#   {path}: {s + 50_000} rows in {time.perf_counter() - t0:.0f} s", flush=True)
        build_s = time.perf_counter() - t0
        idx.set_payloads("bench", {sha: {"bucket": int(b), "rank": int(r), "row": i}
                                   for i, (sha, b, r) in enumerate(zip(ids, buckets, ranks, strict=True))})
        kind = f"device {args.search_device}" if path == "device" else ("hnsw" if idx.is_ann("bench") else "exact")
        print(f"# {path}: built {n} x {base.shape[1]} ({args.data}) in {build_s:.1f} s: search path {kind}",
              flush=True)
        idx.search("bench", queries[0], args.k)  # warm-up: device mirror
        idx.search("bench", queries[0], args.k, filter=query_filter(0.5, -2, -1))  # warm-up: payload columns
        _, plain = timed(idx, queries, args.k, lambda j: None, sync)
        p50_plain = float(np.percentile(plain, 50))
        out.append({"path": path, "n": n, "filter": "none", "kept": n, "p50_ms": p50_plain * 1e3, "ratio": 1.0})
        for fraction in args.fractions:
            out.append(measure_fraction(idx, path, args, queries, scores, buckets, ranks, fraction,
                                        {"row_of": row_of, "p50_plain": p50_plain, "sync": sync}))
        if args.ef_scales and path == "cpu" and idx.is_ann("bench"):
            from bench.filter_ef_sweep import sweep  # it imports this module's helpers

            out += sweep(idx, args, queries, scores, buckets, ranks,
                         {"row_of": row_of, "p50_plain": p50_plain, "sync": sync})
        idx.drop_set("bench")
        idx.close()
    return out


def measure_fraction(idx: Any, path: str, args: argparse.Namespace, queries: np.ndarray, scores: np.ndarray,
                     buckets: np.ndarray, ranks: np.ndarray, fraction: float, ctx: dict[str, Any]) -> dict[str, Any]:
    """The three cases of one fraction (module docstring) on a built index; ``ctx``: ``row_of`` (id -> row),
    ``p50_plain`` (the unfiltered p50, s) and ``sync`` (synchronise the device before each clock)."""
    n, nq, k, sync = len(buckets), len(queries), args.k, ctx["sync"]
    keep = buckets < BUCKETS * fraction
    row: dict[str, Any] = {"path": path, "n": n, "filter": f"{fraction:.1%}", "kept": int(keep.sum())}

    def case(name: str, make: Callable[[int], Any], kept: Callable[[int], np.ndarray]) -> None:
        steps: dict[str, list[float]] = {}
        hits, times = timed(idx, queries, k, make, sync, steps)
        want = [truth(sc, kept(j), k) for j, sc in enumerate(scores)]
        p50 = float(np.percentile(times, 50))
        row.update({f"{name}p50_ms": p50 * 1e3, f"{name}ratio": p50 / ctx["p50_plain"],
                    f"{name}recall": recall(hits, want, ctx["row_of"], k),
                    f"{name}steps_ms": {step: float(np.median(v)) * 1e3 for step, v in steps.items()}})

    width, before = int(keep.sum()), idx.filter_graphs.builds
    row["use_first_ms"] = timed(idx, queries[:1], k, lambda j: first_use_filter(width, nq + 1), sync)[1][0] * 1e3
    case("use_", lambda j: first_use_filter(width, j), lambda j: (ranks >= j) & (ranks < j + width))
    idx.filter_graphs.wait()
    row["use_graphs"], before = idx.filter_graphs.builds - before, idx.filter_graphs.builds
    drops = np.flatnonzero(keep)[np.arange(nq + 2) % width]  # the first two: the leaf's first two sightings
    leaf = warmed(idx, queries, k, lambda j: query_filter(fraction, j, int(drops[j])), sync)
    row.update(new_first_ms=leaf["first_ms"], new_graph_s=leaf["graph_s"])
    case("new_", lambda j: query_filter(fraction, j, int(drops[j + 2])),
         lambda j: keep & (np.arange(n) != drops[j + 2]))
    row["new_graphs"] = idx.filter_graphs.builds - before
    if path != "device":
        other = buckets >= top_buckets(fraction)
        row.update(warmed(idx, queries, k, lambda j: recurring_filter(fraction, j), sync))
        case("", lambda j: recurring_filter(fraction, j), lambda j: other)
        row["graphs"] = idx.filter_graphs.builds
    return row


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    import torch

    from bench.ann_recall import device_data, make_data

    if args.search_device.startswith("cuda") and torch.cuda.is_available():
        base, queries = device_data(args.data, args.n, args.queries, args.dim, args.seed, args.search_device)
    else:
        base, queries = make_data(args.data, args.n, args.queries, args.dim, args.seed)
    buckets = np.random.default_rng(args.seed + 1).integers(0, BUCKETS, args.n)
    ranks = np.random.default_rng(args.seed + 2).random(args.n)
    scores = np.concatenate([queries @ base[s:s + 100_000].T for s in range(0, args.n, 100_000)], axis=1)
    print(f"# data {args.n} x {args.dim} and exact scores in {time.perf_counter() - t0:.1f} s", flush=True)
    rows: list[dict[str, Any]] = []
    for path in args.paths:
        n = args.n if path == "device" else min(args.cpu_n or args.n, args.n)
        rows += measure(path, args, base[:n], queries, scores[:, :n], buckets, ranks)
    return rows


def cell(row: dict[str, Any], key: str, fmt: str) -> str:
    return "-" if row.get(key) is None else format(row[key], fmt)




def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """One line per fraction: each case's first search, graph build (where one was built), p50 and recall."""
    print(f"{'':>31} | " + " | ".join(f"{title:^43}" for _, title in CASES))
    print(f"{'path':>6} {'n':>8} {'filter':>6} {'kept':>8} | "
          + " | ".join(f"{'1st ms':>8} {'graph s':>7} {'p50 ms':>8} {'/ unf.':>7} {'recall':>6}" for _ in CASES))
    rows = [r for r in rows if "ef_scale" not in r]  # the widening rows: printed as measured
    for r in rows:
        if r["filter"] == "none":
            print(f"{r['path']:>6} {r['n']:>8} {'none':>6} {r['kept']:>8} | {'':>8} {'':>7} {r['p50_ms']:8.3f} "
                  f"{1.0:7.2f}")
            continue
        cells = [f"{cell(r, c + 'first_ms', '.3f'):>8} {cell(r, c + 'graph_s', '.2f'):>7} "
                 f"{cell(r, c + 'p50_ms', '.3f'):>8} {cell(r, c + 'ratio', '.2f'):>7} {cell(r, c + 'recall', '.3f'):>6}"
                 for c, _ in CASES]
        print(f"{r['path']:>6} {r['n']:>8} {r['filter']:>6} {r['kept']:>8} | " + " | ".join(cells))
    print(f"\nmedian ms per step of search: {'':>19} {' '.join(f'{s:>8}' for s in STEPS)}")
    for r in rows:
        for c, title in CASES[:2]:
            if r.get(c + "steps_ms"):
                spent = " ".join(f"{r[c + 'steps_ms'][step]:8.3f}" for step in STEPS)
                print(f"{r['path']:>6} {r['filter']:>6} {title:>34} {spent}")
    import rubricsearch.retrieval

    print(f"\nproduct: {Path(rubricsearch.retrieval.__file__).parent}")
    print(f"n={args.n} cpu_n={args.cpu_n or args.n} dim={args.dim} data={args.data} queries={args.queries} "
          f"k={args.k} paths={','.join(args.paths)} search_device={args.search_device}"
          + ("" if args.ann_threshold is None else f" ann_threshold={args.ann_threshold} (not the default)")
          + ("" if args.filter_scan_ratio is None else f" filter_scan_ratio={args.filter_scan_ratio} (not the default)")
          + ("" if not args.ef_scales else f" ef_scales={args.ef_scales} ef_kept={args.ef_kept} (bench-only)")
          + "; FAISS defaults: "
          + ", ".join(f"{k}={v}" for k, v in defaults().items()))


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000, help="references in the set")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--data", default="lowrank", choices=["lowrank", "clustered", "uniform"])
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--fractions", type=floats, default=[0.5, 0.05, 0.005],
                        help="fractions of the set the filters keep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paths", type=lambda s: s.split(","), default=["cpu"],
                        help="comma-separated: cpu (exact or HNSW by size), device (torch on --search-device)")
    parser.add_argument("--search-device", default="cuda")
    parser.add_argument("--cpu-n", type=int, default=None, help="build the CPU index on the first rows only")
    parser.add_argument("--ann-threshold", type=int, default=None,
                        help="rows above which the CPU index is HNSW (default: FaissIndex's; smoke tests lower it)")
    parser.add_argument("--filter-scan-ratio", type=float, default=None,
                        help="FaissIndex's scan-or-walk cost model (0: always walk, 1e9: always scan; default its own)")
    parser.add_argument("--ef-scales", type=floats, default=None,
                        help="after the main cases, the walk's cases again per FILTER_EF_SCALE value (a bench-only "
                             "override; the product's first): bench/filter_ef_sweep.py")
    parser.add_argument("--ef-kept", type=floats, default=[0.5], help="the kept fractions --ef-scales runs at")
    parser.add_argument("--against", metavar="REF", help="also run on an older product: a folder or a git ref")
    parser.add_argument("--product", type=Path, help=argparse.SUPPRESS)  # an arm of --against: whose retrieval/
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)  # where an arm writes its rows
    args = parser.parse_args(argv)
    if not set(args.paths) <= {"cpu", "device"}:
        parser.error(f"--paths takes cpu and/or device, not {args.paths}")
    if args.against:
        rest = [a for i, a in enumerate(argv) if a != "--against" and (i == 0 or argv[i - 1] != "--against")]
        from bench.filter_search_ab import against  # the parent process of two arms: imports no product

        return against([a for a in rest if not a.startswith("--against=")], args.against)
    if args.product is not None:  # bound now: the bench modules imported later put this tree first on the path
        from bench.namespace_alias import namespace_alias

        product = args.product.resolve()
        sys.path.insert(0, str(product))
        if not (product / "rubricsearch").exists():  # from before the namespace: alias it beside, not inside, DIR
            beside = Path(tempfile.mkdtemp(prefix="rs-namespace-"))
            atexit.register(shutil.rmtree, beside, True)
            sys.path.insert(1, str(namespace_alias(beside)))
        import rubricsearch.retrieval  # noqa: F401
    rows = run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(rows))
    report(rows, args)
    return rows


if __name__ == "__main__":
    main()
