"""Reference kernels vs Liger's fused kernels (``RUBRICSEARCH_FUSED_KERNELS``) side by side in one run: time of
the tower pass, the embedder's LM pass and a reranker pass (one candidate + criteria against K cached
references, the shared-prefix path search uses), and how far fused results move (embedding cosine, |Δscore|).

    python3 bench/fused_check.py --checkpoint CKPT          # on a CUDA box with liger-kernel (the gpu extra)

One loaded model serves both roles (the 2B test checkpoint has both heads); it runs with the reference
kernels first, then is switched to the fused ones in place; packages are made once, in bf16, so both runs see
identical inputs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compile_check import timed, tower_inputs
from bench.fp8_packages import photo
from rerank.local import LocalReranker
from retrieval.embedding.local import LocalEmbedder
from retrieval.images import ReferenceImage, decode_image
from retrieval.packages import PackageStore, VisualPackages
from retrieval.qwen.checkpoint import make_test_model
from retrieval.qwen.fused_kernels import use_fused_kernels, use_reference_kernels
from retrieval.qwen.loading import load_qwen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--rerank", type=int, default=20, help="references scored per reranker pass")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ckpt = args.checkpoint or make_test_model(tempfile.mkdtemp(), "reranker", size="2b", dtype="bfloat16")
    loaded = load_qwen(ckpt, device="cuda", lm_rows=("yes", "no"))
    raw = [photo(i, 448, 448) if i % 2 else photo(i, 640, 480) for i in range(args.images)]
    images = [decode_image(b) for b in raw]
    packages = VisualPackages(PackageStore(storage_dtype="bfloat16"))
    emb = LocalEmbedder(loaded, packages=packages)
    rer = LocalReranker(loaded, packages=packages, vision=emb.vision)
    contents, pixels, grid_list, shas = tower_inputs(emb, images)
    # as search passes them: references (and the candidate, embedded a moment earlier) by sha256, packages cached
    ref = [ReferenceImage(im.sha256, partial(bytes, b)) for im, b in zip(images, raw, strict=True)]
    query = {"image": ref[0], "text": "short fur, triangular ears, dark forehead stripes"}
    docs = [{"image": r} for r in ref[1:1 + args.rerank]]
    instruction = "Retrieve reference images that match the candidate by these criteria."
    rows: dict[str, tuple[float, float, float, np.ndarray, np.ndarray]] = {}
    for name in ("reference", "fused"):
        if name == "fused":
            print(f"fused kernels: {use_fused_kernels(loaded.model)} RMSNorms switched, rotary switched")
        tower_ms, _ = timed(lambda: emb.vision._run_tower(pixels, grid_list, shas), args.repeats, "cuda")
        lm_ms, vectors = timed(lambda: emb.embed_contents(contents, [None] * len(contents)), args.repeats, "cuda")
        rr_ms, scores = timed(lambda: rer.score(query, docs, instruction), args.repeats, "cuda")
        rows[name] = (tower_ms, lm_ms, rr_ms, np.asarray(vectors), np.asarray(scores, dtype=np.float64))
        print(f"{name:9s} tower x{len(images)} {tower_ms:7.1f} ms   LM embed x{len(images)} {lm_ms:7.1f} ms   "
              f"rerank 1 x {len(docs)} {rr_ms:6.1f} ms", flush=True)
    use_reference_kernels()
    (t0, l0, r0, v0, s0), (t1, l1, r1, v1, s1) = rows["reference"], rows["fused"]
    cos = (v0 * v1).sum(1) / (np.linalg.norm(v0, axis=1) * np.linalg.norm(v1, axis=1))
    print(f"fused / reference time: tower {t1 / t0:.2f}, LM {l1 / l0:.2f}, rerank {r1 / r0:.2f}; "
          f"embedding cosine min {cos.min():.5f}; max |Δscore| {np.abs(s1 - s0).max():.4f}")


if __name__ == "__main__":
    main()
