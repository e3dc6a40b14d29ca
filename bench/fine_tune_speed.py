"""Fine-tuning speed from cached packages, beside the two data paths that run the vision tower (issue 48, speed).

A random-weight reranker of the chosen architecture (2B on a GPU, bf16; tiny on the CPU) ingests ``--refs``
references (as ingestion does: their packages are cached once), and :func:`rerank.tuning.fine_tune_reranker` trains
on judged cells of them once per path, timing ``--steps`` steps (after two warm-up steps) from its progress
callback, which then stops the training (the schedule's first validation lies beyond them):

- **packages** — the trainer as shipped: the tower never runs (its calls are counted and printed);
- **tower in the loop** — the same trainer, and after every step the frozen tower's forward over a step's worth
  of references on the trained model's own tower (pixels made once: the tower alone is what it adds);
- **public recipe** — the same trainer, and for every step the data path of the ms-swift / Sentence Transformers
  recipes: each reference's file decoded and resized by the official processor (``qwen_vl_utils.fetch_image``
  and the checkpoint's image processor) every epoch, in one background worker overlapping the step (a recipe's
  data-loader worker), then the tower on the result.

The extra work runs inside the training (the progress callback), so a path's step time and its peak GPU memory
(reset between paths) are those of the whole loop, not a sum of separate timings. ``--profile N`` runs
torch.profiler over N more steps of the packages path.

The FLOP arithmetic comes first, from the model's config (:mod:`bench.flops`) and the token ids the trainer's
forward runs (:meth:`rerank.local.LocalScoringRuntime.plan`: shared-prefix groups, padding): the LM's forward and
backward of one pair (a frozen base with LoRA computes the activations' gradients, about the forward again, and no
weight gradients) against the tower's forward of its reference. MFU: a step's model FLOPs (the tower's too where
it runs) over its time and the H100's dense bf16 peak, :data:`PEAK_SPEC_TFLOPS`.

    python bench/fine_tune_speed.py                                             # CPU: tiny checkpoint
    python bench/fine_tune_speed.py --checkpoint /tmp/rr2b --side 448           # a GPU: 2B, bf16
    python bench/fine_tune_speed.py --checkpoint /tmp/rr2b --kind photo --refs 16 --batch 4
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import rubricsearch.rerank.tuning.trainer as trainer_module  # noqa: E402
from bench.common import engine, scratch_dir  # noqa: E402
from bench.flops import lm_flops, vision_flops  # noqa: E402
from bench.images import image, sync_for  # noqa: E402
from rubricsearch.app.model_loading import model_config  # noqa: E402
from rubricsearch.app.settings import Settings  # noqa: E402
from rubricsearch.rerank import load_reranker  # noqa: E402
from rubricsearch.rerank.task import RERANK_MAX_LENGTH  # noqa: E402
from rubricsearch.rerank.tuning import JudgedCell, fine_tune_reranker  # noqa: E402
from rubricsearch.rerank.tuning.cells import Example, example  # noqa: E402
from rubricsearch.rerank.tuning.trainer import unjudged  # noqa: E402
from rubricsearch.retrieval.images import decode_image  # noqa: E402
from rubricsearch.retrieval.packages import PackageStore, Purpose  # noqa: E402
from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder  # noqa: E402
from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model  # noqa: E402
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen  # noqa: E402
from rubricsearch.retrieval.runtime.config import LocalConfig  # noqa: E402
from rubricsearch.retrieval.runtime.core import Truncation  # noqa: E402
from rubricsearch.retrieval.tuning.loop import Progress, TowerCalls  # noqa: E402
from rubricsearch.retrieval.tuning.settings import DEFAULTS  # noqa: E402

CRITERIA = ("short fur", "triangular ears", "dark forehead stripes")
PATHS = ("packages", "tower", "recipe")
LABELS = {"packages": "packages (as shipped)", "tower": "tower in the loop", "recipe": "public recipe (decode+resize)"}
PEAK_SPEC_TFLOPS = 989.0  # H100 SXM dense bf16: the denominator MFU is quoted against
BACKWARD = 1.0  # the backward's share of the forward: activations' gradients only (the base gets none)
JUDGMENTS, EPOCHS = 10_000, 3
WARM_UP = 2  # steps of each path not timed (allocator, kernels' first runs)


@dataclass(frozen=True)
class StepWork:
    """What one training step computes, averaged over the step batches of the training cells."""

    pairs: int  # judged pairs
    rows: int  # rows the forward runs: the judged pairs and as many of the base's answers kept (``preserve``)
    tokens: float  # every row's own tokens
    run: float  # tokens the forward runs (a shared prefix once per group)
    slots: float  # padded positions of the passes (rows of a pass padded to its longest)
    lm_flops: float  # forward + backward of the language model
    tower_flops: float  # the tower's forward over every row's reference (a recipe's example loads its image)

    @property
    def padding(self) -> float:
        return 1 - self.run / self.slots


def _padded(lengths: Sequence[int], rows: int) -> int:
    ordered = sorted(lengths)
    return sum(max(ordered[i:i + rows]) * len(ordered[i:i + rows]) for i in range(0, len(ordered), rows))


def step_work(runtime: Any, examples: Sequence[Example], packages: dict[str, Any], batch: int) -> StepWork:
    """The trainer's forward plan (:meth:`LocalScoringRuntime.plan`) of each ``batch`` of ``examples`` with the
    rows its loss adds (as many unjudged cells, the base's answers kept: :func:`rerank.tuning.trainer.unjudged`):
    tokens, padding, and model FLOPs. A continuation's attention over its group's prefix is left out (under 1 %
    of a pair's FLOPs at these lengths)."""
    model = runtime.loaded.model
    lm, text = model.language_model, model.config.text_config
    rows = runtime.batch_size
    steps = [examples[i:i + batch] for i in range(0, len(examples) - batch + 1, batch)] or [examples]
    kept = unjudged(examples) if DEFAULTS["reranker"].preserve > 0 else []
    draw = random.Random(0)
    totals = [0.0] * 5
    for judged in steps:
        chunk = [*judged, *draw.sample(kept, min(len(judged), len(kept)))]
        inputs, regular, groups, _ = runtime.plan([e.pair for e in chunk], packages, Truncation(RERANK_MAX_LENGTH))
        prefixes = [len(p.ids) for p, _ in groups]
        conts = [len(c.ids) for _, cs in groups for c in cs]
        plain = [len(inputs[r].ids) for r in regular]
        run = prefixes + conts + plain
        slots = (max(prefixes) * len(prefixes) if prefixes else 0) + _padded(conts, rows) + _padded(plain, rows)
        grids = [packages[e.cell.sha256].grid_thw for e in chunk]
        for k, value in enumerate((sum(len(x.ids) for x in inputs), sum(run), slots,
                                   (1 + BACKWARD) * lm_flops(lm, text, run), vision_flops(model.visual, grids))):
            totals[k] += value
    n = len(steps)
    return StepWork(len(steps[0]), len(steps[0]) + min(len(steps[0]), len(kept)), *(t / n for t in totals))


class CapturedLoad:
    """Keeps the model the trainer loads (while in a ``with``), so the in-loop paths run its very tower between
    its steps."""

    def __init__(self) -> None:
        self.loaded: LoadedQwen | None = None
        self.counter: TowerCalls | None = None
        self._load = trainer_module.load_local

    def _loading(self, *args: Any, **kwargs: Any) -> LoadedQwen:
        self.loaded = self._load(*args, **kwargs)
        self.counter = TowerCalls(self.loaded.model.visual)  # every tower forward from here on, whoever calls it
        return self.loaded

    @property
    def tower_calls(self) -> int:
        return self.counter.calls if self.counter is not None else 0

    def __enter__(self) -> CapturedLoad:
        trainer_module.load_local = self._loading
        return self

    def __exit__(self, *exc: object) -> None:
        trainer_module.load_local = self._load
        if self.counter is not None:
            self.counter.close()
        self.loaded = None


class TowerLoop:
    """After every step: the frozen tower over the next ``batch`` references (one per row of the step), from pixels
    made once."""

    def __init__(self, loaded: LoadedQwen, images: Sequence[Any], batch: int) -> None:
        self.encoder = VisionEncoder(loaded)
        self.prepared = self.encoder.prepare(images)
        self.images, self.batch, self.step = list(images), batch, 0

    def window(self, items: Sequence[Any]) -> list[Any]:
        start = self.step * self.batch
        self.step += 1
        return [items[(start + i) % len(items)] for i in range(self.batch)]

    def __call__(self) -> None:
        self.encoder.encode(self.window(self.images), self.prepared)

    def close(self) -> None:
        self.encoder.close()


class RecipeLoop(TowerLoop):
    """After every step: the next ``batch`` files decoded and resized by the official processor (one worker,
    overlapping the step, as a recipe's data loader does), then the tower on them."""

    def __init__(self, loaded: LoadedQwen, files: Sequence[bytes], batch: int) -> None:
        self.encoder = VisionEncoder(loaded)
        self.files, self.batch, self.step = list(files), batch, 0
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="recipe-loader")
        self.next: Future[tuple[list[Any], Any]] = self.worker.submit(self._load, self.window(self.files))

    def _load(self, files: list[bytes]) -> tuple[list[Any], Any]:
        images = [decode_image(f) for f in files]
        return images, self.encoder.prepare(images)

    def __call__(self) -> None:
        images, prepared = self.next.result()
        self.next = self.worker.submit(self._load, self.window(self.files))
        self.encoder.encode(images, prepared)

    def close(self) -> None:
        self.worker.shutdown(wait=True)
        super().close()


@dataclass(frozen=True)
class Measured:
    path: str
    step_ms: float
    timed_steps: int
    steps_run: int
    peak_bytes: int
    tower_calls: int
    held_bytes: int  # allocated when the path started (before its model loads)


class Profile:
    """torch.profiler over ``count`` steps run after a path's timed ones (``start``): where a step's time goes, the
    host's operators and the device's kernels."""

    def __init__(self, count: int, gpu: bool) -> None:
        self.count, self.gpu = count, gpu
        self.first = self.last = 0
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
        self.profiler = torch.profiler.profile(activities=activities)
        self.started = self.wall = 0.0

    def start(self, after: int) -> None:
        self.first, self.last = after + 1, after + self.count

    def at(self, step: int) -> None:
        if step == self.first - 1:
            self.profiler.start()
            self.started = time.perf_counter()
        elif step == self.last:
            self.profiler.stop()
            self.wall = time.perf_counter() - self.started

    def report(self, rows: int = 20) -> None:
        if not self.wall:
            print("profile: training stopped before the profiled steps")
            return
        steps = self.last - self.first + 1
        events = self.profiler.key_averages()
        ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
        wall = self.wall / steps * 1000
        print(f"profile of {steps} steps ({wall:.1f} ms/step under the profiler):")
        if self.gpu:  # kernels run one after another on the step's stream: their sum is the device's busy time
            busy = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
            print(f"  device busy {busy / 1000 / steps:.1f} ms/step ({busy / 1000 / steps / wall:.0%} of the step)")
        kinds = [("device", "self_device_time_total")] if self.gpu else []
        for where, key in [*kinds, ("host", "self_cpu_time_total")]:
            top = sorted(ops, key=lambda e: getattr(e, key), reverse=True)[:rows]
            print(f"  operators by {where} self time (ms/step, calls/step):")
            for e in top:
                print(f"    {getattr(e, key) / 1000 / steps:>9.2f} {e.count / steps:>7.1f}  {e.key[:70]}")


def serving(device: str) -> LocalConfig:
    """The local runtime configuration a server's training job gives the trainer (the product's defaults: on a GPU
    the accelerated engine with Liger's fused kernels), on ``device``."""
    return replace(model_config(Settings(), "reranker", "local").local, device=device)


class Enough(Exception):
    """Raised from the progress callback once a path's steps are timed: the training stops there."""


def train(path: str, ckpt: Path, cells: Sequence[JudgedCell], store: PackageStore, batch: int, rows: int, timed: int,
          device: str, images: Sequence[Any], files: Sequence[bytes], sync: Callable[[], None],
          profile: Profile | None = None) -> Measured:
    """``timed`` steps of the trainer on ``path``, after :data:`WARM_UP` (and the profiled ones); the schedule's
    first validation lies beyond them, so every step run is a training step."""
    gpu = device == "cuda"
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated() if gpu else 0
    run = WARM_UP + timed + 1  # the first mark starts the first step's interval
    if profile is not None:
        profile.start(run)
        run = profile.last
    settings = replace(DEFAULTS["reranker"], steps=10 * (run + 1), batch=batch)
    captured = CapturedLoad()
    loop: TowerLoop | None = None
    marks: list[float] = []

    def progress(p: Progress) -> None:
        nonlocal loop
        if loop is None and path != "packages":  # made before the first mark: its set-up is not a step's
            loaded = captured.loaded
            assert loaded is not None
            loop = (TowerLoop(loaded, images, rows) if path == "tower" else RecipeLoop(loaded, files, rows))
        elif loop is not None:
            loop()
        sync()
        marks.append(time.perf_counter())
        if profile is not None:
            profile.at(p.step)
        if p.step >= run:
            raise Enough

    try:
        with captured:
            fine_tune_reranker(ckpt, cells, store, settings=settings, local=serving(device), progress=progress)
    except Enough:
        pass
    finally:
        if loop is not None:
            loop.close()
    peak = torch.cuda.max_memory_allocated() if gpu else 0
    # a step: from the previous step's end, leaving out the warm-up and the profiled ones
    steps = [(b - a) * 1000 for a, b in itertools.pairwise(marks[:WARM_UP + timed + 1])][WARM_UP:]
    return Measured(path, statistics.median(steps), len(steps), len(marks), peak, captured.tower_calls, held)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["tiny", "small", "2b"], default=None, help="default: 2b on a GPU, else tiny")
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="the random-weight reranker's folder: made there if missing, reused if present")
    ap.add_argument("--kind", choices=["square", "photo"], default="square")
    ap.add_argument("--side", type=int, default=None, help="square side (default 448 on a GPU, 224 on the CPU)")
    ap.add_argument("--refs", type=int, default=64, help="judged references (one cell each)")
    ap.add_argument("--batch", type=int, default=DEFAULTS["reranker"].batch, help="pairs per step")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per path (after two warm-up steps)")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"some of {','.join(PATHS)}")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile N steps of the packages path (from its fourth; left out of its timing)")
    args = ap.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    if not paths or set(paths) - set(PATHS):
        raise SystemExit(f"--paths: some of {','.join(PATHS)}")
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    dtype: Literal["bfloat16", "float32"] = "bfloat16" if gpu else "float32"
    size: Literal["tiny", "small", "2b"] = args.size or ("2b" if gpu else "tiny")
    side = args.side or (448 if gpu else 224)
    sync = sync_for(gpu)
    started = time.perf_counter()
    ckpt = args.checkpoint or scratch_dir("rs-fine-tune-speed-") / "reranker"
    if not (ckpt / "config.json").exists():
        ckpt = make_test_model(ckpt, "reranker", size=size, dtype=dtype)
    files = [image(args.kind, side, 1000 + i) for i in range(args.refs)]
    images = [decode_image(f) for f in files]
    store = PackageStore(storage_dtype=dtype, memory_device=device)
    ingest = load_reranker(ckpt, store=store, device=device, dtype=dtype)
    ingest.packages.get_or_encode(images, purpose=Purpose.INGEST)  # as ingestion makes them, once
    runtime = engine(ingest)
    rng = random.Random(0)
    cells = [JudgedCell(i + 1, img.sha256, CRITERIA[i % len(CRITERIA)], rng.random() < 0.5)
             for i, img in enumerate(images)]
    examples = [example(c) for c in cells]
    packages = runtime.packages.find([e.pair.document.images[0] for e in examples])
    work = step_work(runtime, examples, packages, args.batch)
    lm_params = sum(p.numel() for p in runtime.loaded.model.language_model.parameters())
    tower_params = sum(p.numel() for p in runtime.loaded.model.visual.parameters())
    patches = packages[cells[0].sha256].grid_thw
    ingest.close()  # its threads hold the model: the paths are measured without it
    del ingest, runtime, packages

    settings = replace(DEFAULTS["reranker"], batch=args.batch)
    lm_pair, tower_pair = work.lm_flops / work.rows, work.tower_flops / work.rows
    print(f"architecture={size} device={device} dtype={dtype} references={args.refs} ({args.kind}, "
          f"{'12 MP' if args.kind == 'photo' else f'{side}px'}; grid {patches}) batch={args.batch} "
          f"timed steps={args.steps}; LoRA rank {settings.rank} alpha {settings.alpha}; LM {lm_params / 1e6:.1f}M "
          f"tower {tower_params / 1e6:.1f}M parameters")
    print(f"FLOP arithmetic per row: {work.tokens / work.rows:.0f} tokens ({work.run / work.rows:.0f} run after "
          f"prefix sharing); LM forward+backward {lm_pair / 1e9:.1f} GFLOP, tower forward {tower_pair / 1e9:.1f} "
          f"GFLOP: (LM + tower) / LM = {(lm_pair + tower_pair) / lm_pair:.2f}x")
    print(f"per step: {work.pairs} judged pairs and {work.rows - work.pairs} answers kept (rows), {work.run:.0f} "
          f"tokens run in {work.slots:.0f} padded positions "
          f"(padding {work.padding:.1%}); LM {work.lm_flops / 1e9:.1f} GFLOP, tower "
          f"{work.tower_flops / 1e9:.1f} GFLOP; MFU against {PEAK_SPEC_TFLOPS:.0f} TFLOP/s")

    profile = Profile(args.profile, gpu) if args.profile > 0 and "packages" in paths else None
    print(f"set-up (checkpoint, ingestion, plan) {time.perf_counter() - started:.1f} s; one row per path as it ends")
    print(f"{'path':<30} {'ms/step':>9} {'pairs/s':>9} {'MFU':>6} {'peak GiB':>9} "
          f"{f'{JUDGMENTS // 1000}k x {EPOCHS} min':>12} {'timed/run':>10} {'tower calls':>12}", flush=True)
    measured: list[Measured] = []
    for path in paths:
        m = train(path, ckpt, cells, store, args.batch, work.rows, args.steps, device, images, files, sync,
                  profile if path == "packages" else None)
        measured.append(m)
        pairs_s = work.pairs / m.step_ms * 1000
        flops = work.lm_flops + (work.tower_flops if m.path != "packages" else 0.0)
        mfu = f"{flops / (m.step_ms / 1000) / (PEAK_SPEC_TFLOPS * 1e12):.3f}" if gpu else "-"
        print(f"{LABELS[m.path]:<30} {m.step_ms:>9.1f} {pairs_s:>9.1f} {mfu:>6} {m.peak_bytes / 2**30:>9.2f} "
              f"{JUDGMENTS * EPOCHS / pairs_s / 60:>12.1f} {f'{m.timed_steps}/{m.steps_run}':>10} "
              f"{m.tower_calls:>12}", flush=True)
    base = next((m for m in measured if m.path == "packages"), None)
    for m in measured:
        if base is not None and m is not base:
            print(f"packages vs {LABELS[m.path]}: measured {m.step_ms / base.step_ms:.2f}x; FLOP arithmetic "
                  f"{(work.lm_flops + work.tower_flops) / work.lm_flops:.2f}x")
    print("GPU memory allocated when each path started (the cached packages; no model): "
          + ", ".join(f"{m.path} {m.held_bytes / 2**30:.2f} GiB" for m in measured))
    if profile is not None:
        profile.report()
    print(f"bench wall {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
