"""The learning test (issue 48) as a curve: the demo reranker taught the collar, an attribute the demo models never
saw, from N = 25, 50, 100, 200 judged references (:mod:`app.demo.learning`).

Per N and seed: the collar criteria's held-out AUC before → after, the share of two-criterion rubrics with a
collar criterion whose top 5 all meet both, every search kind's nDCG@10 and every other criterion's AUC on the
standard held-out faces (the worst change), the training's wall time and vision encodes. First, a linear probe on
the packages: how well the frozen tower carries the collar, against attributes the demo models did learn.

    .venv/bin/python bench/learning_curve.py --embedding /work/demo-models/demo-embedding \
        --reranker /work/demo-models/demo-reranker [--ns 25,50,100,200] [--seeds 0] [--lr 3e-4] [--steps 200]
        [--preserve 1] [--others 1] [--held-out 150] [--threads 2] [--json FILE] [--keep DIR] [--diagnose]
        [--versions DIR,...]

``--keep DIR`` saves each version (DIR/n{N}-seed{S}); ``--diagnose`` prints why each version's collar rubrics
miss in the top 5 (:mod:`app.demo.learning_diagnosis`); ``--versions`` measures saved versions instead of training.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rubricsearch.app.demo.learning import Learning, Measured, probe  # noqa: E402
from rubricsearch.app.demo.learning_diagnosis import diagnose  # noqa: E402
from rubricsearch.retrieval.tuning.settings import DEFAULTS  # noqa: E402


def changes(before: Measured, after: Measured) -> tuple[float, float, float]:
    """The worst change of a search kind's nDCG@10, its standard error (paired: the same queries before and after)
    and the worst change of another criterion's AUC."""
    diffs = {k: np.subtract(after.kinds_queries[k], before.kinds_queries[k]) for k in before.kinds_queries}
    worst = min(diffs, key=lambda k: float(diffs[k].mean()))
    error = float(diffs[worst].std(ddof=1) / np.sqrt(len(diffs[worst]))) if len(diffs[worst]) > 1 else float("nan")
    others = min(after.other_auc[c] - before.other_auc[c] for c in before.other_auc)
    return float(diffs[worst].mean()), error, others


def row(label: str, m: Measured, base: Measured, wall: str, encodes: str) -> str:
    kinds, error, others = changes(base, m)
    return (f"| {label} | " + " | ".join(f"{v:.3f}" for v in m.collar_auc.values())
            + f" | {m.rubric_top5:.2f} | " + " | ".join(f"{v:.3f}" for v in m.kinds_ndcg10.values())
            + f" | {kinds:+.3f} ± {error:.3f} | {float(np.mean(list(m.other_auc.values()))):.3f} ({others:+.3f}) | "
            + f"{wall} | {encodes} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--embedding", type=Path, required=True)
    ap.add_argument("--reranker", type=Path, required=True)
    ap.add_argument("--ns", default="25,50,100,200", help="judged references, comma-separated")
    ap.add_argument("--seeds", default="0", help="training seeds, comma-separated (one curve each)")
    ap.add_argument("--lr", type=float, default=DEFAULTS["reranker"].lr)
    ap.add_argument("--steps", type=int, default=DEFAULTS["reranker"].steps)
    ap.add_argument("--preserve", type=float, default=DEFAULTS["reranker"].preserve,
                    help="weight of the base's answers on the unjudged cells (0: judged cells alone)")
    ap.add_argument("--others", type=int, default=1, help="other criteria judged per reference (13: all)")
    ap.add_argument("--held-out", type=int, default=150, help="held-out collar faces")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", type=Path, default=None, help="save each version under this folder")
    ap.add_argument("--diagnose", action="store_true", help="print each version's rubric top-5 misses")
    ap.add_argument("--versions", default=None, help="saved versions to measure, comma-separated (no training)")
    args = ap.parse_args()
    if args.diagnose and not (args.keep or args.versions):
        ap.error("--diagnose needs --keep (the trained versions) or --versions")
    if args.threads:
        torch.set_num_threads(args.threads)
    ns = [int(x) for x in args.ns.split(",")]
    started = time.monotonic()
    learning = Learning(args.embedding, args.reranker, pool=max(ns), held_out=args.held_out)
    probed = probe(learning)
    print(f"settings: threads={torch.get_num_threads()} device=cpu dtype=float32 lr={args.lr:g} "
          f"preserve={args.preserve:g} steps<={args.steps} batch={DEFAULTS['reranker'].batch} pool={max(ns)} "
          f"held_out={args.held_out} rubrics={len(learning.rubric_queries)} seeds={args.seeds} others={args.others}")
    print(f"packaging: {learning.packaging_encodes} vision encodes (every image once)")
    print("linear probe on the packages, held-out accuracy: "
          + ", ".join(f"{a} {v:.3f}" for a, v in probed.items()) + " (chance: collar 0.33, stripes 0.5, fur 0.2)")
    base = learning.measure()
    kinds = list(base.kinds_ndcg10)
    print("| N (seed) | " + " | ".join(f"AUC {c}" for c in base.collar_auc)
          + " | rubric top 5 all meet both | " + " | ".join(f"nDCG@10 {k}" for k in kinds)
          + " | worst kind change (± paired SE) | other criteria AUC mean (worst change) "
          "| training wall s (steps, best) | vision encodes |")
    print("|---|" + "---:|" * (len(base.collar_auc) + len(kinds) + 5))
    print(row("base", base, base, "", f"{learning.encodes() - learning.packaging_encodes}"), flush=True)
    report: dict[str, Any] = {"probe": probed, "base": base.to_json(), "runs": []}
    base_scores = learning.collar_scores() if args.diagnose else {}

    def diagnosed(version: Path, run: dict[str, Any]) -> None:
        if not args.diagnose:
            return
        learning.use(version)
        try:
            lines, run["diagnosis"] = diagnose(learning.collared.docs, base_scores, learning.collar_scores(),
                                               learning.rubric_queries)
        finally:
            learning.use(learning.base)
        print("\n".join(lines), flush=True)

    for version in [Path(v) for v in args.versions.split(",")] if args.versions else []:
        measured = learning.measure_version(version)
        print(row(str(version), measured, base, "", ""), flush=True)
        report["runs"].append({"version": str(version), **measured.to_json()})
        diagnosed(version, report["runs"][-1])
    for seed in (int(x) for x in args.seeds.split(",")) if not args.versions else ():
        settings = replace(DEFAULTS["reranker"], lr=args.lr, steps=args.steps, seed=seed, preserve=args.preserve)
        for n in ns:
            before = learning.encodes()
            keep = args.keep / f"n{n}-seed{seed}" if args.keep else None
            measured, tuned = learning.train(n, settings, args.others, keep=keep)
            scoring = learning.encodes() - before
            print(row(f"{n} ({seed})", measured, base, f"{tuned.wall_s:.1f} ({tuned.steps_run} steps, best "
                      f"{tuned.best_step})", f"{tuned.vision_encodes} + {scoring} scoring"), flush=True)
            report["runs"].append({"n": n, "seed": seed, "wall_s": tuned.wall_s, "steps_run": tuned.steps_run,
                                   "best_step": tuned.best_step, "encodes": tuned.vision_encodes,
                                   "scoring_encodes": scoring, **measured.to_json()})
            if keep is not None:
                diagnosed(keep, report["runs"][-1])
            if args.json:  # after every run: a long curve killed half way keeps what it measured
                args.json.write_text(json.dumps(report, indent=2))
    learning.close()
    print(f"({time.monotonic() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
