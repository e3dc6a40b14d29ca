"""fp8 package storage: bytes per 448 px reference, and the deviation from bf16 of per-token vs per-channel
scales, on embeddings (cosine) and reranker scores (|Δ|).

    python3 bench/fp8_packages.py --checkpoint CKPT --device cuda       # the 2B architecture
    python bench/fp8_packages.py                                        # tiny, CPU

Each storage runs the same images through the full embedder and reranker (packages made once per store,
then used as stored); bf16 storage is the reference. Images are photo-like JPEGs at 448 px and 640x480.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rerank.local import LocalReranker
from retrieval.embedding.local import LocalEmbedder
from retrieval.images import decode_image
from retrieval.packages import PackageStore, VisualPackages
from retrieval.qwen.checkpoint import make_test_model
from retrieval.qwen.loading import load_qwen
from retrieval.qwen.prompts import Content


def photo(seed: int, w: int, h: int) -> bytes:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 255, (h // 32, w // 32, 3), dtype=np.uint8)
    arr = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC), dtype=np.int16)
    arr = arr + rng.integers(-10, 10, arr.shape, dtype=np.int16)
    buf = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--images", type=int, default=24)
    args = ap.parse_args()
    ckpt = args.checkpoint or make_test_model(tempfile.mkdtemp(), "reranker")
    loaded = load_qwen(ckpt, device=args.device, lm_rows=("yes", "no"))
    images = [decode_image(photo(i, 448, 448) if i % 2 else photo(i, 640, 480)) for i in range(args.images)]
    results = {}
    for name, dtype, scales in (("bf16", "bfloat16", "token"), ("fp8/token", "float8_e4m3fn", "token"),
                                ("fp8/channel", "float8_e4m3fn", "channel")):
        store = PackageStore(storage_dtype=dtype, fp8_scales=scales)  # type: ignore[arg-type]
        packages = VisualPackages(store)
        emb = LocalEmbedder(loaded, packages=packages)
        rr = LocalReranker(loaded, packages=packages, vision=emb.vision)
        vectors = emb.embed_contents([Content(images=[im]) for im in images], [None] * len(images))
        scores = np.array(rr.score({"image": images[0].data, "text": "short fur"},
                                   [{"image": im.data} for im in images[1:]], "Judge the markings"))
        results[name] = (vectors, scores)
    ref_v, ref_s = results["bf16"]
    print(f"{'storage':<12} {'bytes/448px ref':>16} {'min cos':>9} {'mean cos':>9} {'max |Δscore|':>12}")
    for name, (vectors, scores) in results.items():
        cos = (vectors * ref_v).sum(axis=1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(ref_v, axis=1)
        per_448 = _bytes_448(name, loaded)
        print(f"{name:<12} {per_448:>16,} {cos.min():>9.6f} {cos.mean():>9.6f} {np.abs(scores - ref_s).max():>12.2e}")


def _bytes_448(name: str, loaded: object) -> int:
    """File bytes of one 448 px reference's package under this storage (196 tokens)."""
    import torch

    from retrieval.packages import Fingerprint, VisualPackage

    hidden = loaded.hidden_size  # type: ignore[attr-defined]
    levels = loaded.deepstack_levels  # type: ignore[attr-defined]
    fp = Fingerprint(tower="t", min_pixels=1, max_pixels=2, patch_size=16, merge_size=2, temporal_patch_size=2,
                     image_mean=(0.5,), image_std=(0.5,), resize="x")
    pkg = VisualPackage("0" * 64, fp, (1, 28, 28), torch.randn(196, hidden), torch.randn(levels, 196, hidden))
    dtype, scales = ("bfloat16", "token") if name == "bf16" else ("float8_e4m3fn", name.split("/")[1])
    root = Path(tempfile.mkdtemp())
    PackageStore(root, storage_dtype=dtype, fp8_scales=scales).put(pkg)  # type: ignore[arg-type]
    return sum(p.stat().st_size for p in root.rglob("*.safetensors"))


if __name__ == "__main__":
    main()
