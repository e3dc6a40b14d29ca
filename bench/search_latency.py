"""Search latency at the product's settings: query embedding, ANN, rerank, from ingested references.

The stores, models and search service are built from the product's settings as ``rubricsearch serve`` builds them
(:func:`app.state.open_state`), on random-weight checkpoints of the chosen architecture. References go in through
the product's ingestion (their packages stay cached); every search then runs the vision tower only for its new
candidate image, which arrives as raw bytes (decoded inside the search, as from the API). The cases: a rubric
without reranking, a candidate alone, rubric + candidate and 3 criteria + candidate (each reranked to ``--top-n``).

    python bench/search_latency.py                                        # CPU, `small` architecture
    python bench/search_latency.py --size 2b --kind square --side 448 --baselines        # a GPU, the 2B
    python bench/search_latency.py --size 2b --kind photo --references 40 --index-size 1000000

``--index-size`` pads the set's index with synthetic unit vectors so the ANN stage runs against that many
(the shortlist still comes from the real references). ``--towers distinct`` gives the embedder and the reranker
towers of their own, as two real models may. Prints medians over the repeats, the split of the query-embedding
stage (decode, resize and patches, tower, LM pass, rest; timed in searches of their own, since the timers sync the
device after each piece), and the vision-encoder runs observed for references during search (expected: 0).
``--baselines`` times the same searches through the official class path (the candidate embedded, then one
reranker forward per shortlisted pair and criterion, images decoded and resized in every call), the raw
transformers pieces (the same calls on images decoded and resized beforehand) and the FLOP limit of our own work.
``--explain occlusion,gradient_x_input`` also times the per-criterion evidence of the top hits of the API's
search of 3 criteria + candidate (what its ``explain`` runs: every map together) by each method, beside that
search's own rerank time, and counts the vision encodes the evidence made (expected: 0); ``--alone`` the same
maps one per call (unbatched), the ratio printed beside the batched time; ``--candidate-maps`` the maps of the
candidate too (``explain_candidate``: a backward through every whole pair besides the references' maps).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.baselines import GpuUtil
from bench.common import (
    add_settings_args,
    engine,
    performance_values,
    product_settings,
    scratch_dir,
    setting,
    settings_line,
)
from bench.images import image, png, stream_sync_for, sync_for
from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder

SPLIT: dict[str, float] = defaultdict(float)
SPLIT_OWNER: list[Any] = []  # the embedder's VisionEncoder: with distinct towers only its passes are the query's
# The per-piece timers' switch. Off for the timed searches: the device sync after each piece stops the host from
# preparing the next piece while the device runs this one, which adds ~3 ms to a 448 px query stage on an H100.
TIMERS_ON: list[bool] = [False]
RUBRIC = "short fur; triangular ears"
CRITERIA = ["short fur", "triangular ears", "dark forehead stripes"]
CASES: dict[str, dict[str, Any]] = {
    "rubric only, no rerank": {"rubric": RUBRIC, "rerank": False},
    "candidate only": {"candidate": True},
    "rubric + candidate": {"rubric": RUBRIC, "candidate": True},
    "3 criteria + candidate": {"criteria": CRITERIA, "candidate": True},
}


def timed(name: str, fn: Callable[..., Any], sync: Callable[[], None]) -> Callable[..., Any]:
    """Wrap a function so its wall time (device work included) adds to SPLIT[name] (for a VisionEncoder method,
    only the embedder's: the reranker's tower is not part of the query-embedding stage). A call inside another
    timed call of the same name (a subclass's method calling the one it overrides) counts once."""

    def wrapper(*a: Any, **kw: Any) -> Any:
        if not TIMERS_ON[0] or name in INSIDE.names:
            return fn(*a, **kw)
        t0 = time.perf_counter()
        INSIDE.names = INSIDE.names | {name}
        try:
            return fn(*a, **kw)
        finally:
            INSIDE.names = INSIDE.names - {name}
            sync()
            if not (SPLIT_OWNER and a and isinstance(a[0], VisionEncoder) and a[0] is not SPLIT_OWNER[0]):
                SPLIT[name] += time.perf_counter() - t0

    return wrapper


class _Inside(threading.local):
    names: frozenset[str] = frozenset()


INSIDE = _Inside()


def encoder_classes() -> list[type]:
    """Every vision-encoder class the product may run: the plain one and the accelerated plug-in's (an older tree
    beside this one, ``bench/gpu_report.py --against``, has one class that does both)."""
    try:
        from rubricsearch.retrieval.plugins.accelerated.vision import AcceleratedVisionEncoder
    except ImportError:
        return [VisionEncoder]
    return [VisionEncoder, AcceleratedVisionEncoder]


def instrument(sync: Callable[[], None]) -> None:
    """Bench-only timers around the pieces of the query path (class attributes, so every instance); installed
    before the models exist, since the tower batcher keeps bound methods."""
    import rubricsearch.retrieval.images as images
    from rubricsearch.retrieval.qwen.engine.batching import LMScheduler

    images.decode_image = timed("decode", images.decode_image, sync)  # type: ignore[assignment]
    # the decode happens inside the preprocessing (an image handle decodes when its pixels are first read), on the
    # CPU path and the GPU one alike: "preprocess" minus "decode" is the resize and the patches
    for cls in encoder_classes():  # each class's own methods (the accelerated one overrides both)
        for method, name in (("_process", "preprocess"), ("_run_tower", "tower")):
            if method in vars(cls):
                setattr(cls, method, timed(name, vars(cls)[method], sync))
    LMScheduler.run = timed("lm", LMScheduler.run, sync)  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["tiny", "small", "2b"], default=None,
                    help="random checkpoints' architecture (default: 2b on a GPU, small on the CPU)")
    ap.add_argument("--checkpoint", help="an existing reranker checkpoint for both models (default: write one)")
    ap.add_argument("--towers", choices=["shared", "distinct"], default="shared",
                    help="one checkpoint as both models, or an embedding checkpoint of its own (another tower)")
    ap.add_argument("--kind", choices=["png", "square", "photo"], default="square",
                    help="references and candidates: noise PNGs, photo-like JPEGs of --side, or 12-MP JPEG photos")
    ap.add_argument("--side", type=int, default=None, help="image side (default 448 GPU, 224 CPU)")
    ap.add_argument("--references", type=int, default=200)
    ap.add_argument("--index-size", type=int, default=0, help="pad the index to this many vectors")
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--top-n", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baselines", action="store_true",
                    help="also the official class path, the raw transformers pieces and the FLOP limit")
    ap.add_argument("--explain", default="", metavar="METHODS",
                    help="also the top hits' per-criterion evidence by these methods (comma list of occlusion, "
                         "gradient_x_input, integrated_gradients, attention) beside the API search of 3 criteria + "
                         "candidate")
    ap.add_argument("--alone", default="", metavar="METHODS",
                    help="with --explain: also time these methods one map per call (the maps unbatched)")
    ap.add_argument("--candidate-maps", default="", metavar="METHODS",
                    help="with --explain: also time these methods with the candidate's maps (explain_candidate)")
    ap.add_argument("--json", default=os.environ.get("OUT") and os.path.join(os.environ["OUT"], "search.json"))
    add_settings_args(ap)
    args = ap.parse_args()
    import torch

    from rubricsearch.app.state import foreground_runner, open_state
    from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

    root = scratch_dir("rs-search-bench-")
    probe = product_settings(args)
    gpu = setting(probe, "models.device") != "cpu" and torch.cuda.is_available()
    sync = sync_for(gpu)
    size, side = args.size or ("2b" if gpu else "small"), args.side or (448 if gpu else 224)
    dtype = "bfloat16" if gpu else "float32"
    rr = args.checkpoint or str(make_test_model(root / "reranker", "reranker", size=size, dtype=dtype))
    emb = rr if args.towers == "shared" else str(make_test_model(root / "embedding", "embedding", size=size,
                                                                 dtype=dtype, seed=1))
    # the stage timers wait for the calling thread's stream only: a device-wide sync from a decode or tower thread
    # would break the LM thread's CUDA-graph capture (thread-local capture forbids touching the capturing stream)
    instrument(stream_sync_for(gpu))
    settings = product_settings(args, data_dir=root / "data", models__embedding_model=emb, models__reranker_model=rr,
                                ingest__workers=0, models__fallback_to_test_models=False)
    state = open_state(settings, embedder=True, reranker=True)
    embedder: Any = state.embedder
    SPLIT_OWNER.append(engine(embedder).vision)
    print(settings_line(settings, device_in_use=engine(embedder).loaded.device,
                        fused_kernels_in_use=engine(embedder).loaded.fused_kernels), flush=True)

    def make(seed: int) -> bytes:
        return png(side, seed) if args.kind == "png" else image(args.kind, side, seed)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        ref_bytes = list(pool.map(make, range(1000, 1000 + args.references)))
        # one per candidate case and repeat, and as many again for the split's own searches
        needed = (sum(bool(case.get("candidate")) for case in CASES.values()) + 1 + bool(args.explain)) \
            * (args.repeats + 1) + 2
        candidates = list(pool.map(make, range(50_000, 50_000 + needed)))
    set_id = str(state.ingestion.create_set("bench").id)
    t0 = time.perf_counter()
    job = state.ingestion.create_job_from_uploads(set_id, [(f"r{i}.jpg", b) for i, b in enumerate(ref_bytes)])
    runner = foreground_runner(state)
    runner.run_until_idle()
    runner.close()
    assert state.ingestion.get_job(job.id).done == args.references
    ingest_s = time.perf_counter() - t0
    if args.index_size > args.references:
        _pad(state.index, set_id, args.index_size - args.references, state.index.dim(set_id))
    util = GpuUtil() if gpu else None
    with util if util is not None else contextlib.nullcontext():
        rows, splits, ref_encodes = run_cases(state, set_id, candidates, args, sync)
    kind = {"photo": "12 MP JPEG photos", "png": f"{side}px noise PNGs"}.get(args.kind, f"{side}px JPEGs")
    print(f"architecture={size} towers={args.towers} gpu={torch.cuda.get_device_name() if gpu else None}")
    print(f"{args.references} references ({kind}) ingested in {ingest_s:.1f}s; index holds "
          f"{state.index.count(set_id)} vectors; top_k={args.top_k}, top_n={args.top_n}")
    print(f"{'case':<26} {'query emb':>10} {'ANN':>8} {'rerank':>9} {'total':>9}   (median ms)")
    result: dict[str, Any] = {"settings": performance_values(settings),
                              "kind": args.kind, "side": side, "size": size, "cases": {},
                              "gpu_util": util.mean if util is not None else None}
    for name in CASES:
        med = {k: statistics.median(rows[f"{name}|{k}"]) for k in ("query_embedding", "ann", "rerank", "total")}
        result["cases"][name] = med
        print(f"{name:<26} {med['query_embedding']:>10.1f} {med['ann']:>8.2f} {med['rerank']:>9.1f} "
              f"{med['total']:>9.1f}")
    med = {k: statistics.median(s.get(k, 0.0) for s in splits)
           for k in ("decode", "preprocess", "tower", "lm", "query")}
    own = med["tower"] + med["lm"]
    rest = med["query"] - sum(med[k] for k in ("preprocess", "tower", "lm"))
    stage = result["cases"]["rubric + candidate"]["query_embedding"]
    result |= {"query_stage_ms": stage, "query_stage_timed_ms": med["query"], "own_ms": own,
               "query_stage_over_own": stage / max(own, 1e-9)}
    print(f"query-embedding stage of 'rubric + candidate' (median ms): {stage:.1f}; timed piece by piece in other "
          f"searches (a device sync after each piece; {med['query']:.1f} in all): decode {med['decode']:.1f} "
          f"+ resize and patches {med['preprocess'] - med['decode']:.1f} + tower {med['tower']:.1f} + LM "
          f"{med['lm']:.1f} + rest {rest:.1f}; the candidate's own vision + LM {own:.1f} -> stage / own = "
          f"{result['query_stage_over_own']:.2f}")
    print(f"vision-encoder runs for references during all searches: {ref_encodes}; mean GPU utilisation over "
          f"the searches {result['gpu_util'] if result['gpu_util'] is not None else float('nan'):.0f}%")
    if args.explain:
        result["explain"] = explain_case(state, set_id, candidates, args, sync)
    if args.baselines:
        from bench.baselines import search_baselines

        lines, result["baselines"] = search_baselines(state, set_id, ref_bytes, candidates, args.top_k, CRITERIA,
                                                      RUBRIC, result["cases"], gpu)
        print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    state.close()



