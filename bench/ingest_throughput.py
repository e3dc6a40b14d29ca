"""Ingestion throughput: images/s through the whole job pipeline, split by stage.

A set receives one upload job of N distinct images; a worker processes it in claimed batches (load,
decode, dedup, vision tower, LM embedding, blob store, vector index, catalog commit). A second job with the
same images measures the re-add path (all duplicates: no model work at all).

    python bench/ingest_throughput.py                       # CPU, `small` random-weight checkpoint
    python bench/ingest_throughput.py --size tiny           # CPU, the test checkpoint
    python bench/ingest_throughput.py --device cuda         # GPU, real 2B architecture, random bf16 weights

Random weights give honest timings: compute does not depend on weight values. load/decode/blob are summed
over the loader threads (use --loaders 1 for a plain wall-time split).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from indexer.jobs import STAGES, IngestionRunner, IngestionService
from retrieval import load_embedder
from retrieval.packages import PackageStore
from retrieval.qwen.checkpoint import Size, make_test_model


def jpeg(width: int, height: int, seed: int) -> bytes:
    """A photo-like JPEG (smooth gradients plus noise), so decode cost resembles real uploads."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * (1 + seed % 3)) % 256, (y * 2) % 256, (x + y + seed) % 256], axis=-1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=88)
    return buf.getvalue()


def run_job(service: IngestionService, runner: IngestionRunner, set_id: str,
            files: list[tuple[str, bytes]], sync: Any) -> tuple[float, dict[str, float], Any]:
    runner.processor.times.reset()
    job = service.create_job_from_uploads(set_id, files)
    sync()
    start = time.perf_counter()
    runner.run_until_idle()
    sync()
    wall = time.perf_counter() - start
    return wall, runner.processor.times.snapshot(), service.get_job(job.id)


def table(title: str, wall: float, times: dict[str, float], n: int) -> list[str]:
    lines = [f"{title}: {n} images in {wall:.2f}s = {n / wall:.1f} images/s",
             f"  {'stage':<8} {'seconds':>8} {'% wall':>7} {'ms/image':>9}"]
    for stage in STAGES:
        sec = times[stage]
        lines.append(f"  {stage:<8} {sec:8.3f} {100 * sec / wall:6.1f}% {1000 * sec / n:9.2f}")
    other = wall - sum(times[s] for s in STAGES)
    lines.append(f"  {'other':<8} {max(0.0, other):8.3f}  (claims, job bookkeeping, flush)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--size", choices=["tiny", "small", "2b"], default=None, help="default: small cpu, 2b cuda")
    ap.add_argument("--checkpoint", help="an existing checkpoint dir (default: write a random one)")
    ap.add_argument("--images", type=int, default=None, help="default 48 cpu, 256 cuda")
    ap.add_argument("--side", type=int, default=None, help="longest image side, default 320 cpu, 640 cuda")
    ap.add_argument("--batch-size", type=int, default=None, help="items claimed per batch, default 8 cpu, 32 cuda")
    ap.add_argument("--loaders", type=int, default=4, help="threads for load/decode/blob")
    ap.add_argument("--max-pixels", type=int, default=None, help="model max_pixels (default: official)")
    ap.add_argument("--json", default=os.environ.get("OUT") and os.path.join(os.environ["OUT"], "ingest.json"))
    args = ap.parse_args()
    gpu = args.device == "cuda"
    size: Size = args.size or ("2b" if gpu else "small")
    n = args.images or (256 if gpu else 48)
    side = args.side or (640 if gpu else 320)
    batch = args.batch_size or (32 if gpu else 8)
    work = Path(tempfile.mkdtemp(prefix="rs-ingest-bench-"))
    ckpt = args.checkpoint
    if ckpt is None:
        t0 = time.perf_counter()
        ckpt = str(make_test_model(work / "ckpt", "embedding", size=size,
                                   dtype="bfloat16" if gpu else "float32"))
        print(f"wrote random {size} checkpoint in {time.perf_counter() - t0:.1f}s")
    store = PackageStore(work / "packages", storage_dtype="bfloat16" if gpu else "float32",
                         memory_bytes=8 << 30)
    options: dict[str, Any] = {"device": args.device, "store": store}
    if args.max_pixels:
        options["max_pixels"] = args.max_pixels
    embedder = load_embedder(ckpt, **options)
    sync = _sync(gpu)
    service = IngestionService.open_local(work / "data", embedder=embedder)
    runner = IngestionRunner(service, worker_id="bench", batch_size=batch, load_threads=args.loaders)
    print(f"device={args.device} size={size} hidden={embedder.dimension} images={n} side<={side}px "
          f"batch={batch} loaders={args.loaders}")

    warm_set = service.create_set("warm-up")
    run_job(service, runner, warm_set.id, [(f"w{i}.jpg", jpeg(side, side * 3 // 4, 10_000 + i))
                                           for i in range(min(batch, 8))], sync)
    files = [(f"img{i}.jpg", jpeg(side - 37 * (i % 5), side * 3 // 4 - 23 * (i % 4), i)) for i in range(n)]
    ref_set = service.create_set("bench")
    encodes = embedder.stats["vision_encodes"]
    wall, times, job = run_job(service, runner, ref_set.id, files, sync)
    assert job.done == n and job.failed == 0, job
    vision_runs = embedder.stats["vision_encodes"] - encodes
    lines = table("ingest", wall, times, n)
    lines.append(f"  vision tower ran {vision_runs} times for {n} images; "
                 f"{int(times['batches'])} batches; index holds {service.index.count(ref_set.id)}")
    wall2, times2, job2 = run_job(service, runner, ref_set.id, files, sync)
    assert job2.skipped == n, job2
    lines += table("re-add (all duplicates)", wall2, times2, n)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": args.device, "size": size, "images": n, "side": side, "batch": batch,
            "loaders": args.loaders, "ingest": {"wall_s": wall, "images_per_s": n / wall, **times},
            "readd": {"wall_s": wall2, "images_per_s": n / wall2, **times2},
            "gpu": _gpu_name() if gpu else None,
        }, indent=2))
    runner.close()
    service.close()
    service.index.close()


def _sync(gpu: bool) -> Any:
    if not gpu:
        return lambda: None
    import torch

    return torch.cuda.synchronize


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name()


if __name__ == "__main__":
    main()
