"""Reuse benchmark: cached visual packages vs the official one-call-per-input paths, side by side.

A) one image under N instructions: the official embedder called N times (vision tower every call) vs
   rubricsearch (vision once, N LM passes batched), with the reuse bound N(v+l)/(v+N·l) printed next to
   the measured speed-up.
B) rerank of K image documents for an image+text query: the official reranker's one pair per forward,
   no cache, vs rubricsearch batched with the references' packages cached (query image encoded fresh, its
   package kept in the query tier as the server keeps it).

    python bench/core_reuse.py                       # the product's device: 2B architecture on a GPU, else small
    python bench/core_reuse.py --set models.device=cpu --size tiny

Our side runs the product's settings (preprocessing, fused kernels, CUDA graphs, package storage form; ``--set``
changes one); the official classes always run the CPU preprocessing and transformers' passes.

Random weights give honest timings: compute does not depend on weight values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.baselines import Official
from bench.common import add_settings_args, engine, product_settings, scratch_dir, settings_line
from bench.images import jpeg, png
from rubricsearch.app.model_loading import COMPILE_BLOCKS, CUDA_GRAPHS, FUSED_KERNELS
from rubricsearch.rerank.factory import load_reranker
from rubricsearch.retrieval.embedding.factory import load_embedder
from rubricsearch.retrieval.images import ReferenceImage, decode_image
from rubricsearch.retrieval.packages import PackageStore, VisualPackages
from rubricsearch.retrieval.packages.ephemeral import EphemeralPackages
from rubricsearch.retrieval.plugins.accelerated.model import accelerate
from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model
from rubricsearch.retrieval.qwen.model.loading import load_qwen, resolve_device
from rubricsearch.retrieval.runtime.config import LocalConfig

INSTRUCTIONS = [
    "Represent the colours of the image", "Represent the shapes of the image", "Represent the mood of the image",
    "Find animals with short fur", "Find triangular ears", "Find dark forehead stripes",
    "Represent the texture", "Represent the background",
]


def timed(fn: Callable[[], Any], repeats: int, sync: bool) -> float:
    """Median wall time in ms over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=["tiny", "small", "2b"], default=None,
                    help="random checkpoint's architecture (default: 2b on a GPU, small on the CPU)")
    ap.add_argument("--checkpoint", help="existing checkpoint dir (default: write a random one)")
    ap.add_argument("--side", type=int, default=None, help="image side in pixels (default 448 gpu, 224 cpu)")
    ap.add_argument("--ns", default="1,2,4,8")
    ap.add_argument("--ks", default=None, help="default 8,32,50 gpu; 8,32 cpu")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--only", choices=["embed", "rerank"], default=None)
    ap.add_argument("--profile", action="store_true", help="cProfile one rerank call at the largest K")
    ap.add_argument("--jpeg", action="store_true",
                    help="photo-like JPEG images instead of noise PNGs (whose CPU decoding dominates a cold call)")
    ap.add_argument("--json", default=os.environ.get("OUT") and os.path.join(os.environ["OUT"], "core_reuse.json"))
    add_settings_args(ap)
    args = ap.parse_args()
    settings = product_settings(args)
    device = resolve_device(settings.models.device)
    gpu = device.type == "cuda"
    side = args.side or (448 if gpu else 224)
    ks = [int(k) for k in (args.ks or ("8,32,50" if gpu else "8,32")).split(",")]
    ns = [int(n) for n in args.ns.split(",")]
    repeats = args.repeats or (10 if gpu else 3)
    torch.manual_seed(0)
    ckpt = args.checkpoint
    if ckpt is None:
        ckpt = str(scratch_dir("rs-bench-"))
        t0 = time.perf_counter()
        make_test_model(ckpt, "reranker", size=args.size or ("2b" if gpu else "small"),
                        dtype="bfloat16" if gpu else "float32")
        print(f"wrote random checkpoint in {time.perf_counter() - t0:.1f}s")
    loaded = load_qwen(ckpt, device=device, dtype=settings.models.dtype, lm_rows=("yes", "no"))
    # the product's kernels and compiled blocks, as its accelerated runtime sets them up (this bench shares one
    # loaded model between the embedder and the rerankers: both LMs' layers compiled)
    accelerate(loaded, LocalConfig(compile=COMPILE_BLOCKS, fused_kernels=FUSED_KERNELS))
    print(settings_line(settings, device_in_use=loaded.device, fused_kernels_in_use=loaded.fused_kernels))
    print(f"device={loaded.device} dtype={loaded.dtype} hidden={loaded.hidden_size} image={side}px")
    from rubricsearch.app.state import _storage_dtype

    store = PackageStore(storage_dtype=_storage_dtype(settings), memory_bytes=16 << 30)
    packages = VisualPackages(store, EphemeralPackages(1 << 30, device=store.memory_device))  # as the server's
    embedder = load_embedder(loaded, packages=packages, preprocess=settings.models.preprocess,
                             cuda_graphs=CUDA_GRAPHS, max_pixels=settings.models.max_pixels)
    reranker = load_reranker(loaded, packages=packages, vision=engine(embedder).vision,  # one model, one tower
                             cuda_graphs=CUDA_GRAPHS)
    reranker_plain = load_reranker(loaded, packages=packages, vision=engine(embedder).vision, share_prefix=False)
    official = Official(loaded)
    results: dict[str, Any] = {"side": side, "device": str(loaded.device),
                               "gpu_name": torch.cuda.get_device_name() if gpu else None, "embed": [], "rerank": []}

    # ---- A: one image, N instructions --------------------------------------------------------
    def image(seed: int) -> bytes:
        return jpeg(side, side, seed) if args.jpeg else png(side, seed)

    print(f"images: {side}px {'JPEG' if args.jpeg else 'noise PNG'}")
    data = image(1)
    dec = decode_image(data)
    pil = dec.image
    v = timed(lambda: engine(embedder).vision.encode([dec]), repeats, gpu)
    embedder.embed([{"image": data}])
    lm = timed(lambda: embedder.embed([{"image": data, "instruction": INSTRUCTIONS[0]}]), repeats, gpu)
    for n in ns if args.only != "rerank" else []:
        instr = INSTRUCTIONS[:n]

        def ours_cold(instr: list[str] = instr) -> None:
            packages.delete_image(dec.sha256)  # both tiers: the image is new again
            embedder.embed([{"image": data, "instruction": i} for i in instr])

        def ours_warm(instr: list[str] = instr) -> None:
            embedder.embed([{"image": data, "instruction": i} for i in instr])

        def off_calls(instr: list[str] = instr) -> None:
            for i in instr:
                official.embed([{"image": pil, "instruction": i}])

        def off_batch(instr: list[str] = instr) -> None:
            official.embed([{"image": pil, "instruction": i} for i in instr])

        t_calls, t_batch = timed(off_calls, repeats, gpu), timed(off_batch, repeats, gpu)
        t_cold, t_warm = timed(ours_cold, repeats, gpu), timed(ours_warm, repeats, gpu)
        bound = n * (v + lm) / (v + n * lm)
        row = {"n": n, "official_calls_ms": t_calls, "official_batched_ms": t_batch, "ours_cold_ms": t_cold,
               "ours_cached_ms": t_warm, "v_ms": v, "l_ms": lm, "reuse_bound": bound,
               "speedup_vs_calls": t_calls / t_cold, "fraction_of_bound": (t_calls / t_cold) / bound}
        results["embed"].append(row)

    # ---- B: rerank K documents ---------------------------------------------------------------
    q_data = image(999)
    q_dec = decode_image(q_data)
    query = {"image": q_data, "text": "short fur, triangular ears, dark forehead stripes"}
    query_pil = {"image": q_dec.image, "text": query["text"]}
    instruction = "Retrieve reference images that match the candidate by these criteria."
    for k in ks if args.only != "embed" else []:
        docs = [image(100 + j) for j in range(k)]
        # Ingested references are known by sha256 (as search passes them): no hashing, no decoding.
        doc_items = [{"image": ReferenceImage(decode_image(d).sha256, lambda d=d: d)} for d in docs]
        doc_pil = [{"image": decode_image(d).image} for d in docs]
        packages.build([decode_image(d) for d in docs])  # references were ingested earlier

        def ours(doc_items: list[dict[str, Any]] = doc_items) -> None:
            packages.delete_image(q_dec.sha256)  # the candidate image is new to the system
            reranker.score(query, doc_items, instruction)

        def ours_all_cached(doc_items: list[dict[str, Any]] = doc_items) -> None:
            reranker.score(query, doc_items, instruction)

        def ours_no_sharing(doc_items: list[dict[str, Any]] = doc_items) -> None:
            reranker_plain.score(query, doc_items, instruction)

        def off(doc_pil: list[dict[str, Any]] = doc_pil) -> None:
            official.rerank(query_pil, doc_pil, instruction)

        if args.profile and k == max(ks):
            import cProfile
            import pstats

            ours()
            worker = cProfile.Profile()  # the model's passes run on its scheduler's worker thread
            scheduler = engine(reranker).scheduler
            run_items = scheduler._run_items

            def profiled(picked: Any, worker: Any = worker, run_items: Any = run_items) -> None:
                worker.enable()
                try:
                    run_items(picked)
                    if gpu:
                        torch.cuda.synchronize()
                finally:
                    worker.disable()

            scheduler._run_items = profiled  # type: ignore[method-assign]
            if gpu:
                torch.cuda.synchronize()
            ours()  # one profiler at a time (Python 3.12): the worker's, where the passes run
            scheduler._run_items = run_items  # type: ignore[method-assign]
            print("-- model worker --")
            pstats.Stats(worker).sort_stats("tottime").print_stats(25)
        off_reps = max(1, repeats // 5) if k >= 32 else max(1, repeats // 2)
        t_off = timed(off, off_reps, gpu)
        t_ours, t_cached = timed(ours, repeats, gpu), timed(ours_all_cached, repeats, gpu)
        t_plain = timed(ours_no_sharing, repeats, gpu)
        ours_scores = reranker.score(query, doc_items, instruction)
        off_scores = official.rerank(query_pil, doc_pil, instruction)
        results["rerank"].append({"k": k, "official_ms": t_off, "ours_ms": t_ours, "ours_all_cached_ms": t_cached,
                                  "ours_no_prefix_sharing_ms": t_plain,
                                  "speedup": t_off / t_ours,
                                  "max_abs_score_diff": float(np.abs(np.array(ours_scores) - off_scores).max())})

    for model in (reranker_plain, reranker, embedder):
        model.close()  # joins their threads before the interpreter tears torch down
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.only == "rerank":
        v = lm = float("nan")
    print(f"\nvision v={v:.1f} ms, LM l={lm:.1f} ms (one image, one instruction)")
    print("N  official N calls  official batched  ours cold  ours cached  speed-up  bound  fraction")
    for r in results["embed"]:
        print(f"{r['n']:<2} {r['official_calls_ms']:>15.1f}ms {r['official_batched_ms']:>15.1f}ms "
              f"{r['ours_cold_ms']:>8.1f}ms {r['ours_cached_ms']:>10.1f}ms {r['speedup_vs_calls']:>8.2f}x "
              f"{r['reuse_bound']:>5.2f}x {r['fraction_of_bound']:>8.2f}")
    print("K   official 1 pair/pass   ours (refs cached)   ours (all cached)   no prefix sharing   speed-up   max|Δ|")
    for r in results["rerank"]:
        print(f"{r['k']:<3} {r['official_ms']:>19.1f}ms {r['ours_ms']:>18.1f}ms {r['ours_all_cached_ms']:>17.1f}ms "
              f"{r['ours_no_prefix_sharing_ms']:>17.1f}ms {r['speedup']:>9.1f}x {r['max_abs_score_diff']:>12.2e}")


if __name__ == "__main__":
    main()
