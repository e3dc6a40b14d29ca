"""ANN vs exact for the embedded FAISS index: build time, time per query and recall@k.

Runs the real :class:`~retrieval.index.faiss_index.FaissIndex` twice per size: once kept exact
(``IndexFlatIP``) and once pushed past ``ann_threshold`` so it serves from HNSW. Queries are sent
one at a time, as the search service does. Data is synthetic and L2-normalised:

* ``clustered``: a Gaussian mixture on the sphere (about 500 points per cluster);
* ``lowrank``: a 32-dimensional latent mapped into ``dim`` plus a little noise; real embeddings
  have a low intrinsic dimension like this;
* ``uniform``: isotropic noise, the worst case for any graph index (every neighbour is nearly
  as far as every other), far from what an embedding model produces.

    .venv/bin/python bench/ann_recall.py                      # 10k and 100k, dim 256
    .venv/bin/python bench/ann_recall.py --sizes 1m --data clustered --ef 128
    .venv/bin/python bench/ann_recall.py --sizes 1m --dim 2048 --data lowrank --lean   # the CPU target, 24 GB box
    python3 bench/ann_recall.py --device-search torch --sizes 1m --dim 2048 --data lowrank   # on a GPU box

``--device-search`` measures the accelerator path instead of HNSW: the same AcceleratedFaissIndex with its set
mirrored on the device (half-precision pass + exact float32 re-score), p50/p99 per query and recall@k
against exact float32 search computed on the device.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_settings_args, product_settings, settings_line
from rubricsearch.retrieval.index.faiss_accel import AcceleratedFaissIndex

SIZES = {"10k": 10_000, "100k": 100_000, "1m": 1_000_000}


def normalise(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def make_data(kind: str, n: int, q: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Return ``n`` base vectors and ``q`` held-out queries from the same distribution."""
    rng = np.random.default_rng(seed)
    total = n + q
    if kind == "uniform":
        out = np.empty((total, dim), np.float32)
        for s in range(0, total, 100_000):
            out[s : s + 100_000] = normalise(rng.standard_normal((min(100_000, total - s), dim)))
        return out[:n], out[n:]
    out = np.empty((total, dim), np.float32)
    if kind == "lowrank":
        basis = rng.standard_normal((32, dim)).astype(np.float32) / np.sqrt(32)
        for s in range(0, total, 100_000):
            m = min(100_000, total - s)
            latent = rng.standard_normal((m, 32)).astype(np.float32)
            noise = rng.standard_normal((m, dim)).astype(np.float32) / np.sqrt(dim)
            out[s : s + m] = normalise(latent @ basis + 0.3 * noise)
        return out[:n], out[n:]
    if kind != "clustered":
        raise SystemExit(f"unknown --data {kind!r}")
    centres = normalise(rng.standard_normal((max(64, n // 500), dim)))
    for s in range(0, total, 100_000):
        m = min(100_000, total - s)
        noise = rng.standard_normal((m, dim)).astype(np.float32) / np.sqrt(dim)
        out[s : s + m] = normalise(centres[rng.integers(0, len(centres), m)] + 0.9 * noise)
    return out[:n], out[n:]


def build(
    path: Path, ids: list[str], base: np.ndarray, threshold: int, args: argparse.Namespace
) -> tuple[AcceleratedFaissIndex, float]:
    idx = AcceleratedFaissIndex(
        path,
        ann_threshold=threshold,
        hnsw_m=args.m,
        ef_construction=args.ef_construction,
        autoflush=False,
        search_threads=args.threads or None,
    )
    idx.create_set("bench", base.shape[1])
    t0 = time.perf_counter()
    for s in range(0, len(ids), 50_000):  # ingestion-sized batches
        idx.upsert("bench", ids[s : s + 50_000], base[s : s + 50_000])
    return idx, time.perf_counter() - t0


def run_queries(idx: AcceleratedFaissIndex, queries: np.ndarray, k: int) -> tuple[list[set[str]], float, float, float]:
    """Hits per query, and the mean, p50 and p99 seconds of one query."""
    idx.search("bench", queries[0], k)  # warm-up
    hits, times = [], []
    for q in queries:
        t0 = time.perf_counter()
        hits.append({h.id for h in idx.search("bench", q, k)[0]})
        times.append(time.perf_counter() - t0)
    return hits, float(np.mean(times)), float(np.percentile(times, 50)), float(np.percentile(times, 99))


def numpy_truth(ids: list[str], base: np.ndarray, queries: np.ndarray, k: int) -> list[set[str]]:
    """Exact top-k by inner product, computed in row blocks straight from ``base`` (no second copy)."""
    best_s = np.full((len(queries), k), -np.inf, np.float32)
    best_i = np.zeros((len(queries), k), np.int64)
    for s in range(0, len(base), 100_000):
        scores = queries @ base[s : s + 100_000].T
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        cand_s = np.concatenate([best_s, np.take_along_axis(scores, top, 1)], axis=1)
        cand_i = np.concatenate([best_i, top + s], axis=1)
        keep = np.argsort(-cand_s, axis=1)[:, :k]
        best_s, best_i = np.take_along_axis(cand_s, keep, 1), np.take_along_axis(cand_i, keep, 1)
    return [{ids[i] for i in row} for row in best_i]


def device_data(kind: str, n: int, q: int, dim: int, seed: int, device: str) -> tuple[np.ndarray, np.ndarray]:
    """:func:`make_data`'s distributions drawn with torch on the device (1M x 2048 in seconds, not minutes)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    total = n + q
    if kind == "uniform":
        x = torch.randn(total, dim, generator=gen, device=device)
    elif kind == "lowrank":
        basis = torch.randn(32, dim, generator=gen, device=device) / 32**0.5
        x = torch.randn(total, 32, generator=gen, device=device) @ basis
        x += 0.3 * torch.randn(total, dim, generator=gen, device=device) / dim**0.5
    else:
        centres = torch.nn.functional.normalize(torch.randn(max(64, n // 500), dim, generator=gen, device=device))
        pick = torch.randint(0, centres.shape[0], (total,), generator=gen, device=device)
        x = centres[pick] + 0.9 * torch.randn(total, dim, generator=gen, device=device) / dim**0.5
    x = torch.nn.functional.normalize(x, dim=1).cpu().numpy().astype(np.float32)
    return x[:n], x[n:]


def device_rows(args: argparse.Namespace) -> None:
    """The accelerator path: p50/p99 latency per single query and recall@k against exact float32, for each
    ``--precision`` side by side on the same data and queries."""
    import torch

    print(f"{'size':>5} {'data':>9} {'dim':>5} {'load s':>7} {'mirror s':>8} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'recall@' + str(args.k):>9}  device")
    for size_name in args.sizes.split(","):
        n = SIZES[size_name.strip().lower()]
        ids = [hashlib.sha256(i.to_bytes(8, "little")).hexdigest() for i in range(n)]
        for kind in args.data.split(","):
            base, queries = device_data(kind.strip(), n, args.queries, args.dim, args.seed, args.search_device)
            full = torch.from_numpy(base).to(args.search_device)
            truth = []
            for q in queries:  # exact float32 on the device
                top = torch.topk(full @ torch.from_numpy(q).to(args.search_device), args.k).indices.tolist()
                truth.append({ids[i] for i in top})
            del full
            for precision in args.precision.split(","):
                load_s, mirror_s, times, found = device_run(args, precision.strip(), ids, base, queries)
                recall = np.mean([len(f & t) / args.k for f, t in zip(found, truth, strict=True)])
                p50, p99 = np.percentile(times, 50) * 1e3, np.percentile(times, 99) * 1e3
                print(f"{size_name:>5} {kind:>9} {args.dim:>5} {load_s:>7.1f} {mirror_s:>8.2f} {p50:>7.3f} "
                      f"{p99:>7.3f} {recall:>9.3f}  {args.device_search} {precision} on {args.search_device}",
                      flush=True)


def device_run(args: argparse.Namespace, precision: str, ids: list[str], base: np.ndarray,
               queries: np.ndarray) -> tuple[float, float, list[float], list[set[str]]]:
    """Load the set, build its device copy, then time single-query searches."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        idx = AcceleratedFaissIndex(Path(tmp), ann_threshold=len(ids) + 1, autoflush=False,
                                    device_search=args.device_search, search_device=args.search_device,
                                    device_precision=precision, device_max_bytes=1 << 40)
        idx.create_set("bench", args.dim)
        t0 = time.perf_counter()
        for s in range(0, len(ids), 100_000):
            idx.upsert("bench", ids[s : s + 100_000], base[s : s + 100_000])
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        idx.search("bench", queries[0], args.k)  # builds the mirror
        mirror_s = time.perf_counter() - t0
        times, found = [], []
        for q in queries:
            if args.search_device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            hits = idx.search("bench", q, args.k)[0]
            times.append(time.perf_counter() - t0)
            found.append({h.id for h in hits})
        idx.drop_set("bench")
        idx.close()
    return load_s, mirror_s, times, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10k,100k", help="comma list of 10k,100k,1m (1m is heavy)")
    parser.add_argument("--data", default="clustered,lowrank,uniform", help="comma list of data kinds")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--m", type=int, default=32, help="HNSW links per node")
    parser.add_argument("--ef-construction", type=int, default=80)
    parser.add_argument("--ef", default="64,128,256", help="comma list of efSearch values to sweep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads per search; 0 = faiss default")
    parser.add_argument("--lean", action="store_true",
                        help="for 1M x 2048 on a 24 GB box: exact truth from numpy instead of a second index, and no "
                             "save (exact and save columns print nan)")
    parser.add_argument("--device-search", choices=["torch", "faiss-gpu"], default=None,
                        help="measure the accelerator path (exact on the device) instead of HNSW")
    parser.add_argument("--search-device", default="cuda")
    parser.add_argument("--precision", default="auto",
                        help="comma list of device copy formats to measure side by side: auto,float16,float8")
    add_settings_args(parser)
    args = parser.parse_args()
    # the index's own knobs are this bench's sweep (the flags above); the product's vector settings are printed
    # beside them for reference
    print(settings_line(product_settings(args)), flush=True)
    if args.device_search:
        device_rows(args)
        return
    efs = [int(e) for e in args.ef.split(",")]

    rows = []
    for size_name in args.sizes.split(","):
        n = SIZES[size_name.strip().lower()]
        ids = [hashlib.sha256(i.to_bytes(8, "little")).hexdigest() for i in range(n)]
        for kind in args.data.split(","):
            base, queries = make_data(kind.strip(), n, args.queries, args.dim, args.seed)
            with tempfile.TemporaryDirectory() as tmp:
                if args.lean:  # 1M x 2048 is 8 GB: a second index and the saved copy would not fit in 24 GB
                    truth, exact_build, exact_t = numpy_truth(ids, base, queries, args.k), float("nan"), float("nan")
                else:
                    exact_idx, exact_build = build(Path(tmp) / "exact", ids, base, n + 1, args)
                    truth, exact_t, _, _ = run_queries(exact_idx, queries, args.k)
                    exact_idx.close()
                    del exact_idx
                ann_idx, ann_build = build(Path(tmp) / "ann", ids, base, 1, args)
                assert ann_idx.is_ann("bench")
                t0 = time.perf_counter()
                if not args.lean:
                    ann_idx.flush()
                save_s = time.perf_counter() - t0 if not args.lean else float("nan")
                for ef in efs:
                    ann_idx.ef_search = ef
                    found, ann_t, p50, p99 = run_queries(ann_idx, queries, args.k)
                    recall = np.mean([len(f & t) / args.k for f, t in zip(found, truth, strict=True)])
                    rows.append((size_name, kind, ef, exact_build, ann_build, save_s, exact_t, ann_t, p50, p99,
                                 recall))
                    print_row(rows[-1], header=len(rows) == 1, k=args.k)
                if args.lean:
                    ann_idx.drop_set("bench")  # nothing to save: the run only measures
                ann_idx.close()
    threads = args.threads or "faiss default"
    print(
        f"\ndim={args.dim} M={args.m} efConstruction={args.ef_construction} queries={args.queries} "
        f"(one at a time, search threads: {threads})"
    )


def print_row(row: tuple, *, header: bool, k: int) -> None:
    if header:
        print(
            f"{'size':>5} {'data':>9} {'ef':>4} {'exact build s':>13} {'ann build s':>11} "
            f"{'save s':>7} {'exact ms/q':>10} {'ann ms/q':>9} {'ann p50':>8} {'ann p99':>8} {'ann/exact time':>14} "
            f"{'recall@' + str(k):>9}"
        )
    size, kind, ef, eb, ab, save, et, at, p50, p99, rec = row
    print(
        f"{size:>5} {kind:>9} {ef:>4} {eb:>13.2f} {ab:>11.2f} {save:>7.2f} {et * 1e3:>10.3f} "
        f"{at * 1e3:>9.3f} {p50 * 1e3:>8.3f} {p99 * 1e3:>8.3f} {at / et:>14.3f} {rec:>9.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
