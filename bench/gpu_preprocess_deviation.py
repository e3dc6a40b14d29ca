"""Deviation of each preprocessing mode from the official CPU path: pixels, embeddings and time per image.

    python3 bench/gpu_preprocess_deviation.py --checkpoint CKPT --device cuda     # the 2B architecture
    python bench/gpu_preprocess_deviation.py                                        # tiny, CPU

Photo-like JPEGs (there are no real photos in the repository: smooth gradients plus sensor-like noise, 4:3
and 3:4) of 600 px and less and of 12 MP (``--sides``). First the resize alone: Pillow's (CPU, one thread)
against :mod:`~retrieval.plugins.accelerated.exact_resize`
on the GPU, with the check that they agree bit for bit. Then the
reference, the official path itself (PIL decode + qwen_vl_utils resize + the processor, on the CPU), against
each mode: ``pixel_values`` (max |delta|), embeddings (min and mean cosine) and preprocessing time per image, for
"official" (on a GPU: PIL decode, Pillow's resize arithmetic, normalise and patchify on the device; on a CPU the
official path itself) and, on a GPU, "gpu-nvjpeg" (nvJPEG decode too).
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rubricsearch.retrieval.embedding.factory import load_embedder
from rubricsearch.retrieval.images import EncodedImage
from rubricsearch.retrieval.packages import PackageStore, VisualPackages
from rubricsearch.retrieval.plugins.accelerated.exact_resize import resize
from rubricsearch.retrieval.plugins.accelerated.vision import AcceleratedVisionEncoder
from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model
from rubricsearch.retrieval.qwen.model.loading import load_qwen
from rubricsearch.retrieval.qwen.model.prompts import Content


def photo(seed: int, long_side: int) -> bytes:
    rng = np.random.default_rng(seed)
    w, h = (long_side, long_side * 3 // 4) if seed % 2 else (long_side * 3 // 4, long_side)
    small = rng.integers(0, 255, (max(2, h // 48), max(2, w // 48), 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.BICUBIC)
    arr = np.asarray(img, dtype=np.int16) + rng.integers(-10, 10, (h, w, 3), dtype=np.int16)
    buf = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def resize_times(device: str, sync: Callable[[], object], sides: list[int]) -> None:
    """Median ms of one resize to ``smart_resize``'s size: PIL on the CPU vs the exact tensor resize on the device."""
    from qwen_vl_utils.vision_process import smart_resize

    for w, h in ((side, side * 3 // 4) for side in sides):
        img = Image.open(io.BytesIO(photo(1, w))).convert("RGB")
        th, tw = smart_resize(h, w, factor=32, min_pixels=4096, max_pixels=1_843_200)
        pil_ms, dev_ms = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            want = img.resize((tw, th))
            pil_ms.append((time.perf_counter() - t0) * 1000)
        x = torch.from_numpy(np.array(img)).to(device).permute(2, 0, 1).contiguous()  # as a batch is laid out
        got = resize(x, (th, tw))  # warm-up (and the check)
        for _ in range(10):
            sync()
            t0 = time.perf_counter()
            resize(x, (th, tw))
            sync()
            dev_ms.append((time.perf_counter() - t0) * 1000)
        same = np.array_equal(got.permute(1, 2, 0).cpu().numpy(), np.asarray(want))
        print(f"resize {w}x{h} -> {tw}x{th}: PIL (CPU) {np.median(pil_ms):.1f} ms; exact on {device} "
              f"{np.median(dev_ms):.2f} ms; identical: {same}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--photos", type=int, default=16)
    ap.add_argument("--sides", default="600,4032", help="longest sides of the photo sets (and of the resize timings)")
    args = ap.parse_args()
    ckpt = args.checkpoint or make_test_model(tempfile.mkdtemp(), "embedding")
    loaded = load_qwen(ckpt, device=args.device)
    gpu = args.device.startswith("cuda")
    modes = ["official", "gpu-nvjpeg"] if gpu else ["official"]
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    sides = [int(v) for v in args.sides.split(",")]
    print(f"device={args.device} photos={args.photos} sides={sides} modes={modes} (product defaults otherwise)")
    resize_times(args.device, sync, sides)
    for side in sides:
        label = f"<= {side} px"
        data = [photo(i, side - 64 * (i % 4) if side < 1000 else side) for i in range(args.photos)]
        reference = VisionEncoder(loaded)
        cpu_pixels = [reference._run_processor([reference._resize(EncodedImage(d))], None)[0] for d in data]
        reference.close()
        vectors: dict[str, np.ndarray] = {}
        for mode in modes:
            vision = AcceleratedVisionEncoder(loaded, preprocess=mode)  # type: ignore[arg-type]
            packages = VisualPackages(PackageStore(storage_dtype="float32"))
            with load_embedder(loaded, vision=vision, packages=packages) as emb:  # closing joins its threads
                images = [EncodedImage(d) for d in data]
                vision._process(images[:2])  # warm-up
                sync()
                t0 = time.perf_counter()
                made = vision._process(images)
                sync()
                per = (time.perf_counter() - t0) / len(images) * 1000
                delta = max(float((p.float().cpu() - ref[0].to(p.dtype).float()).abs().max())
                            for (p, _), ref in zip(made, cpu_pixels, strict=True))  # type: ignore[misc]
                vectors[mode] = emb.embed_contents([Content(images=[im]) for im in images], [None] * len(images))
            cos = (vectors[mode] * vectors["official"]).sum(axis=1)
            print(f"{label:>10} {mode:>11}: preprocess {per:7.1f} ms/image; pixel_values max |delta| vs the "
                  f"official CPU path {delta:.6f}; cosine vs official min {cos.min():.6f} mean {cos.mean():.6f}",
                  flush=True)


if __name__ == "__main__":
    main()
