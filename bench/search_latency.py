"""Search latency split: query embedding, ANN, rerank (with and without criteria), from cached references.

    python bench/search_latency.py                                   # CPU, `small` random-weight config
    python3 bench/search_latency.py --device cuda --size 2b --side 448 --index-size 1000000
    python3 bench/search_latency.py --device cuda --size 2b --photo --references 40
    python3 bench/search_latency.py --device cuda --size 2b --towers distinct

References are embedded once (their packages stay cached, as after ingestion); every search then runs the
vision tower only for the new candidate image, which arrives as raw bytes (decoded inside the search, as
from the API). ``--index-size`` pads the set's index with synthetic unit vectors so the ANN stage runs
against that many references (the shortlist still comes from the real ones, whose embeddings are far
closer to the queries). ``--photo`` uses 12-megapixel JPEG-like photos (4:3, longest side 4032) at the
official max_pixels for references and candidates. Prints medians over the repeats, the split of the
query-embedding stage (decode, preprocess, tower, LM pass, rest) and the vision-encoder runs observed for
references during search (expected: 0). ``--towers shared`` (the default) runs one checkpoint as both models,
one tower; ``distinct`` loads an embedding and a reranker checkpoint whose towers differ, as two real models
may, so a candidate is encoded under each.
CUDA graphs and fused kernels follow the product's defaults (on with a GPU, fused kernels where liger-kernel is
installed; ``--no-cuda-graphs``, ``--no-fused`` for the transformers passes).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import reverts
from bench.images import jpeg
from rerank.local import LocalReranker
from rerank.rubric import RubricReranker
from retrieval.embedding.local import LocalEmbedder
from retrieval.images import ReferenceImage, decode_image, image_handle
from retrieval.index.device_search import choose
from retrieval.index.factory import make_index
from retrieval.packages import EphemeralPackages, PackageStore, VisualPackages
from retrieval.qwen.batching import LMScheduler
from retrieval.qwen.checkpoint import make_test_model
from retrieval.qwen.fused_kernels import FusedSetting
from retrieval.qwen.gpu_preprocess import GpuPreprocessor
from retrieval.qwen.loading import load_qwen
from retrieval.qwen.vision import VisionEncoder
from retrieval.search import SearchRequest, SearchService

SPLIT: dict[str, float] = defaultdict(float)


def png(side: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def photo(seed: int, long_side: int = 4032) -> bytes:
    """A 12-megapixel 4:3 (or 3:4) photo-like JPEG."""
    w, h = (long_side, long_side * 3 // 4) if seed % 2 else (long_side * 3 // 4, long_side)
    return jpeg(w, h, seed)


SPLIT_OWNER: list[Any] = []  # the embedder's VisionEncoder: with distinct towers only its passes are the query's


def timed(name: str, fn: Callable[..., Any], sync: Callable[[], None]) -> Callable[..., Any]:
    """Wrap a function so its wall time (device work included) adds to SPLIT[name] (for a VisionEncoder method,
    only the embedder's: the reranker's tower is not part of the query-embedding stage)."""

    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            sync()
            if not (SPLIT_OWNER and a and isinstance(a[0], VisionEncoder) and a[0] is not SPLIT_OWNER[0]):
                SPLIT[name] += time.perf_counter() - t0

    return wrapper


def instrument(sync: Callable[[], None]) -> None:
    """Bench-only timers around the pieces of the query path (class attributes, so every instance)."""
    import retrieval.images as images

    images.decode_image = timed("decode", images.decode_image, sync)  # type: ignore[assignment]
    VisionEncoder._resize = timed("resize", VisionEncoder._resize, sync)  # type: ignore[method-assign]
    VisionEncoder._run_processor = timed("processor", VisionEncoder._run_processor, sync)  # type: ignore[method-assign]
    VisionEncoder._run_tower = timed("tower", VisionEncoder._run_tower, sync)  # type: ignore[method-assign]
    GpuPreprocessor.process = timed("device", GpuPreprocessor.process, sync)  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", choices=["tiny", "small", "2b"], default="small")
    ap.add_argument("--references", type=int, default=200)
    ap.add_argument("--side", type=int, default=224)
    ap.add_argument("--photo", action="store_true", help="12-megapixel JPEG photos at the official max_pixels")
    ap.add_argument("--index-size", type=int, default=0, help="pad the index to this many vectors")
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--top-n", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--checkpoint", help="an existing checkpoint dir (default: write a random one)")
    ap.add_argument("--embedding-checkpoint", help="with --towers distinct: the embedder's (default: write one)")
    ap.add_argument("--preprocess", choices=["official", "gpu-nvjpeg"], default="official")
    ap.add_argument("--compile", action="store_true", help="torch.compile the tower's and the LM's blocks")
    ap.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                    help="Liger fused kernels (RUBRICSEARCH_FUSED_KERNELS; default: auto, as in the product)")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="RUBRICSEARCH_CUDA_GRAPHS (default: on with a GPU, as in the product)")
    ap.add_argument("--towers", choices=["shared", "distinct"], default="shared",
                    help="one checkpoint as both models, or an embedding and a reranker checkpoint, each its tower")
    ap.add_argument("--revert", default="", metavar="LIST", help=reverts.describe())
    ap.add_argument("--jpeg", action="store_true",
                    help="photo-like JPEG references and candidates (as users upload) instead of noise PNGs")
    ap.add_argument("--padded", action="store_true",
                    help="the reranker's padded shared-prefix pass instead of the packed one (side by side)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timings: GPU busy share, top ops and kernels of one rubric + candidate search, "
                         "and py-spy stacks (all threads) over more of them")
    args = ap.parse_args()

    import torch

    gpu = args.device.startswith("cuda")
    args.cuda_graphs = gpu if args.cuda_graphs is None else args.cuda_graphs
    reverts.revert(args.revert)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    instrument(sync)  # before the models exist: the tower batcher keeps a bound method
    root = Path(tempfile.mkdtemp(prefix="rs-search-bench-"))
    dtype = "bfloat16" if gpu else "float32"
    ckpt = args.checkpoint or make_test_model(root / "model", "reranker", size=args.size, dtype=dtype)
    fused: FusedSetting = "auto" if args.fused is None else args.fused
    loaded = load_qwen(ckpt, device=args.device, lm_rows=("yes", "no"), fused_kernels=fused)
    args.fused = loaded.fused_kernels
    store = PackageStore(root / "packages", storage_dtype=dtype, memory_bytes=16 << 30)  # type: ignore[arg-type]
    packages = VisualPackages(store, EphemeralPackages(1 << 30, device=store.memory_device))
    emb_loaded = loaded
    if args.towers == "distinct":  # the embedder's own checkpoint (another seed: another tower)
        emb_ckpt = args.embedding_checkpoint or make_test_model(root / "embedding", "embedding", size=args.size,
                                                                dtype=dtype, seed=1)
        emb_loaded = load_qwen(emb_ckpt, device=args.device, fused_kernels=fused)
    if args.compile:
        from retrieval.qwen.loading import compile_blocks

        for one in {id(m): m for m in (loaded, emb_loaded)}.values():
            compile_blocks(one)
    embedder = LocalEmbedder(emb_loaded, packages=packages, preprocess=args.preprocess,
                             cuda_graphs=args.cuda_graphs)
    reranker = LocalReranker(loaded, packages=packages, preprocess=args.preprocess,
                             vision=embedder.vision if args.towers == "shared" else None,
                             cuda_graphs=args.cuda_graphs, packed=not args.padded)
    SPLIT_OWNER.append(embedder.vision)
    index = make_index("faiss", path=root / "faiss", autoflush=False, device_search=choose("auto"))
    dim = min(512, loaded.hidden_size)
    index.create_set("bench", dim)
    make = ((lambda seed: photo(seed)) if args.photo else
            (lambda seed: jpeg(args.side, args.side, seed)) if args.jpeg else (lambda seed: png(args.side, seed)))
    blobs: dict[str, bytes] = {}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        ref_bytes = list(pool.map(make, range(1000, 1000 + args.references)))
        extra = 40 if args.profile else 0
        candidates = list(pool.map(make, range(50_000, 50_000 + 3 * (args.repeats + 1) + extra)))
    print(f"{len(ref_bytes)} references and {len(candidates)} candidates generated", flush=True)
    t0 = time.perf_counter()
    for start in range(0, args.references, 16):
        batch = [decode_image(b, max_pixels=10**8) for b in ref_bytes[start:start + 16]]
        packages.build(batch)  # as ingestion does
        blobs.update((img.sha256, img.data) for img in batch)
        vectors = embedder.embed_contents([_content(img) for img in batch], [None] * len(batch), dimensions=dim)
        index.upsert("bench", [img.sha256 for img in batch], vectors)
    ingest_s = time.perf_counter() - t0
    print(f"references embedded in {time.perf_counter() - t0:.1f}s", flush=True)
    if args.index_size > args.references:
        t0 = time.perf_counter()
        _pad(index, args.index_size - args.references, dim)
        print(f"index padded to {index.count('bench')} vectors in {time.perf_counter() - t0:.1f}s", flush=True)
    service = SearchService(embedder, RubricReranker(reranker), index,
                            lambda sha: ReferenceImage(sha, lambda: blobs[sha], max_pixels=10**8))
    lm_run = LMScheduler.run
    LMScheduler.run = timed("lm", lm_run, sync)  # type: ignore[method-assign]

    rows: dict[str, list[float]] = {}
    splits: list[dict[str, float]] = []
    ref_encodes = 0
    cases = {
        "rubric only, no rerank": dict(rubric="short fur; triangular ears", rerank=False),
        "rubric + candidate": dict(rubric="short fur; triangular ears", candidate=True),
        "3 criteria + candidate": dict(criteria=["short fur", "triangular ears", "dark forehead stripes"],
                                       candidate=True),
    }
    for rep in range(args.repeats + 1):
        for name, case in cases.items():
            fresh = candidates.pop() if case.get("candidate") else None
            cand = image_handle(fresh, max_pixels=10**8) if fresh is not None else None
            req = SearchRequest("bench", rubric=case.get("rubric"), criteria=list(case.get("criteria", [])),
                                candidate=cand, top_k=args.top_k, top_n=args.top_n,
                                rerank=bool(case.get("rerank", True)))
            SPLIT.clear()
            sync()
            t0 = time.perf_counter()
            result = service.search(req)
            sync()
            total = (time.perf_counter() - t0) * 1000
            ref_encodes += result.provenance["vision"]["reference"]
            if rep == 0:
                continue  # warm-up
            for key, value in {**result.timings_ms, "total": total}.items():
                rows.setdefault(f"{name}|{key}", []).append(value)
            if name == "rubric + candidate":
                splits.append({k: v * 1000 for k, v in SPLIT.items()} | {"query": result.timings_ms["query_embedding"]})

    kind = "12 MP photos" if args.photo else f"{args.side}px {'JPEG' if args.jpeg else 'noise PNG'}"
    print(f"\npreprocess={args.preprocess} compile={args.compile} fused={args.fused} cuda_graphs={args.cuda_graphs} "
          f"shortlist pass={'padded' if args.padded else 'packed'} towers={args.towers} "
          f"revert={args.revert or 'none'}")
    print(f"{args.references} references ({kind}) embedded in {ingest_s:.1f}s, index holds "
          f"{index.count('bench')} vectors (device search: {choose('auto') or 'no'}); size={args.size}, "
          f"device={args.device}; top_k={args.top_k}, top_n={args.top_n}")
    print(f"{'case':<26} {'query emb':>10} {'ANN':>8} {'rerank':>9} {'total':>9}   (median ms)")
    for name in cases:
        med = {k: statistics.median(rows[f"{name}|{k}"]) for k in ("query_embedding", "ann", "rerank", "total")}
        print(f"{name:<26} {med['query_embedding']:>10.1f} {med['ann']:>8.2f} {med['rerank']:>9.1f} "
              f"{med['total']:>9.1f}")
    med = {k: statistics.median(s.get(k, 0.0) for s in splits)
           for k in ("decode", "resize", "processor", "device", "tower", "query")}
    lm = statistics.median(s.get("lm", 0.0) for s in splits)
    own = med["tower"] + lm
    rest = med["query"] - sum(med[k] for k in ("resize", "processor", "device", "tower")) - lm
    # the decode runs inside the CPU path's resize, or inside the device path's preprocessing
    print(f"query-embedding stage of 'rubric + candidate' (median ms): total {med['query']:.1f} = decode "
          f"{med['decode']:.1f} + resize {max(med['resize'] - med['decode'], 0):.1f} + processor "
          f"{med['processor']:.1f} + device preprocessing {max(med['device'] - med['decode'], 0):.1f} + tower "
          f"{med['tower']:.1f} + LM {lm:.1f} + rest {rest:.1f}; the candidate's own vision + LM {own:.1f} "
          f"-> stage / own = {med['query'] / max(own, 1e-9):.2f}")
    print(f"vision-encoder runs for references during all searches: {ref_encodes}")
    for name, stats in (("embedder", embedder.stats), ("reranker", reranker.stats), ("tower", embedder.vision.stats())):
        print(f"{name} CUDA graphs and packed passes: "
              f"{ {k: v for k, v in stats.items() if 'graph' in k or 'packed' in k} }")
    if args.profile:
        LMScheduler.run = lm_run  # type: ignore[method-assign]
        _profile(service, candidates, args)


def _profile(service: SearchService, candidates: list[bytes], args: argparse.Namespace) -> None:
    """Where one warm rubric + candidate search spends its time: torch.profiler for one (the GPU's kernels, so
    busy share = kernel time / wall, and this thread's ops; the scheduler workers' ops are not recorded), then
    py-spy stacks of all threads over many."""
    import os

    from bench.pass_profile import report
    from bench.stack_profile import record, summarise

    def one() -> None:
        cand = image_handle(candidates.pop(), max_pixels=10**8)
        service.search(SearchRequest("bench", rubric="short fur; triangular ears", candidate=cand,
                                     top_k=args.top_k, top_n=args.top_n))

    report("one search, rubric + candidate", one, top=14)
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp()) / "search_pyspy.txt"
    proc = record(os.getpid(), 6, out, idle=False)
    if proc is None:
        print("py-spy not available: no stack profile")
        return
    time.sleep(0.5)
    t0, n = time.perf_counter(), 0
    while candidates and time.perf_counter() - t0 < 5:
        one()
        n += 1
    proc.wait()
    print(f"\npy-spy over {n} searches (all threads, busy samples only):")
    print("\n".join(summarise(out, top=24)))


def _content(img: Any) -> Any:
    from retrieval.qwen.prompts import Content

    return Content(images=[img])


def _pad(index: Any, n: int, dim: int) -> None:
    """Synthetic references: random unit vectors (ids that are never shortlisted by the real queries)."""
    import hashlib

    import torch

    gen = torch.Generator().manual_seed(7)
    for start in range(0, n, 100_000):
        m = min(100_000, n - start)
        vecs = torch.nn.functional.normalize(torch.randn(m, dim, generator=gen), dim=1).numpy()
        ids = [hashlib.sha256(f"pad{start + i}".encode()).hexdigest() for i in range(m)]
        index.upsert("bench", ids, vecs)


if __name__ == "__main__":
    main()
