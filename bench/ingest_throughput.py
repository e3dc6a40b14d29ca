"""Ingestion throughput: images/s through the whole job pipeline, split by stage.

A set receives one upload job of N distinct images; a worker processes it in claimed batches (load,
decode, dedup, preprocess, vision tower, LM embedding, blob store, vector index, catalog commit). A second
job with the same images measures the re-add path (all duplicates: no model work at all).

    python bench/ingest_throughput.py                       # CPU, `small` random-weight checkpoint
    python bench/ingest_throughput.py --size tiny           # CPU, the test checkpoint
    python bench/ingest_throughput.py --device cuda         # GPU, real 2B architecture, random bf16 weights
    python bench/ingest_throughput.py --device cuda --side 448 --square   # 448x448 (196 visual tokens)
    python bench/ingest_throughput.py --device cuda --probe # tower attention + preprocessing micro-benchmarks

By default consecutive batches overlap (CPU stages, towers, packing, LM, disk and catalog each on a thread of
their own, see indexer/jobs/overlap.py), the catalog commit is batched and package files are written behind;
``--serial --per-item-commit --no-write-behind --no-grouped-attention --preprocess-threads 1`` is the
earlier serial pipeline. With overlap the stage seconds add up to more than the wall time; prepare, vision,
pack, embed, store and catalog are the wall times of the six stage groups (each on its own thread).
load/decode/blob are summed over the loader threads.
Random weights give honest timings: compute does not depend on weight values.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.settings import Settings
from bench import host_probes, reverts, sync_points
from bench.baselines import GpuUtil, side_by_side
from bench.images import make_files, sync_for
from bench.stack_profile import profile_in_halves, summarise, waits
from bench.tower_probe import probe
from bench.trace_summary import profiled
from bench.trace_summary import summarise as summarise_trace
from indexer.catalog.models import ItemState
from indexer.jobs import IngestionRunner, IngestionService
from indexer.jobs.pipeline import GROUPS, PIPELINE_STAGES
from retrieval.embedding.local import LocalEmbedder
from retrieval.packages import PackageStore, VisualPackages
from retrieval.qwen.checkpoint import Size, make_test_model
from retrieval.qwen.loading import load_qwen
from retrieval.qwen.vision import VisionEncoder


def run_job(service: IngestionService, runner: IngestionRunner, set_id: str,
            files: list[tuple[str, bytes]], sync: Any, util: Any = None,
            on_start: Any = None) -> tuple[float, dict[str, float], Any]:
    runner.processor.times.reset()
    job = service.create_job_from_uploads(set_id, files)
    sync()
    if on_start is not None:  # e.g. a py-spy recording of the ingestion alone, not the upload staging
        on_start()
    start = time.perf_counter()
    if util is not None:
        with util:
            runner.run_until_idle()
    else:
        runner.run_until_idle()
    sync()
    wall = time.perf_counter() - start
    return wall, runner.processor.times.snapshot(), service.get_job(job.id)


THREAD_SUMMED = ("load", "decode", "blob")  # timed per item in the loader pool (indexer/jobs/model.py)


def table(title: str, wall: float, times: dict[str, float], n: int) -> list[str]:
    lines = [f"{title}: {n} images in {wall:.2f}s = {n / wall:.1f} images/s",
             f"  {'stage':<10} {'seconds':>8} {'% wall':>7} {'ms/image':>9}"]
    for stage in (*PIPELINE_STAGES, *GROUPS):
        sec = times.get(stage, 0.0)
        if stage == GROUPS[0]:
            lines.append("  -- stage groups (wall time of each; they overlap) --")
        mark = " *" if stage in THREAD_SUMMED else ""
        lines.append(f"  {stage:<10} {sec:8.3f} {100 * sec / wall:6.1f}% {1000 * sec / n:9.2f}{mark}")
    lines.append("  * summed over the loader threads (thread-seconds, not wall time: over 100 % means overlap)")
    return lines


def _run_mfu(embedder: LocalEmbedder, files: list[tuple[str, bytes]], times: dict[str, float],
             wall: float) -> tuple[str, float]:
    """FLOPs of the run's tower and LM passes over the run's wall time and over each stage's own time."""
    from qwen_vl_utils.vision_process import smart_resize

    from bench.flops import PEAK_TFLOPS, lm_flops, vision_flops
    from retrieval.images import inspect_image

    vision = embedder.vision
    grids = []
    for _, data in files:
        info = inspect_image(data)
        h, w = smart_resize(info.height, info.width, factor=32, min_pixels=vision.min_pixels,
                            max_pixels=vision.max_pixels)
        grids.append((1, h // 16, w // 16))
    model = embedder.loaded.model
    vf = vision_flops(model.visual, grids)
    lf = lm_flops(model.language_model, model.config.text_config, [t * h * w // 4 + 14 for t, h, w in grids])
    peak = PEAK_TFLOPS * 1e12
    mfu_vision = vf / max(times["vision"], 1e-9) / peak
    limit = len(files) * peak / (vf + lf)
    return (f"  FLOPs: tower {vf / 1e12:.1f} T, LM {lf / 1e12:.1f} T -> MFU over the wall time "
            f"{(vf + lf) / wall / peak:.2f}; over the stage times: vision {mfu_vision:.2f} (an upper bound: the "
            f"stage launches the towers and goes on without waiting for them), "
            f"LM {lf / max(times['embed'], 1e-9) / peak:.2f} (a lower bound: it waits behind the towers on one "
            f"stream) (peak {PEAK_TFLOPS:.0f} TFLOP/s); FLOP limit "
            f"{limit:.0f} images/s"), limit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--size", choices=["tiny", "small", "2b"], default=None, help="default: small cpu, 2b cuda")
    ap.add_argument("--checkpoint", help="an existing checkpoint dir (default: write a random one)")
    ap.add_argument("--images", type=int, default=None, help="default 48 cpu, 256 cuda")
    ap.add_argument("--side", type=int, default=None, help="longest image side, default 320 cpu, 640 cuda")
    ap.add_argument("--square", action="store_true", help="side x side images (else a mix of 4:3-ish sizes)")
    ap.add_argument("--batch-size", type=int, default=None, help="items claimed per batch, default 8 cpu, 64 cuda")
    ap.add_argument("--batch-pixels", type=int, default=Settings.model_fields["worker_batch_pixels"].default,
                    help="decoded pixels per claimed batch (RUBRICSEARCH_WORKER_BATCH_PIXELS; 0: no bound)")
    ap.add_argument("--loaders", type=int, default=None, help="threads for load/decode/blob (4 cpu, 8 cuda)")
    ap.add_argument("--max-pixels", type=int, default=None, help="model max_pixels (default: official)")
    ap.add_argument("--max-batch-patches", type=int, default=None, help="tower batch bound (default 65536 cuda)")
    ap.add_argument("--preprocess-threads", type=int, default=None, help="default min(8, cores)")
    ap.add_argument("--writer-threads", type=int, default=4, help="package write-behind threads")
    ap.add_argument("--serial", action="store_true", help="no overlap between batches")
    ap.add_argument("--per-item-commit", action="store_true", help="one savepoint per item (the old commit)")
    ap.add_argument("--no-write-behind", action="store_true", help="package files written inside put()")
    ap.add_argument("--no-grouped-attention", action="store_true", help="transformers' per-image SDPA loop")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (GIL), seconds")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch CPU threads (default 4 with cuda: more only oversubscribe the cores the loader, "
                         "writer and GPU threads need)")
    ap.add_argument("--no-cudnn-sdpa", action="store_true",
                    help="disable cuDNN SDPA process-wide (it builds a plan per new shape; LM batches vary)")
    ap.add_argument("--probe", action="store_true", help="micro-benchmarks of the tower and preprocessing only")
    ap.add_argument("--py-spy", type=float, default=0, metavar="SECONDS",
                    help="sample this process's stacks with py-spy for the first SECONDS of the timed run")
    ap.add_argument("--preprocess", choices=["official", "gpu-nvjpeg"], default="official")
    ap.add_argument("--fused", action="store_true", help="Liger fused kernels (RUBRICSEARCH_FUSED_KERNELS)")
    ap.add_argument("--cuda-graphs", action="store_true", help="RUBRICSEARCH_CUDA_GRAPHS (small passes)")
    ap.add_argument("--bulk-graphs", action="store_true",
                    help="RUBRICSEARCH_BULK_GRAPHS (with --cuda-graphs): LM passes whose bucketed sizes come back and "
                    "tower passes of one small image size replay CUDA graphs")
    ap.add_argument("--bulk-photos", action="store_true",
                    help="experiment: bulk graphs for photos too (tower and LM size limits lifted)")
    ap.add_argument("--unlocked-rename", action="store_true",
                    help="experiment: package files renamed into place outside the store's lock (rename_probe.py)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed runs, each of new images of the same sizes (each printed, then the median)")
    ap.add_argument("--revert", default="", metavar="LIST", help=reverts.describe())
    ap.add_argument("--sync-debug", action="store_true",
                    help="count the calls that make a thread wait for the GPU in the reported run (by call site)")
    ap.add_argument("--host-probes", action="store_true",
                    help="the reported run's wall time per thread in the pipeline's functions, and how late a "
                         "thread that sleeps 1 ms wakes up (its wait for the GIL)")
    ap.add_argument("--torch-profile", action="store_true",
                    help="profile the timed run (torch.profiler, every thread) and print where the time went")
    ap.add_argument("--compile", choices=["dynamic", "static"], nargs="?", const="dynamic", default=None,
                    help="torch.compile the tower's and the LM's blocks (static: one compile per shape)")
    ap.add_argument("--baselines", action="store_true",
                    help="also time the official class path and the raw transformers pieces on the same files")
    ap.add_argument("--storage-dtype", choices=["float32", "bfloat16", "float8_e4m3fn"], default="float8_e4m3fn")
    ap.add_argument("--json", default=os.environ.get("OUT") and os.path.join(os.environ["OUT"], "ingest.json"))
    args = ap.parse_args()
    gpu = args.device == "cuda"
    size: Size = args.size or ("2b" if gpu else "small")
    n = args.images or (256 if gpu else 48)
    side = args.side or (640 if gpu else 320)
    batch = args.batch_size or (64 if gpu else 8)
    loaders = args.loaders or (8 if gpu else 4)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    import torch

    torch_threads = args.torch_threads or (4 if gpu else None)
    if torch_threads:
        torch.set_num_threads(torch_threads)
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    work = Path(tempfile.mkdtemp(prefix="rs-ingest-bench-"))
    # removed at exit, failed runs included: 2048 images' packages are GBs, and a device call's steps left behind
    # filled the box's disk (bench/gpu_run.sh bucket69: the eighth step died writing a package)
    atexit.register(shutil.rmtree, work, True)
    ckpt = args.checkpoint
    if ckpt is None:
        t0 = time.perf_counter()
        ckpt = str(make_test_model(work / "ckpt", "embedding", size=size,
                                   dtype="bfloat16" if gpu else "float32"))
        print(f"wrote random {size} checkpoint in {time.perf_counter() - t0:.1f}s")
    store = PackageStore(work / "packages", storage_dtype=args.storage_dtype,
                         memory_bytes=8 << 30, write_behind=not args.no_write_behind,
                         writer_threads=args.writer_threads)
    loaded = load_qwen(ckpt, device=args.device, fused_kernels=args.fused)
    if args.compile:
        from retrieval.qwen.loading import compile_blocks

        print(f"compiled {compile_blocks(loaded, dynamic=args.compile == 'dynamic')} blocks ({args.compile} shapes)")
    vision_options: dict[str, Any] = {"max_batch_patches": args.max_batch_patches,
                                      "preprocess_threads": args.preprocess_threads, "preprocess": args.preprocess}
    if args.max_pixels:
        vision_options["max_pixels"] = args.max_pixels
    if args.no_grouped_attention:
        vision_options["grouped_attention"] = False
    if args.bulk_photos and "tower-bulk" in reverts.parse(args.revert):
        raise SystemExit("--bulk-photos lifts the tower's bulk size limit that --revert tower-bulk sets to 0")
    reverts.revert(args.revert)
    if args.unlocked_rename:
        from bench.rename_probe import unlocked_rename

        unlocked_rename(store)
    if args.bulk_photos:
        import retrieval.qwen.vision as vision_module

        vision_module.BULK_IMAGE_PATCHES = 1 << 30  # read when the encoder is built
    embedder = LocalEmbedder(loaded, packages=VisualPackages(store), cuda_graphs=args.cuda_graphs,
                             bulk_graphs=args.bulk_graphs,
                             vision=VisionEncoder(loaded, cuda_graphs=args.cuda_graphs, bulk_graphs=args.bulk_graphs,
                                                  **vision_options))
    if args.bulk_photos and embedder.scheduler.graphs is not None:
        embedder.scheduler.graphs.bulk_width = 1 << 30
    sync = sync_for(gpu)
    result: dict[str, Any] = {"device": args.device, "size": size, "images": n, "side": side, "square": args.square,
                              "batch": batch, "loaders": loaders, "options": vars(args),
                              "gpu": _gpu_name() if gpu else None}
    if args.probe:
        print("\n".join(probe(embedder, side, gpu, result)))
        _dump(args.json, result)
        return
    service = IngestionService.open_local(work / "data", embedder=embedder)
    runner = IngestionRunner(service, worker_id="bench", batch_size=batch, batch_pixels=args.batch_pixels,
                             load_threads=loaders,
                             pipeline=not args.serial, bulk_commit=not args.per_item_commit)
    print(f"device={args.device} size={size} hidden={embedder.dimension} images={n} side<={side}px "
          f"square={args.square} batch={batch} batch_pixels={args.batch_pixels} loaders={loaders} "
          f"overlap={runner.pipeline} "
          f"bulk_commit={not args.per_item_commit} write_behind={store.write_behind} "
          f"grouped_attention={embedder.vision.grouped_attention} "
          f"preprocess_threads={embedder.vision.preprocess_threads} torch_threads={torch.get_num_threads()} "
          f"cudnn_sdpa={not args.no_cudnn_sdpa} cuda_graphs={embedder.cuda_graphs}")

    warm_set = service.create_set("warm-up")
    # compiled blocks see the timed run's batch shapes here first; graphs capture them on their third sighting.
    # Other images of the timed run's sizes (before 2026-11-26 all of one size, so a mixed set's bulk graphs were
    # captured inside the timed run): one-time costs stay out of the rate, as for a server that has run a while.
    warm_n = 3 * batch if embedder.cuda_graphs else batch if args.compile else 16
    warm = make_files(warm_n, side, args.square, first=10_000)
    run_job(service, runner, warm_set.id, [(f"w{i}.jpg", data) for i, (_, data) in enumerate(warm)], sync)
    files = make_files(n, side, args.square)
    ref_set = service.create_set("bench")
    encodes = embedder.stats["vision_encodes"]
    util = GpuUtil() if gpu else None
    rates = []
    for k in range(1, args.repeats):  # the extra runs first: the last one is reported in full below
        extra = service.create_set(f"repeat-{k}")
        r_wall, _, r_job = run_job(service, runner, extra.id, make_files(n, side, args.square, first=100_000 * k),
                                   sync)
        assert r_job.done == n, r_job
        rates.append(n / r_wall)
        print(f"repeat {k}: {n} images in {r_wall:.2f}s = {n / r_wall:.1f} images/s")
    spies: list[Any] = []  # the reported run's ingestion (started once its uploads are staged)
    start_spy = (lambda: spies.append(profile_in_halves(os.getpid(), args.py_spy, work, "ingest"))) \
        if args.py_spy else None
    names: dict[int, str] = {}
    idle_late = host_probes.idle_lateness() if args.host_probes else []
    with (profiled(work / "ingest_trace.json", names) if args.torch_profile else contextlib.nullcontext(),
          sync_points.counted() if args.sync_debug else contextlib.nullcontext() as syncs,
          host_probes.timed(host_probes.INGEST) if args.host_probes else contextlib.nullcontext() as timers,
          host_probes.GilProbe() if args.host_probes else contextlib.nullcontext() as gil):
        wall, times, job = run_job(service, runner, ref_set.id, files, sync, util, start_spy)
    if timers is not None and gil is not None:
        print("\n".join([gil.report(idle_late), *timers.report(wall)]))
    spy = spies[0] if spies else None
    if syncs is not None:
        print("\n".join(sync_points.summary(syncs)))
    if args.torch_profile:
        print("\n".join(summarise_trace(work / "ingest_trace.json", names)))
    if job.failed:
        errors = {item.error for item in service.job_items(job.id, states=[ItemState.FAILED])}
        print(f"{job.failed} items failed:", *sorted(str(e) for e in errors), sep="\n  ")
        print({**embedder.vision.stats(), **embedder.stats})
    assert job.done == n and job.failed == 0, job
    if spy is not None:
        spy.join()
        print("\n".join([*(line for path in sorted(work.glob("ingest_*.txt")) for line in summarise(path)),
                         *(line for thread in ("MainThread", "ingest-embed", "lm-scheduler", "ingest-store")
                           for line in waits(work / "ingest_all.txt", thread))]))
    if rates:
        rates.append(n / wall)
        print(f"runs: {', '.join(f'{r:.1f}' for r in rates)} images/s; median {float(np.median(rates)):.1f}")
    vision_runs = embedder.stats["vision_encodes"] - encodes - (len(rates) - 1 if rates else 0) * n
    lines = table("ingest", wall, times, n)
    lines.append(f"  vision tower ran {vision_runs} times for {n} images; "
                 f"{int(times['batches'])} batches; index holds {service.index.count(ref_set.id)}; "
                 f"package files {store.stats()['disk_packages']}; "
                 f"mean GPU utilisation {(util.mean if util is not None else None) or float('nan'):.0f}%")
    from retrieval.qwen.cudnn_attention import CUDNN

    lines.append(f"  tower attention through cuDNN (photo runs): {CUDNN['calls']} calls; refused: "
                 f"{'yes' if CUDNN['refused'] else 'none'}")
    limit = None
    if gpu:
        mfu, limit = _run_mfu(embedder, files, times, wall)
        lines.append(mfu)
    if embedder.cuda_graphs:
        counts = {**embedder.vision.stats(), **embedder.stats}
        lines.append("  CUDA graphs (warm-up included): " + ", ".join(
            f"{k} {counts.get(k)}" for k in ("tower_bulk_graph_captures", "tower_bulk_graph_replays",
                                          "bulk_graph_captures", "bulk_graph_replays", "graph_passes", "passes")))
    wall2, times2, job2 = run_job(service, runner, ref_set.id, files, sync)
    assert job2.skipped == n, job2
    lines += table("re-add (all duplicates)", wall2, times2, n)
    if args.baselines:
        lines += side_by_side(embedder, files, n / wall, limit, util.mean if util is not None else None, result)
    print("\n".join(lines))
    result.update(ingest={"wall_s": wall, "images_per_s": n / wall, "vision_runs": vision_runs,
                          "gpu_util": util.mean if util is not None else None, **times},
                  readd={"wall_s": wall2, "images_per_s": n / wall2, **times2})
    _dump(args.json, result)
    runner.close()
    service.close()
    service.index.close()
    store.close()


def _dump(path: str | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=2, default=str))


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name()


if __name__ == "__main__":
    main()
