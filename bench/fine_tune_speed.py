"""Fine-tuning speed from cached packages, beside the vision tower it no longer runs (issue 48, speed).

A random-weight reranker of the chosen architecture (2B on a GPU, bf16; tiny on the CPU) ingests ``--refs``
references (as ingestion does: their packages are cached once), and :func:`rerank.tuning.fine_tune_reranker` trains
on judged cells of them, timing every step from its progress callback. Side by side:

- **packages** — the trainer as shipped: the tower never runs (its calls are counted);
- **tower in the loop** — what every public recipe pays on top: the frozen tower's forward for a step's references,
  timed on the same images through the product's vision encoder (no cache), so a step would take the sum;
- the **FLOP arithmetic** of one (statement, reference) pair: the LM's forward and backward (a frozen base with
  LoRA still needs the activations' gradients: about 4x the forward's 2 FLOPs per parameter and token) against the
  tower's forward (2 FLOPs per parameter and patch), so (LM + tower) / LM is the speed-up packages can give.

Peak GPU memory is read for the training and for a step's tower forward alone.

    python bench/fine_tune_speed.py                                  # CPU: tiny checkpoint (the bench runs)
    python bench/fine_tune_speed.py --kind square --side 448         # on a GPU: 2B, bf16
    python bench/fine_tune_speed.py --kind photo --refs 32           # 12-MP photo references
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import engine, scratch_dir  # noqa: E402
from bench.images import image, sync_for  # noqa: E402
from rubricsearch.rerank import load_reranker  # noqa: E402
from rubricsearch.rerank.tuning import JudgedCell, TuningSettings, fine_tune_reranker  # noqa: E402
from rubricsearch.retrieval.images import decode_image  # noqa: E402
from rubricsearch.retrieval.packages import PackageStore, Purpose  # noqa: E402
from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model  # noqa: E402
from rubricsearch.retrieval.tuning.loop import Progress  # noqa: E402

CRITERIA = ("short fur", "triangular ears", "dark forehead stripes")


def params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["tiny", "small", "2b"], default=None, help="default: 2b on a GPU, else tiny")
    ap.add_argument("--kind", choices=["square", "photo"], default="square")
    ap.add_argument("--side", type=int, default=None, help="square side (default 448 on a GPU, 224 on the CPU)")
    ap.add_argument("--refs", type=int, default=64, help="judged references")
    ap.add_argument("--batch", type=int, default=TuningSettings().batch, help="pairs per step")
    ap.add_argument("--steps", type=int, default=100,
                    help="at most (early stopping may end it sooner; every tenth step validates)")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", "bfloat16") if gpu else ("cpu", "float32")
    size, side = args.size or ("2b" if gpu else "tiny"), args.side or (448 if gpu else 224)
    sync = sync_for(gpu)
    root = scratch_dir("rs-fine-tune-speed-")
    ckpt = make_test_model(root / "reranker", "reranker", size=size, dtype=dtype)
    images = [decode_image(image(args.kind, side, 1000 + i)) for i in range(args.refs)]
    store = PackageStore(storage_dtype=dtype, memory_device=device)
    ingest = load_reranker(ckpt, store=store, device=device, dtype=dtype)
    ingest.packages.get_or_encode(images, purpose=Purpose.INGEST)  # as ingestion makes them, once
    runtime = engine(ingest)
    tower, lm = params(runtime.loaded.model.visual), params(runtime.loaded.model.language_model)
    step_refs = images[:args.batch]
    tower_ms: list[float] = []
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(4):  # the first a warm-up: the tower's forward for one step's references, nothing cached
        sync()
        t0 = time.perf_counter()
        runtime.vision.encode(step_refs)
        sync()
        tower_ms.append((time.perf_counter() - t0) * 1000)
    tower_peak = torch.cuda.max_memory_allocated() if gpu else 0
    patches = sum(p.grid_thw[0] * p.grid_thw[1] * p.grid_thw[2] for p in runtime.vision.encode(step_refs[:1]))
    del ingest, runtime
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    rng = random.Random(0)
    cells = [JudgedCell(i + 1, img.sha256, CRITERIA[i % len(CRITERIA)], rng.random() < 0.5)
             for i, img in enumerate(images)]
    marks: list[tuple[float, bool]] = []

    def progress(p: Progress) -> None:
        sync()
        marks.append((time.perf_counter(), p.validation is not None))

    settings = TuningSettings(steps=args.steps, batch=args.batch)
    started = time.perf_counter()
    tuned = fine_tune_reranker(ckpt, cells, store, settings=settings, device=device, progress=progress)
    train_peak = torch.cuda.max_memory_allocated() if gpu else 0
    # a step's time: from the previous step's end, leaving out the first two (warm-up) and validating steps
    steps = [(b - a) * 1000 for (a, _), (b, validated) in itertools.pairwise(marks) if not validated][2:]
    step_ms = statistics.median(steps)
    tower_step = statistics.median(tower_ms[1:])
    pkg = tuned.split.train[0].pair
    # about: the statement's words, the merged visual tokens and the prompt template's
    tokens = len(pkg.query.texts[0].split()) + patches // 4 + 64
    lm_flops, tower_flops = 4 * 2 * lm * tokens, 2 * tower * patches
    print(f"architecture={size} device={device} dtype={dtype} references={args.refs} ({args.kind}, "
          f"{'12 MP' if args.kind == 'photo' else f'{side}px'}; {patches} patches each) batch={args.batch} "
          f"steps run={tuned.steps_run} of {args.steps}; LoRA rank {settings.rank} alpha {settings.alpha}")
    print(f"vision-tower calls during training: {tuned.vision_encodes}")
    print(f"{'path':<44} {'ms/step':>9} {'pairs/s':>9} {'peak GiB':>9}")
    print(f"{'packages (as shipped)':<44} {step_ms:>9.1f} {args.batch / step_ms * 1000:>9.1f} "
          f"{train_peak / 2**30:>9.2f}")
    print(f"{'tower in the loop (step + its tower forward)':<44} {step_ms + tower_step:>9.1f} "
          f"{args.batch / (step_ms + tower_step) * 1000:>9.1f} {max(train_peak, tower_peak) / 2**30:>9.2f}")
    print(f"measured speed-up of packages: {(step_ms + tower_step) / step_ms:.2f}x; FLOP arithmetic per pair "
          f"(~{tokens} tokens; LM forward+backward {lm_flops / 1e9:.1f} GFLOP, tower forward "
          f"{tower_flops / 1e9:.1f} GFLOP): "
          f"{(lm_flops + tower_flops) / lm_flops:.2f}x")
    wall = (time.perf_counter() - started)
    print(f"training wall {wall:.1f} s; 10k judgments x 3 epochs at this rate: "
          f"{30_000 / (args.batch / step_ms * 1000) / 60:.1f} min")


if __name__ == "__main__":
    main()
