"""The set calibration on the demo truth (issue 47): do `match` and `no match` keep their stated precision on faces
the fit never saw, with a narrow uncertain band, and does the calibrated probability beat the raw score?

Judgments are derived from the held-out ``eval`` faces' true attributes (every attribute value as a statement,
"yes" where the face has it, "no" elsewhere; :mod:`app.demo.calibration_eval`); every cell is scored as the
product's refit scores it (from cached packages: the reranker's raw P(yes), as search gives it for any
checkpoint); half the faces, by reference, are fitted on and the other half graded. The same path then runs on
random-weight official-architecture checkpoints (``make_test_model``, no policy file), where it must say that
the reranker does not separate yes from no.

    .venv/bin/python bench/calibration_quality.py --embedding DIR/demo-embedding --reranker DIR/demo-reranker \
        [--docs 120] [--seed 47] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from rubricsearch.app.demo.calibration_eval import (
    SPLIT_SEED,
    HeldOutResult,
    OverSplits,
    held_out,
    judged_cells,
    over_splits,
)
from rubricsearch.app.demo.evaluation import eval_set
from rubricsearch.app.demo.search_eval import SearchBench
from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model


def measure(embedding: str, reranker: str, docs: int, seed: int
            ) -> tuple[dict[str, HeldOutResult], dict[str, OverSplits]]:
    """The cells fitted on their true answers and on shuffled ones."""
    faces, images = eval_set(docs)
    bench = SearchBench(embedding, reranker, faces, images)
    try:
        arms = {"raw P(yes)": judged_cells(bench)}
    finally:
        bench.close()
    out, spread = {}, {}
    for name, cells in arms.items():
        out[f"{name}, fit"] = held_out(cells, seed=seed)
        out[f"{name}, labels shuffled"] = held_out(cells, seed=seed, shuffle_fit_labels=True)
        spread[name] = over_splits(cells)
    return out, spread


def line(name: str, r: HeldOutResult) -> str:
    def f(x: float | None) -> str:
        return "–" if x is None else f"{x:.3f}"

    b = r.band
    return (f"| {name} | {r.status} | {r.method or '–'} | {r.fitted_on} / {r.held_out} | {f(b.auc)} | "
            f"{f(b.match_precision)} ({b.matches}) | {f(b.no_match_precision)} ({b.no_matches}) | "
            f"{b.share_uncertain:.3f} | {r.log_loss_raw:.4f} → {f(r.log_loss_calibrated)} | "
            f"{r.ece_raw:.4f} → {f(r.ece_calibrated)} | {r.vision_encodes} | {r.skipped} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--embedding", required=True)
    ap.add_argument("--reranker", required=True)
    ap.add_argument("--docs", type=int, default=120)
    ap.add_argument("--seed", type=int, default=SPLIT_SEED)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    started = time.monotonic()
    report = {"demo": measure(args.embedding, args.reranker, args.docs, args.seed)}
    with tempfile.TemporaryDirectory(prefix="calibration-random-") as tmp:
        emb = make_test_model(Path(tmp) / "embedding", "embedding", seed=0)
        rr = make_test_model(Path(tmp) / "reranker", "reranker", seed=0)
        report["random_weights"] = measure(str(emb), str(rr), args.docs, args.seed)
    print("| models | arm | status | method | cells fitted / held out | AUC | match precision (n) | "
          "no-match precision (n) | uncertain | log-loss raw → calibrated | ECE raw → calibrated | encodes | skipped |")
    print("|---|---|---|---|---|---:|---:|---:|---:|---|---|---:|---:|")
    for models, (arms, _) in report.items():
        for arm, r in arms.items():
            print(line(f"{models} | {arm}", r))
    for models, (arms, _) in report.items():
        for arm, r in arms.items():
            print(f"{models}, {arm}: {r.reason}")
    print("\nover ten halvings of the faces: | models | cells | match precision mean (worst) | no-match precision "
          "mean (worst) | worst share uncertain | mean log-loss raw → calibrated |")
    for models, (_, spread) in report.items():
        for arm, o in spread.items():
            print(f"| {models} | {arm} | {o.match_precision:.3f} ({o.worst_match_precision:.3f}) | "
                  f"{o.no_match_precision:.3f} ({o.worst_no_match_precision:.3f}) | {o.worst_share_uncertain:.3f} | "
                  f"{o.log_loss_raw:.4f} → {o.log_loss_calibrated:.4f} |")
    print(f"({time.monotonic() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({m: {"arms": {a: asdict(r) for a, r in arms.items()},
                                             "over_splits": {a: asdict(o) for a, o in spread.items()}}
                                         for m, (arms, spread) in report.items()}, indent=2))


if __name__ == "__main__":
    main()
