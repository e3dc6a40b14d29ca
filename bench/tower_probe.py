"""Micro-benchmarks of the tower and the LM pass for ``bench/ingest_throughput.py --probe``: per-image vs
grouped attention (and whether packages are equal), same-size vs mixed images, a kernel profile, and the
preprocessing with 1..16 threads."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import numpy as np

from bench.images import jpeg, sync_for
from retrieval.embedding.local import LocalEmbedder
from retrieval.images import decode_image


def probe(embedder: LocalEmbedder, side: int, gpu: bool, out: dict[str, Any]) -> list[str]:
    """GPU time of the tower (per-image vs grouped attention, and whether packages are equal) and of the
    LM pass, for same-sized and mixed-size images; a kernel profile; preprocessing with 1..16 threads."""
    import torch

    with torch.inference_mode():
        return _probe(embedder, side, gpu, out)


def _timed(fn: Any, gpu: bool, reps: int = 3) -> tuple[float, Any]:
    fn()  # warm-up (new shapes)
    sync_for(gpu)()
    start = time.perf_counter()
    for _ in range(reps):
        result = fn()
    sync_for(gpu)()
    return 1000 * (time.perf_counter() - start) / reps, result


def _probe(embedder: LocalEmbedder, side: int, gpu: bool, out: dict[str, Any]) -> list[str]:
    import torch

    if gpu:
        from bench.flops import peak_tflops

        PEAK[0] = peak_tflops()
        out["peak_tflops"] = PEAK[0]

    from retrieval.qwen.prompts import Content

    vision = embedder.vision
    sets = {"square": [decode_image(jpeg(side, side, 90_000 + i)) for i in range(64)],
            "mix": [decode_image(jpeg(side - 37 * (i % 5), side * 3 // 4 - 23 * (i % 4), 91_000 + i))
                    for i in range(64)]}
    lines = []
    for name, images in sets.items():
        for batch in (16, 64) if name == "square" else (64,):
            pixels, grids = vision.preprocess(images[:batch])
            grid_list = [(int(t), int(h), int(w)) for t, h, w in grids.tolist()]
            order = sorted(range(batch), key=lambda k: grid_list[k][0] * grid_list[k][1] * grid_list[k][2])
            offsets = np.cumsum([0] + [t * h * w for t, h, w in grid_list])
            pixels = torch.cat([pixels[offsets[k]:offsets[k + 1]] for k in order]).to(vision.loaded.device)
            grid_list = [grid_list[k] for k in order]
            shas = [images[k].sha256 for k in order]
            res = {}
            for grouped in (False, True):
                vision.grouped_attention = grouped
                res[grouped] = _timed(partial(vision._run_tower, pixels, grid_list, shas), gpu)
            (ms0, p0), (ms1, p1) = res[False], res[True]
            pairs = list(zip(p0, p1, strict=True))
            same = all(torch.equal(a.embeds, b.embeds) and torch.equal(a.deepstack, b.deepstack) for a, b in pairs)
            dev = max(float((a.deepstack.float() - b.deepstack.float()).abs().max()) for a, b in pairs)
            mfu = ""
            if gpu:
                from bench.flops import vision_flops

                tflops = vision_flops(vision.loaded.model.visual, grid_list) / (ms1 / 1000) / 1e12
                mfu = f"; grouped {tflops:.0f} TFLOP/s = MFU {tflops / PEAK[0]:.2f}"
            lines.append(f"tower {name} {side}px x{batch}: per-image attention {ms0:.1f} ms ({ms0 / batch:.2f}/img), "
                         f"grouped {ms1:.1f} ms ({ms1 / batch:.2f}/img); identical={same} max|diff|={dev:.3g}{mfu}")
            out[f"tower_{name}_{batch}"] = {"per_image_ms": ms0, "grouped_ms": ms1, "identical": same}
        vision.grouped_attention = gpu
        embedder.packages.get_or_encode(images)
        contents = [Content(images=[im]) for im in images]
        ms, _ = _timed(partial(embedder.embed_contents, contents, [None] * len(contents)), gpu)
        lines.append(f"LM pass {name} x{len(images)} from cached packages: {ms:.1f} ms ({ms / len(images):.2f}/img)"
                     + _mfu_line(embedder, images, ms, gpu))
        out[f"lm_{name}_64"] = ms
    if gpu:
        from torch.profiler import ProfilerActivity, profile

        images = sets["mix"]
        pixels, grids = vision.preprocess(images)
        grid_list = [(int(t), int(h), int(w)) for t, h, w in grids.tolist()]
        contents = [Content(images=[im]) for im in images]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            vision._run_tower(pixels.to(vision.loaded.device), grid_list, [im.sha256 for im in images])
            embedder.embed_contents(contents, [None] * len(contents))
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
        events.sort(key=lambda e: -e.self_device_time_total)
        total = sum(e.self_device_time_total for e in events) / 1000
        lines.append(f"profile (tower + LM, mix x64): GPU busy {total:.1f} ms; top kernels:")
        for e in events[:14]:
            lines.append(f"  {e.self_device_time_total / 1000:8.2f} ms {e.count:6d}x  {e.key[:90]}")
    fresh = [decode_image(jpeg(side - 37 * (i % 5), side * 3 // 4 - 23 * (i % 4), 92_000 + i)) for i in range(64)]
    for threads in (1, 4, 8, 16):
        vision.preprocess_threads = threads
        vision._pool = None
        ms, _ = _timed(partial(vision.prepare, fresh), gpu)
        lines.append(f"prepare x64 (resize + processor + upload), {threads:2d} threads: {ms / 64:.2f} ms/image")
        out[f"prepare_{threads}_threads_ms"] = ms / 64
    return lines


PEAK = [798.0]  # bf16 TFLOP/s, measured at the start of a GPU probe


def _mfu_line(embedder: LocalEmbedder, images: list[Any], ms: float, gpu: bool) -> str:
    """The LM pass's model FLOP utilisation, from the token counts of the inputs it ran."""
    if not gpu:
        return ""
    from bench.flops import lm_flops
    from retrieval.qwen.prompts import Content

    inputs = embedder._prepare([Content(images=[im]) for im in images], [None] * len(images), None)
    model = embedder.loaded.model
    flops = lm_flops(model.language_model, model.config.text_config, [len(x.ids) for x in inputs])
    tflops = flops / (ms / 1000) / 1e12
    return f"; {tflops:.0f} TFLOP/s = MFU {tflops / PEAK[0]:.2f}"
