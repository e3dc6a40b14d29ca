"""What a filter graph costs in resident memory against what the graph cache counts for it.

Builds ``--graphs`` graphs of ``--rows`` rows each as the product builds them
(``retrieval.index.faiss_accel.filter_graphs.build_graph``: 8-bit codes, the product's HNSW M and efConstruction) and
prints, per graph, the growth of the process' resident memory, the bytes the cache counts (``FilterGraph.nbytes``) and
their ratio: counted / resident at 1.0 or above means the ``filter_graph_bytes`` budget holds.

    .venv/bin/python bench/filter_graph_memory.py --rows 10,50,500,2000 --dim 64
"""

from __future__ import annotations

import argparse
import gc
import inspect
import multiprocessing
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(rows: int, dim: int, graphs: int, size: int) -> tuple[float, float]:
    from rubricsearch.retrieval.index.faiss_accel.filter_graphs import build_graph
    from rubricsearch.retrieval.index.faiss_accel.payload_index import pack
    from rubricsearch.retrieval.index.faiss_index import FaissIndex

    params = inspect.signature(FaissIndex.__init__).parameters
    m, efc = params["hnsw_m"].default, params["ef_construction"].default
    rng = np.random.default_rng(rows)
    vectors = rng.standard_normal((rows, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    slots = np.arange(rows, dtype=np.int64)
    keep = np.zeros(size, dtype=bool)
    keep[:rows] = True
    bits = pack(keep)
    build_graph(vectors, slots, bits, m, efc)  # warm-up: faiss' and the allocator's first-use costs
    gc.collect()
    before = resident()
    held = [build_graph(vectors, slots.copy(), bits.copy(), m, efc) for _ in range(graphs)]
    gc.collect()
    return (resident() - before) / graphs, sum(g.nbytes for g in held) / graphs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="10,50,500,2000", help="graph sizes, comma-separated")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--slots", type=int, default=250_000, help="slots of the set (the graph's mask is n/8)")
    parser.add_argument("--budget-bytes", type=int, default=64 << 20, help="graphs built per size: this many bytes")
    args = parser.parse_args()
    print(f"dim {args.dim}, set of {args.slots} slots")
    print("| graph rows | graphs | resident B/graph | counted B/graph | counted / resident |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        graphs = max(10, min(3000, args.budget_bytes // max(1, rows * (args.dim + 300))))
        # each size in a process of its own: memory freed by one size's graphs would hide the next one's growth
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            real, counted = pool.apply(measure, (rows, args.dim, graphs, args.slots))
        print(f"| {rows} | {graphs} | {real:,.0f} | {counted:,.0f} | {counted / real:.2f} |")


if __name__ == "__main__":
    main()