def reference_encodes(provenance: Any) -> int:
    """Reference encodes a search made: the typed provenance here, a dict in an older product (an A/B arm)."""
    return int(provenance["vision"]["reference"] if isinstance(provenance, dict) else provenance.vision.reference)


def run_cases(state: Any, set_id: str, candidates: list[bytes], args: argparse.Namespace, sync: Callable[[], None],
              ) -> tuple[dict[str, list[float]], list[dict[str, float]], int]:
    """Each case once per repeat (the first a warm-up): stage timings, query-stage splits, reference encodes."""
    from rubricsearch.retrieval.images import image_handle
    from rubricsearch.retrieval.search import SearchRequest

    rows: dict[str, list[float]] = {}
    splits: list[dict[str, float]] = []
    ref_encodes = 0
    for rep in range(args.repeats + 1):
        for name, case in CASES.items():
            cand = image_handle(candidates.pop(), max_pixels=10**8) if case.get("candidate") else None
            req = SearchRequest(set_id, rubric=case.get("rubric"), criteria=list(case.get("criteria", [])),
                                candidate=cand, top_k=args.top_k, top_n=args.top_n,
                                rerank=bool(case.get("rerank", True)))
            sync()
            t0 = time.perf_counter()
            result = state.search.search(req)
            sync()
            total = (time.perf_counter() - t0) * 1000
            ref_encodes += reference_encodes(result.provenance)
            if rep == 0:
                continue
            for key, value in {**result.timings_ms, "total": total}.items():
                rows.setdefault(f"{name}|{key}", []).append(value)
    TIMERS_ON[0] = True
    try:
        for rep in range(args.repeats + 1):  # the split, in searches of its own (the first a warm-up)
            cand = image_handle(candidates.pop(), max_pixels=10**8)
            SPLIT.clear()
            result = state.search.search(SearchRequest(set_id, rubric=RUBRIC, candidate=cand, top_k=args.top_k,
                                                       top_n=args.top_n))
            ref_encodes += reference_encodes(result.provenance)
            if rep:
                splits.append({k: v * 1000 for k, v in SPLIT.items()} | {"query": result.timings_ms["query_embedding"]})
    finally:
        TIMERS_ON[0] = False
    return rows, splits, ref_encodes


