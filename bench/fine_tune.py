"""Fine-tuning the reranker or the embedder from judgments and cached packages (issue 48) on the demo truth: does a
criterion the demo model is weak at get better on held-out faces, at what learning rate, how fast on this CPU, with
how many vision encodes (0), and what happens to the other criteria?

N references of the ``tune`` split (never trained on by the demo models) are judged on the weakest criterion
(the one whose AUC on the held-out ``eval`` faces is lowest before training, unless ``--criterion`` names one):
"yes" where the face has the attribute. Packages of every face are made once, as ingestion makes them; then
:func:`rerank.tuning.fine_tune_reranker` trains for each learning rate, the version is saved and loaded as the
product loads a checkpoint, and every criterion is scored on the eval faces before and after (raw P(yes)).

    .venv/bin/python bench/fine_tune.py --reranker /work/demo-models/demo-reranker [--n 100] [--lrs 3e-4,1e-3]
        [--steps 200] [--eval 200] [--criterion TEXT] [--seed 48] [--json FILE]

``--model embedder --embedder /work/demo-models/demo-embedding`` does the same for the embedder
(:func:`retrieval.tuning.embedder.fine_tune_embedder`): the weakest criterion is the one whose eval faces the base
ranks worst (nDCG@10 of the criterion's query, as search embeds it, over every eval face; relevant: the faces
that meet it), and every criterion is ranked before and after through the saved version; ``--pulls`` sweeps
the weight of the pull back to the base's vectors (:data:`retrieval.tuning.embedder.PULL`) beside the
learning rates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rubricsearch.app.demo.faces import ATTRIBUTES, DEFAULT_SIZE, VALUES, Criterion, draw_face, faces, png_bytes  # noqa: E402
from rubricsearch.rerank import load_reranker  # noqa: E402
from rubricsearch.rerank.metrics import auc, log_loss  # noqa: E402
from rubricsearch.rerank.tuning import JudgedCell, fine_tune_reranker, save_version  # noqa: E402
from rubricsearch.rerank.tuning.cells import example  # noqa: E402
from rubricsearch.retrieval.embedding import load_embedder  # noqa: E402
from rubricsearch.retrieval.images import decode_image  # noqa: E402
from rubricsearch.retrieval.packages import PackageStore, Purpose, Usage  # noqa: E402
from rubricsearch.retrieval.qwen.model.prompts import Content  # noqa: E402
from rubricsearch.retrieval.runtime.config import LocalConfig  # noqa: E402
from rubricsearch.retrieval.tuning.contrastive import Criterion as Judged  # noqa: E402
from rubricsearch.retrieval.tuning.contrastive import query_instruction, ranking  # noqa: E402
from rubricsearch.retrieval.tuning.embedder import (  # noqa: E402
    PULL,
    TEMPERATURE,
    fine_tune_embedder,
    save_embedder_version,
)
from rubricsearch.retrieval.tuning.loop import Progress  # noqa: E402
from rubricsearch.retrieval.tuning.settings import DEFAULTS  # noqa: E402

EVAL_SEED, TUNE_SEED = 11, 48
CPU = LocalConfig(device="cpu")  # the learning numbers are the 2-core CPU's


def criteria() -> list[Criterion]:
    """Every attribute value as a statement; "no forehead stripes" (the plain value) asks the reranker the same
    statement as "dark forehead stripes" with the answer flipped, so only the latter is asked."""
    return [c for c in (Criterion(a, v) for a in ATTRIBUTES for v in VALUES[a]) if not c.negative]


def drawn(split: Any, count: int, seed: int) -> tuple[list[Any], list[Any]]:
    chosen = faces(split, count, seed=seed)
    return chosen, [decode_image(png_bytes(draw_face(f, size=DEFAULT_SIZE, seed=seed))) for f in chosen]


def quality(model: Path, store: PackageStore, eval_faces: list[Any], eval_images: list[Any],
            asked: list[Criterion]) -> tuple[dict[str, tuple[float, float]], int]:
    """Per criterion, (AUC, log-loss) of the raw P(yes) on the eval faces; and the vision encodes it caused."""
    reranker = load_reranker(model, store=store, device="cpu", dtype="float32")
    usage = Usage()
    out = {}
    for c in asked:
        cells = [JudgedCell(0, img.sha256, c.text, c.holds(f)) for f, img in zip(eval_faces, eval_images, strict=True)]
        rows = [example(cell) for cell in cells]
        scores = reranker.score_pairs([r.pair for r in rows], usage=usage)
        labels = [r.yes for r in rows]
        out[c.text] = (auc(scores, labels), log_loss(scores, labels))
    return out, usage.total()


def ranked(model: Path, store: PackageStore, eval_faces: list[Any], eval_images: list[Any], asked: list[Criterion]
           ) -> tuple[dict[str, tuple[float, float]], int]:
    """Per criterion, (nDCG@10, recall@10) of its query over every eval face; and the vision encodes it caused."""
    embedder = load_embedder(model, store=store, device="cpu", dtype="float32")
    usage = Usage()
    docs = embedder.embed_contents([Content(images=[img]) for img in eval_images], [None] * len(eval_images),
                                   usage=usage)
    queries = embedder.embed_contents([Content(texts=[c.text]) for c in asked],
                                      [query_instruction(c.text) for c in asked], usage=usage)
    shas = [img.sha256 for img in eval_images]
    out = {}
    for i, c in enumerate(asked):
        yes = frozenset(img.sha256 for f, img in zip(eval_faces, eval_images, strict=True) if c.holds(f))
        m = ranking([Judged(c.text, yes, frozenset(shas) - yes)], queries[i:i + 1] @ docs.T, shas, TEMPERATURE)
        out[c.text] = (m.ndcg, m.recall)
    embedder.close()
    return out, usage.total()


def shown(p: Progress) -> None:
    if p.validation is not None:
        print(f"  step {p.step}/{p.steps}: loss {p.loss:.4f}, validation {p.metric} {p.validation:.4f}",
              file=sys.stderr, flush=True)


def run_embedder(args: argparse.Namespace) -> None:
    started = time.monotonic()
    eval_faces, eval_images = drawn("eval", args.eval, EVAL_SEED)
    tune_faces, tune_images = drawn("tune", args.n, TUNE_SEED)
    store = PackageStore(storage_dtype="float32", memory_device="cpu")
    ingest = load_embedder(args.embedder, store=store, device="cpu", dtype="float32")
    ingest.packages.get_or_encode(eval_images + tune_images, purpose=Purpose.INGEST)  # as ingestion makes them
    ingest.close()
    asked = [c for c in criteria() if any(c.holds(f) for f in eval_faces)]
    base, _ = ranked(args.embedder, store, eval_faces, eval_images, asked)
    weak = (min(asked, key=lambda c: base[c.text][0]) if args.criterion is None
            else next(c for c in asked if c.text == args.criterion))
    cells = [JudgedCell(i + 1, img.sha256, weak.text, weak.holds(f))
             for i, (f, img) in enumerate(zip(tune_faces, tune_images, strict=True))]
    print(f"criterion {weak.text!r}: {sum(c.holds for c in cells)} yes / {len(cells)} judged tune faces; "
          f"{args.eval} eval faces; base eval nDCG@10 {base[weak.text][0]:.3f} (every criterion: "
          + ", ".join(f"{t} {n:.2f}" for t, (n, _) in base.items()) + ")")
    print(f"settings: threads={torch.get_num_threads()} device=cpu dtype=float32 batch={args.batch} "
          f"steps<={args.steps} seed={args.seed} temperature={TEMPERATURE}")
    print("| lr | pull | steps run (best) | train wall s (load) | encodes | card nDCG@10 before → after | "
          "card recall@10 | eval nDCG@10 before → after | eval recall@10 | other criteria eval nDCG@10 mean "
          "(worst change) |")
    print("|---|---:|---|---:|---:|---|---|---|---|---|")
    others = [c.text for c in asked if c.text != weak.text]

    def train(lr: float, pull: float) -> Callable[[], Any]:
        settings = replace(DEFAULTS["embedder"], lr=lr, steps=args.steps, batch=args.batch, seed=args.seed)
        return lambda: fine_tune_embedder(args.embedder, cells, store, settings=settings, local=CPU, progress=shown,
                                          pull=pull)

    def columns(card: dict[str, Any], after: dict[str, tuple[float, float]], encodes: int) -> str:
        b, a = card["metrics"]["before"], card["metrics"]["after"]
        changes = [after[t][0] - base[t][0] for t in others]
        return (f"{card['settings']['pull']:g} | {card['training']['steps_run']} ({card['training']['best_step']}) "
                f"| {card['wall_s']:.1f} ({os.getloadavg()[0]:.1f}) | {card['vision_encodes']} + {encodes} ranking | "
                f"{b['ndcg@10']} → {a['ndcg@10']} | {b['recall@10']} → {a['recall@10']} | "
                f"{base[weak.text][0]:.3f} → {after[weak.text][0]:.3f} | "
                f"{base[weak.text][1]:.3f} → {after[weak.text][1]:.3f} | "
                f"{np.mean([base[t][0] for t in others]):.3f} → {np.mean([after[t][0] for t in others]):.3f} "
                f"({min(changes):+.3f}) |")

    runs = [(lr, train(lr, p)) for lr in _floats(args.lrs) for p in _floats(args.pulls)]
    report = {"model": "embedder", "criterion": weak.text, "n": args.n, "eval": args.eval, "base": base,
              "runs": sweep(runs, save_embedder_version,
                            lambda version: ranked(version, store, eval_faces, eval_images, asked), columns)}
    print(f"({time.monotonic() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=float))


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def sweep(runs: list[tuple[float, Callable[[], Any]]], save: Callable[[Any, Path], dict[str, Any]],
          measure: Callable[[Path], tuple[dict[str, tuple[float, float]], int]],
          columns: Callable[[dict[str, Any], dict[str, tuple[float, float]], int], str]) -> list[dict[str, Any]]:
    """Train each run (its learning rate, and how it trains), save the version, measure it as the product loads
    it, and print its table row: ``| lr | columns(card, measured, encodes)``."""
    out = []
    for lr, train in runs:
        tuned = train()
        with tempfile.TemporaryDirectory(prefix="fine-tune-bench-") as tmp:
            card = save(tuned, Path(tmp) / "version")
            after, encodes = measure(Path(tmp) / "version")
        print(f"| {lr:g} | {columns(card, after, encodes)}", flush=True)
        out.append({"lr": lr, "card": {k: v for k, v in card.items() if k != "data"}, "after": after,
                    "train_wall_s": tuned.wall_s, "load_average": os.getloadavg()[0]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", choices=("reranker", "embedder"), default="reranker")
    ap.add_argument("--reranker", type=Path, default=None)
    ap.add_argument("--embedder", type=Path, default=None)
    ap.add_argument("--n", type=int, default=100, help="judged references (one judgment each)")
    ap.add_argument("--eval", type=int, default=200, help="held-out eval faces scored before and after")
    ap.add_argument("--lrs", default="1e-3", help="learning rates, comma-separated (one run each)")
    ap.add_argument("--pulls", default=str(PULL),
                    help="embedder: weights of the pull to the base's reference vectors, comma-separated")
    ap.add_argument("--steps", type=int, default=None, help="default: the trainer's")
    ap.add_argument("--batch", type=int, default=DEFAULTS["reranker"].batch)
    ap.add_argument("--criterion", default=None, help="the criterion to judge (default: the weakest on eval)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    args.steps = args.steps or DEFAULTS[args.model].steps
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model == "embedder":
        if args.embedder is None:
            sys.exit("--model embedder needs --embedder DIR")
        run_embedder(args)
        return
    if args.reranker is None:
        sys.exit("--model reranker needs --reranker DIR")
    started = time.monotonic()
    eval_faces, eval_images = drawn("eval", args.eval, EVAL_SEED)
    tune_faces, tune_images = drawn("tune", args.n, TUNE_SEED)
    store = PackageStore(storage_dtype="float32", memory_device="cpu")
    ingest = load_reranker(args.reranker, store=store, device="cpu", dtype="float32")
    ingest.packages.get_or_encode(eval_images + tune_images, purpose=Purpose.INGEST)  # as ingestion makes them
    del ingest
    asked = criteria()
    base, base_encodes = quality(args.reranker, store, eval_faces, eval_images, asked)
    if args.criterion is None:
        weak = min(asked, key=lambda c: base[c.text][0])
    else:
        named = [c for c in asked if c.text == args.criterion]
        if not named:
            sys.exit(f"no criterion {args.criterion!r}: one of {[c.text for c in asked]}")
        weak = named[0]
    cells = [JudgedCell(i + 1, img.sha256, weak.text, weak.holds(f))
             for i, (f, img) in enumerate(zip(tune_faces, tune_images, strict=True))]
    print(f"criterion {weak.text!r}: {sum(c.holds for c in cells)} yes / {len(cells)} judged tune faces; "
          f"{args.eval} eval faces; base eval AUC {base[weak.text][0]:.3f} (every criterion: "
          + ", ".join(f"{t} {a:.2f}" for t, (a, _) in base.items()) + ")")
    print(f"settings: threads={torch.get_num_threads()} device=cpu dtype=float32 batch={args.batch} "
          f"steps<={args.steps} seed={args.seed}")
    print("| lr | steps run (best) | train wall s | encodes | card held-out AUC before → after | card log-loss "
          "before → after | eval AUC before → after | eval log-loss before → after | other criteria eval AUC "
          "mean (worst change) |")
    print("|---|---|---:|---:|---|---|---|---|---|")
    others = [c.text for c in asked if c.text != weak.text]

    def train(lr: float) -> Callable[[], Any]:
        settings = replace(DEFAULTS["reranker"], lr=lr, steps=args.steps, batch=args.batch, seed=args.seed)
        return lambda: fine_tune_reranker(args.reranker, cells, store, settings=settings, local=CPU)

    def columns(card: dict[str, Any], after: dict[str, tuple[float, float]], encodes: int) -> str:
        before_m, after_m = card["metrics"]["before"], card["metrics"]["after"]
        changes = [after[t][0] - base[t][0] for t in others]
        return (f"{card['training']['steps_run']} ({card['training']['best_step']}) | {card['wall_s']:.1f} | "
                f"{card['vision_encodes']} + {encodes} scoring | {before_m['auc']} → {after_m['auc']} | "
                f"{before_m['log_loss']} → {after_m['log_loss']} | "
                f"{base[weak.text][0]:.3f} → {after[weak.text][0]:.3f} | "
                f"{base[weak.text][1]:.3f} → {after[weak.text][1]:.3f} | "
                f"{np.mean([base[t][0] for t in others]):.3f} → {np.mean([after[t][0] for t in others]):.3f} "
                f"({min(changes):+.3f}) |")

    report = {"criterion": weak.text, "n": args.n, "eval": args.eval, "base": base, "base_encodes": base_encodes,
              "runs": sweep([(lr, train(lr)) for lr in _floats(args.lrs)], save_version,
                            lambda version: quality(version, store, eval_faces, eval_images, asked), columns)}
    print(f"({time.monotonic() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=float))


if __name__ == "__main__":
    main()
