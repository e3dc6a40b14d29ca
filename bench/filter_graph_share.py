"""How much of a filter graph a filter must keep to walk it: the graph walk against a scan of the filter's rows.

A filter whose rows lie inside a built graph (``retrieval.index.faiss_accel.filter_graphs``) can walk that graph with a
selector for its own rows, or scan its own rows exactly (``retrieval.index.faiss_accel.filtered_scan``). The walk costs
about the same whatever share of the graph the filter keeps (its beam widened below 25 %); the scan grows with
the filter's rows. This bench builds one graph as the product does (8-bit codes, the product's HNSW M and
efConstruction) over ``--rows`` rows, then for each share keeps a random subset of them and prints, per query
(one at a time, one thread), the median ms of the walk (candidates and their exact re-score, as a search does)
and of the scan, and the walk's recall@10 against the scan (exact). ``CONTAINED`` is set where they meet.

    .venv/bin/python bench/filter_graph_share.py --rows 12500 --dim 2048
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    import faiss

    from bench.ann_recall import make_data
    from rubricsearch.retrieval.index.faiss_accel.device_search import oversampled, rescore
    from rubricsearch.retrieval.index.faiss_accel.filter_graphs import FilterGraphs
    from rubricsearch.retrieval.index.faiss_accel.filtered_scan import RowScan
    from rubricsearch.retrieval.index.faiss_accel.payload_index import SlotMask, pack
    from rubricsearch.retrieval.index.faiss_accel.plans import AccelState
    from rubricsearch.retrieval.index.faiss_index import FaissIndex

    defaults = inspect.signature(FaissIndex.__init__).parameters
    m, ef_construction, ef_search = (defaults[name].default for name in ("hnsw_m", "ef_construction", "ef_search"))
    faiss.omp_set_num_threads(1)
    base, queries = make_data(args.data, args.rows, args.queries, args.dim, args.seed)
    flat = faiss.IndexFlatIP(args.dim)
    flat.add(base)
    graphs = FilterGraphs(1 << 62, m, ef_construction)
    t0 = time.perf_counter()
    entry = AccelState(dim=args.dim, ann=True, index=flat, live=np.ones(args.rows, dtype=bool))
    graphs._build(("bench", b""), entry, 0, SlotMask(pack(np.ones(args.rows, dtype=bool)), args.rows, args.rows))
    graph = next(iter(graphs._ready.values()))
    print(f"# graph of {args.rows} x {args.dim} ({args.data}) built in {time.perf_counter() - t0:.1f} s "
          f"(M={m}, efConstruction={ef_construction}, efSearch={ef_search}, one thread)", flush=True)
    rng = np.random.default_rng(args.seed + 1)
    out = []
    for share in args.shares:
        keep = rng.random(args.rows) < share
        bits = pack(keep)
        mask = SlotMask(bits, args.rows, int(keep.sum()))
        scan = RowScan(flat, mask.slots())
        walk_s, scan_s, hit = [], [], []
        for q in queries:
            t0 = time.perf_counter()
            cand = graph.candidates(q[None], oversampled(args.k), ef_search, mask)[0]
            cand = cand[cand >= 0]
            got, _ = rescore(cand, base[cand], q, args.k)
            walk_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _, want = scan.search(q[None], args.k)
            scan_s.append(time.perf_counter() - t0)
            hit.append(len(set(np.asarray(got).tolist()) & set(want[0].tolist())) / min(args.k, mask.kept))
        out.append({"share": share, "kept": mask.kept, "walk_ms": float(np.median(walk_s)) * 1e3,
                    "scan_ms": float(np.median(scan_s)) * 1e3, "recall": float(np.mean(hit))})
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=12_500, help="rows of the graph")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--data", default="lowrank", choices=["lowrank", "clustered", "uniform"])
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--shares", type=lambda s: [float(x) for x in s.split(",")],
                        default=[0.1, 0.2, 0.3, 0.5, 1.0], help="shares of the graph's rows the filters keep")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = measure(args)
    print(f"{'share':>6} {'kept':>8} {'walk ms':>8} {'scan ms':>8} {'walk/scan':>9} {'recall':>6}")
    for r in rows:
        print(f"{r['share']:6.0%} {r['kept']:8d} {r['walk_ms']:8.3f} {r['scan_ms']:8.3f} "
              f"{r['walk_ms'] / r['scan_ms']:9.2f} {r['recall']:6.3f}")
    from rubricsearch.retrieval.index.faiss_accel.filter_graphs import CONTAINED

    print(f"rows={args.rows} dim={args.dim} data={args.data} queries={args.queries} k={args.k} seed={args.seed}; "
          f"the product walks a containing graph from a share of {CONTAINED:.0%}")
    return rows


if __name__ == "__main__":
    main()
