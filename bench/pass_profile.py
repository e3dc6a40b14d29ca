"""Where the time of one tower pass and one LM pass goes on a GPU: wall time vs GPU kernel time (the gap is
host time the GPU waits for), host-to-device syncs, the top CPU ops and the top kernels, for an ingestion
batch (64 images) and for one search candidate (1 image), with each pass's MFU over its wall time — the numbers
to read before optimising a pass.

    python3 bench/pass_profile.py --checkpoint CKPT [--fused]       # on a CUDA box
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compile_check import timed
from bench.flops import PEAK_TFLOPS, lm_flops, vision_flops
from bench.fp8_packages import photo
from retrieval.embedding.local import LocalEmbedder
from retrieval.images import decode_image
from retrieval.packages import PackageStore, VisualPackages
from retrieval.qwen.loading import load_qwen
from retrieval.qwen.prompts import Content

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "aten::item", "aten::nonzero",
         "aten::_local_scalar_dense", "cudaEventSynchronize")


def report(name: str, fn: Callable[[], Any], top: int, flops: float = 0.0) -> None:
    cuda = torch.cuda.is_available()
    wall, _ = timed(fn, 3, "cuda" if cuda else "cpu")
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / 1000
    print(f"\n== {name}: wall {wall:.1f} ms, GPU kernels {gpu:.1f} ms -> GPU busy {100 * gpu / wall:.0f}%")
    if flops:
        mfu = flops / (wall / 1000) / 1e12 / PEAK_TFLOPS
        print(f"  {flops / 1e12:.1f} TFLOP of matrix products -> MFU over the wall {mfu:.2f} (peak {PEAK_TFLOPS:.0f})")
    syncs = {e.key: e.count for e in events if any(e.key.startswith(s) for s in SYNCS)}
    print("  syncs/copies: " + ", ".join(f"{k} x{v}" for k, v in sorted(syncs.items())))
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    print(f"  kernel launches {launches}")
    cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    print("  top CPU (self ms, calls): " + "; ".join(f"{e.key[:40]} {e.self_cpu_time_total / 1000:.1f} x{e.count}"
                                                    for e in cpu))
    dev = sorted((e for e in events if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)[:top]
    print("  top GPU (self ms, calls): " + "; ".join(f"{e.key[:50]} {e.self_device_time_total / 1000:.1f} x{e.count}"
                                                    for e in dev))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--fused", action="store_true")
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    loaded = load_qwen(args.checkpoint, device="cuda", fused_kernels=args.fused)
    emb = LocalEmbedder(loaded, packages=VisualPackages(PackageStore(storage_dtype="bfloat16")),
                        cuda_graphs=args.cuda_graphs)
    for n in (64, 1):
        images = [decode_image(photo(7000 + i, 448, 448)) for i in range(n)]
        pixels, grids = emb.vision.preprocess(images)
        grid_list = [(int(t), int(h), int(w)) for t, h, w in grids.tolist()]
        pixels = pixels.to(loaded.device)
        shas = [im.sha256 for im in images]
        with torch.inference_mode():
            report(f"tower x{n} (448 px, fused={args.fused})",
                   partial(emb.vision._run_tower, pixels, grid_list, shas), args.top,
                   vision_flops(loaded.model.visual, grid_list))
        text = "short fur, triangular ears, dark forehead stripes"
        contents = [Content(texts=[text], images=[im]) for im in images]
        before = emb.stats["lm_tokens"]
        emb.embed_contents(contents, [None] * n)
        length = (emb.stats["lm_tokens"] - before) // n  # the same image size and text: one length for all
        report(f"LM embed x{n} from cached packages (cuda_graphs={args.cuda_graphs})",
               partial(emb.embed_contents, contents, [None] * n), args.top,
               lm_flops(loaded.model.language_model, loaded.model.config.text_config, [length] * n))
    print(f"scheduler: {emb.scheduler.stats}")


if __name__ == "__main__":
    main()
