"""Search latency split: query embedding, ANN, rerank (with and without criteria), from cached references.

    python bench/search_latency.py                    # CPU, `small` random-weight config
    python bench/search_latency.py --device cuda --size 2b

References are embedded once (their packages stay cached, as after ingestion); every search then runs the
vision tower only for the new candidate image. Prints medians over the repeats and the vision-encoder
runs observed for references during search (expected: 0).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rerank.local import LocalReranker
from rerank.rubric import RubricReranker
from retrieval.embedding.local import LocalEmbedder
from retrieval.images import ReferenceImage, decode_image
from retrieval.index.factory import make_index
from retrieval.packages import PackageStore, VisualPackages
from retrieval.qwen.checkpoint import make_test_model
from retrieval.qwen.loading import load_qwen
from retrieval.search import SearchRequest, SearchService


def png(side: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", choices=["tiny", "small", "2b"], default="small")
    ap.add_argument("--references", type=int, default=200)
    ap.add_argument("--side", type=int, default=224)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--top-n", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="rs-search-bench-"))
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    ckpt = make_test_model(root / "model", "reranker", size=args.size, dtype=dtype)
    loaded = load_qwen(ckpt, device=args.device, lm_rows=("yes", "no"))
    packages = VisualPackages(PackageStore(root / "packages", storage_dtype=dtype))  # type: ignore[arg-type]
    embedder = LocalEmbedder(loaded, packages=packages)
    reranker = LocalReranker(loaded, packages=packages, vision=embedder.vision)  # one model, one tower
    index = make_index("faiss", path=root / "faiss", autoflush=False)
    dim = min(512, loaded.hidden_size)
    index.create_set("bench", dim)
    blobs: dict[str, bytes] = {}
    t0 = time.perf_counter()
    for start in range(0, args.references, 16):
        batch = [png(args.side, 1000 + i) for i in range(start, min(args.references, start + 16))]
        shas = [decode_image(b).sha256 for b in batch]
        blobs.update(zip(shas, batch, strict=True))
        index.upsert("bench", shas, embedder.embed([{"image": b} for b in batch], dimensions=dim))
    ingest_s = time.perf_counter() - t0
    service = SearchService(embedder, RubricReranker(reranker), index,
                            lambda sha: ReferenceImage(sha, lambda: blobs[sha]))

    rows: dict[str, list[float]] = {}
    ref_encodes = 0
    cases = {
        "rubric only, no rerank": dict(rubric="short fur; triangular ears", rerank=False),
        "rubric + candidate": dict(rubric="short fur; triangular ears", candidate=True),
        "3 criteria + candidate": dict(criteria=["short fur", "triangular ears", "dark forehead stripes"],
                                       candidate=True),
    }
    for rep in range(args.repeats + 1):
        for name, case in cases.items():
            cand = decode_image(png(args.side, 50_000 + rep)) if case.get("candidate") else None
            req = SearchRequest("bench", rubric=case.get("rubric"), criteria=list(case.get("criteria", [])),
                                candidate=cand, top_k=args.top_k, top_n=args.top_n,
                                rerank=bool(case.get("rerank", True)))
            t0 = time.perf_counter()
            result = service.search(req)
            total = (time.perf_counter() - t0) * 1000
            ref_encodes += result.provenance["vision"]["reference"]
            if rep == 0:
                continue  # warm-up
            for key, value in {**result.timings_ms, "total": total}.items():
                rows.setdefault(f"{name}|{key}", []).append(value)

    print(f"\n{args.references} references embedded in {ingest_s:.1f}s ({args.references / ingest_s:.1f} images/s, "
          f"size={args.size}, device={args.device}); top_k={args.top_k}, top_n={args.top_n}")
    print(f"{'case':<26} {'query emb':>10} {'ANN':>8} {'rerank':>9} {'total':>9}   (median ms)")
    for name in cases:
        med = {k: statistics.median(rows[f"{name}|{k}"]) for k in ("query_embedding", "ann", "rerank", "total")}
        print(f"{name:<26} {med['query_embedding']:>10.1f} {med['ann']:>8.2f} {med['rerank']:>9.1f} "
              f"{med['total']:>9.1f}")
    print(f"vision-encoder runs for references during all searches: {ref_encodes}")


if __name__ == "__main__":
    main()
