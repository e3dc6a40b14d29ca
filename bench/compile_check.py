"""Eager vs ``torch.compile``d blocks (``RUBRICSEARCH_COMPILE_BLOCKS``) side by side in one run: time of the
embedder's tower and LM passes, and how far compiled results move (embedding cosine). The reranker's LM
layers stay eager under the setting (see ``compile_blocks``), so only its tower would change.

    python3 bench/compile_check.py --checkpoint CKPT --device cuda     # the 2B architecture on a GPU

The same loaded model runs eager first, then its blocks are compiled (dynamic shapes, as the setting does)
and warmed on the same shapes; packages are made once, in bf16, so both runs see identical inputs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fp8_packages import photo
from retrieval.embedding.local import LocalEmbedder
from retrieval.images import DecodedImage, decode_image
from retrieval.packages import PackageStore, VisualPackages
from retrieval.qwen.checkpoint import make_test_model
from retrieval.qwen.loading import compile_blocks, load_qwen
from retrieval.qwen.prompts import Content
from retrieval.qwen.vision import Grid


def timed(fn, repeats: int, device: str) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    out = fn()  # warm (and, compiled, the first compile of these shapes)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    sync()
    return (time.perf_counter() - t) / repeats * 1000, out


def tower_inputs(emb: LocalEmbedder, images: list[DecodedImage]
                 ) -> tuple[list[Content], torch.Tensor, list[Grid], list[str]]:
    """Contents, device pixels, grids and hashes of ``images``; their packages made once (bf16) so that every
    variant of a pass compared by a bench sees identical inputs."""
    contents = [Content(images=[im]) for im in images]
    pixels, grids = emb.vision.preprocess(images)
    grid_list = [(int(t), int(h), int(w)) for t, h, w in grids.tolist()]
    emb.embed_contents(contents, [None] * len(contents))
    return contents, pixels.to(emb.loaded.device), grid_list, [im.sha256 for im in images]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ckpt = args.checkpoint or make_test_model(tempfile.mkdtemp(), "embedding")
    loaded = load_qwen(ckpt, device=args.device)
    images = [decode_image(photo(i, 448, 448) if i % 2 else photo(i, 640, 480)) for i in range(args.images)]
    packages = VisualPackages(PackageStore(storage_dtype="bfloat16"))
    emb = LocalEmbedder(loaded, packages=packages)
    contents, pixels, grid_list, shas = tower_inputs(emb, images)
    rows = {}
    for name in ("eager", "compiled"):
        if name == "compiled":
            t = time.perf_counter()
            print(f"compiled {compile_blocks(loaded)} blocks (dynamic shapes) in {time.perf_counter() - t:.1f}s")
        tower_ms, _ = timed(lambda: emb.vision._run_tower(pixels, grid_list, shas), args.repeats, args.device)
        lm_ms, vectors = timed(lambda: emb.embed_contents(contents, [None] * len(contents)), args.repeats,
                               args.device)
        rows[name] = (tower_ms, lm_ms, np.asarray(vectors))
        print(f"{name:9s} tower x{len(images)} {tower_ms:7.1f} ms   LM embed x{len(images)} {lm_ms:7.1f} ms")
    (t0, l0, v0), (t1, l1, v1) = rows["eager"], rows["compiled"]
    cos = (v0 * v1).sum(1) / (np.linalg.norm(v0, axis=1) * np.linalg.norm(v1, axis=1))
    print(f"compiled / eager time: tower {t1 / t0:.2f}, LM {l1 / l0:.2f}; embedding cosine min {cos.min():.5f}")


if __name__ == "__main__":
    main()
