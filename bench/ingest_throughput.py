"""Ingestion throughput: images/s through the product's whole job pipeline, split by stage.

The models, stores and runner are built from the product's settings as ``rubricsearch ingest`` builds them
(:func:`app.state.open_state`), on a random-weight checkpoint of the chosen architecture (random weights give
honest timings: compute does not depend on weight values). A set receives one upload job of N distinct images;
the runner processes it in claimed batches (load, decode, dedup, preprocess, vision tower, LM embedding, blob
store, vector index, catalog commit), consecutive batches overlapping on their own threads. A second job with the
same images measures the re-add path (all duplicates: no model work at all).

    python bench/ingest_throughput.py                                   # CPU, `small` architecture
    python bench/ingest_throughput.py --size 2b --kind square --side 448 --baselines     # a GPU, the 2B
    python bench/ingest_throughput.py --size 2b --kind photo --images 64 --set models.preprocess=gpu-nvjpeg

Stage seconds add up to more than the wall time (the stages overlap); prepare, vision, pack, embed, store and
catalog are the wall times of the six stage groups. load/decode/blob are summed over the loader threads.
``--baselines`` times the same files through the official class path and the raw transformers pieces, with
the FLOP limit beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.baselines import GpuUtil, flop_limit, side_by_side
from bench.common import (
    add_settings_args,
    engine,
    performance_values,
    product_settings,
    scratch_dir,
    setting,
    settings_line,
)
from bench.images import KINDS, make_files, sync_for
from rubricsearch.indexer.catalog.tables import ItemState
from rubricsearch.indexer.jobs.pipeline import GROUPS, PIPELINE_STAGES

THREAD_SUMMED = ("load", "decode", "blob")  # timed per item in the loader pool (indexer/jobs/model.py)


def run_job(service: Any, runner: Any, set_id: str, files: list[tuple[str, bytes]], sync: Any,
            util: GpuUtil | None = None) -> tuple[float, dict[str, float], Any]:
    """One upload job processed to its end: wall seconds (from staged uploads), stage times, the job."""
    runner.processor.times.reset()
    job = service.create_job_from_uploads(set_id, files)
    sync()
    start = time.perf_counter()
    if util is not None:
        with util:
            runner.run_until_idle()
    else:
        runner.run_until_idle()
    sync()
    return time.perf_counter() - start, runner.processor.times.snapshot(), service.get_job(job.id)


def rate(images_per_s: float) -> str:
    """Three significant digits at least: 12-MP photos on a CPU ingest at a fifth of an image a second."""
    return f"{images_per_s:.1f}" if images_per_s >= 100 else f"{images_per_s:.3g}"


def table(title: str, wall: float, times: dict[str, float], n: int) -> list[str]:
    lines = [f"{title}: {n} images in {wall:.2f}s = {rate(n / wall)} images/s",
             f"  {'stage':<10} {'seconds':>8} {'% wall':>7} {'ms/image':>9}"]
    for stage in (*PIPELINE_STAGES, *GROUPS):
        sec = times.get(stage, 0.0)
        if stage == GROUPS[0]:
            lines.append("  -- stage groups (wall time of each; they overlap) --")
        mark = " *" if stage in THREAD_SUMMED else ""
        lines.append(f"  {stage:<10} {sec:8.3f} {100 * sec / wall:6.1f}% {1000 * sec / n:9.2f}{mark}")
    lines.append("  * summed over the loader threads (thread-seconds, not wall time: over 100 % means overlap)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["tiny", "small", "2b"], default=None,
                    help="random checkpoint's architecture (default: 2b on a GPU, small on the CPU)")
    ap.add_argument("--checkpoint", help="an existing embedding checkpoint (default: write a random one)")
    ap.add_argument("--kind", choices=KINDS, default="mixed", help="the image set (bench/images.py)")
    ap.add_argument("--images", type=int, default=None, help="images per timed run (default 256 GPU, 48 CPU)")
    ap.add_argument("--side", type=int, default=None, help="longest side of square/mixed images (640 GPU, 320 CPU)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="items per claim (default: the product's, 64 with a CUDA device, 8 on the CPU)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of new images (each printed, then the median)")
    ap.add_argument("--baselines", action="store_true",
                    help="also time the official class path and the raw transformers pieces on the same files")
    ap.add_argument("--json", default=os.environ.get("OUT") and os.path.join(os.environ["OUT"], "ingest.json"))
    add_settings_args(ap)
    args = ap.parse_args()
    import torch

    from rubricsearch.app.state import foreground_runner, open_state
    from rubricsearch.app.threads import apply_op_threads
    try:
        from rubricsearch.retrieval.plugins.accelerated.kernels.cudnn_attention import CUDNN
    except ImportError:  # an older tree beside this one (bench/gpu_report.py --against): the kernels sat in the core
        from rubricsearch.retrieval.qwen.kernels.cudnn_attention import CUDNN  # type: ignore[no-redef]
    from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

    work = scratch_dir("rs-ingest-bench-")
    probe = product_settings(args)
    gpu = setting(probe, "models.device") != "cpu" and torch.cuda.is_available()
    size = args.size or ("2b" if gpu else "small")
    n, side = args.images or (256 if gpu else 48), args.side or (640 if gpu else 320)
    ckpt = args.checkpoint or str(make_test_model(work / "ckpt", "embedding", size=size,
                                                  dtype="bfloat16" if gpu else "float32"))
    # the bench owns its data folder and its checkpoint (one model as both: one shared tower); all else is product
    settings = product_settings(args, data_dir=work / "data", models__embedding_model=ckpt,
                                models__reranker_model=ckpt, ingest__workers=0,
                                models__fallback_to_test_models=False)
    state = open_state(settings, ingest=True)
    embedder: Any = state.embedder
    try:  # as `serve` does
        apply_op_threads(device=setting(settings, "models.device"), width=embedder.dimension)
    except TypeError:  # an older tree (gpu_report.py --against) still takes its torch_threads setting, 0 = the rule
        apply_op_threads(0, device=setting(settings, "models.device"), width=embedder.dimension)  # type: ignore[misc]
    # an older tree (gpu_report.py --against) may lack the keyword: its runner claims what its settings say
    runner = foreground_runner(state, **({"batch_size": args.batch_size} if args.batch_size else {}))
    service = state.ingestion
    sync = sync_for(gpu)
    print(settings_line(settings, device_in_use=engine(embedder).loaded.device,
                        fused_kernels_in_use=engine(embedder).loaded.fused_kernels, claim=runner.batch_size))
    print(f"architecture={size} hidden={embedder.dimension} images={n} kind={args.kind} side<={side}px "
          f"gpu={torch.cuda.get_device_name() if gpu else None}", flush=True)

    # one-time costs (graph captures, compiles, cuDNN plans) stay out of the rate, as on a server that has run a
    # while: the warm-up job has other images of the timed run's sizes, three batches where graphs capture
    warm_n = min(n, 3 * runner.batch_size if gpu else runner.batch_size)
    run_job(service, runner, _new_set(state, "warm-up"), make_files(warm_n, side, args.kind, first=10_000), sync)
    rates = []
    for k in range(1, args.repeats):  # the extra runs first: the last one is reported in full below
        r_wall, _, r_job = run_job(service, runner, _new_set(state, f"repeat-{k}"),
                                   make_files(n, side, args.kind, first=100_000 * k), sync)
        assert r_job.done == n, r_job
        rates.append(n / r_wall)
        print(f"repeat {k}: {n} images in {r_wall:.2f}s = {rate(n / r_wall)} images/s", flush=True)
    files = make_files(n, side, args.kind)
    ref_set = _new_set(state, "bench")
    util = GpuUtil() if gpu else None
    wall, times, job = run_job(service, runner, ref_set, files, sync, util)
    if job.failed:
        errors = {item.error for item in service.job_items(job.id, states=[ItemState.FAILED])}
        print(f"{job.failed} items failed:", *sorted(str(e) for e in errors), sep="\n  ")
    assert job.done == n and job.failed == 0, job
    rates.append(n / wall)
    print(f"runs: {', '.join(rate(r) for r in rates)} images/s; median {rate(float(np.median(rates)))}")
    gpu_util = util.mean if util is not None else None
    lines = table("ingest", wall, times, n)
    lines.append(f"  {int(times['batches'])} batches; index holds {state.index.count(ref_set)}; mean GPU "
                 f"utilisation {gpu_util if gpu_util is not None else float('nan'):.0f}%; tower attention through "
                 f"cuDNN: {CUDNN['calls']} calls")
    limit, mfu = flop_limit(embedder, [data for _, data in files], wall) if gpu else (None, None)
    if limit is not None:
        lines.append(f"  FLOP limit {limit:.0f} images/s; MFU over the wall time {mfu:.2f}")
    wall2, times2, job2 = run_job(service, runner, ref_set, files, sync)
    assert job2.skipped == n, job2
    lines += table("re-add (all duplicates)", wall2, times2, n)
    result: dict[str, Any] = {"settings": performance_values(settings), "kind": args.kind,
                              "images": n, "side": side, "size": size,
                              "ingest": {"wall_s": wall, "images_per_s": n / wall,
                                         "median_images_per_s": float(np.median(rates)), "gpu_util": gpu_util,
                                         "mfu": mfu, "flop_limit": limit, **times},
                              "readd": {"wall_s": wall2, "images_per_s": n / wall2}}
    if args.baselines:
        lines += side_by_side(embedder, files, n / wall, limit, gpu_util, result)
    print("\n".join(lines), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    runner.close()
    state.close()


def _new_set(state: Any, name: str) -> str:
    return str(state.ingestion.create_set(name).id)


if __name__ == "__main__":
    main()