def explain_case(state: Any, set_id: str, candidates: list[bytes], args: argparse.Namespace,
                 sync: Callable[[], None]) -> dict[str, float]:
    """The API's search of 3 criteria + candidate (``app.set_search.search_set``), then the per-criterion evidence
    of its top hits by each method of ``--explain`` (:func:`app.evidence.explain_hits`, what ``explain`` runs: all
    maps together) and, for the methods of ``--alone``, one map per call as the evidence route makes them; medians
    over the repeats (the first a warm-up), the maps made and the vision encodes they needed."""
    from rubricsearch.app.evidence import explain_hits, local_runtime, references_evidence
    from rubricsearch.app.schemas.evidence import EXPLAIN_MAX_HITS
    from rubricsearch.app.schemas.search import SearchBody
    from rubricsearch.app.set_search import search_set
    from rubricsearch.indexer.catalog import find_images
    from rubricsearch.retrieval.images import image_handle

    methods = args.explain.split(",")
    alone = [m for m in args.alone.split(",") if m]
    with_candidate = [m for m in args.candidate_maps.split(",") if m]
    runtime = local_runtime(state)
    assert not isinstance(runtime, str), runtime
    rows: dict[str, list[float]] = {}
    maps = encodes = 0
    for rep in range(args.repeats + 1):
        cand = image_handle(candidates.pop(), max_pixels=10**8)
        body = SearchBody(set_id=set_id, criteria=list(CRITERIA), top_k=args.top_k, top_n=args.top_n)
        sync()
        t0 = time.perf_counter()
        out = search_set(state, body, candidate=cand)
        sync()
        total = (time.perf_counter() - t0) * 1000
        with state.catalog.read() as session:
            shown = find_images(session, set_id, [h.image.sha256 for h in out.hits])
        records = [shown[h.image.sha256] for h in out.hits]
        for method in methods:
            sync()
            t0 = time.perf_counter()
            found = [e for per_hit in explain_hits(state, records, list(CRITERIA), True, cand, method)  # type: ignore[arg-type]
                     for e in per_hit]
            sync()
            if rep:
                rows.setdefault(method, []).append((time.perf_counter() - t0) * 1000)
                maps += sum(e.available for e in found)
                encodes += sum(e.vision_encodes for e in found)
        for method in with_candidate:
            sync()
            t0 = time.perf_counter()
            explain_hits(state, records, list(CRITERIA), True, cand, method, candidate_maps=True)  # type: ignore[arg-type]
            sync()
            if rep:
                rows.setdefault(f"{method} +candidate", []).append((time.perf_counter() - t0) * 1000)
        for method in alone:
            sync()
            t0 = time.perf_counter()
            for record in records[:EXPLAIN_MAX_HITS]:
                for criterion in CRITERIA:
                    references_evidence(state, runtime, [record], [criterion], cand, method)  # type: ignore[arg-type]
            sync()
            if rep:
                rows.setdefault(f"{method} alone", []).append((time.perf_counter() - t0) * 1000)
        if rep:
            rows.setdefault("search", []).append(total)
            rows.setdefault("rerank", []).append(out.timings_ms["rerank"])
    med = {k: statistics.median(v) for k, v in rows.items()}
    per_search = maps / max(args.repeats * len(methods), 1)
    print(f"evidence of the top hits x 3 criteria ({per_search:.0f} maps) beside the API search of 3 criteria + "
          f"candidate (median ms): search {med['search']:.1f}, its rerank {med['rerank']:.1f}; vision encodes by "
          f"evidence: {encodes}")
    print(f"{'method':<22} {'batched':>10} {'/ rerank':>9} {'one by one':>11} {'/ rerank':>9} "
          f"{'one by one / batched':>21}   (median ms)")
    for m in methods:
        one = med.get(f"{m} alone")
        print(f"{m:<22} {med[m]:>10.1f} {med[m] / max(med['rerank'], 1e-9):>9.2f} "
              + (f"{one:>11.1f} {one / max(med['rerank'], 1e-9):>9.2f} {one / max(med[m], 1e-9):>21.2f}"
                 if one is not None else f"{'-':>11} {'-':>9} {'-':>21}"))
    for m in with_candidate:
        both = med[f"{m} +candidate"]
        print(f"{m + ' +candidate':<22} {both:>10.1f} {both / max(med['rerank'], 1e-9):>9.2f}   (the candidate's "
              "maps too)")
    return med | {"maps_per_search": per_search, "evidence_vision_encodes": encodes}


def _pad(index: Any, set_id: str, n: int, dim: int) -> None:
    """Synthetic references: random unit vectors (ids that are never shortlisted by the real queries)."""
    import hashlib

    import torch

    gen = torch.Generator().manual_seed(7)
    for start in range(0, n, 100_000):
        m = min(100_000, n - start)
        vecs = torch.nn.functional.normalize(torch.randn(m, dim, generator=gen), dim=1).numpy()
        index.upsert(set_id, [hashlib.sha256(f"pad{start + i}".encode()).hexdigest() for i in range(m)], vecs)


if __name__ == "__main__":
    main()
