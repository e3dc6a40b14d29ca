"""Facet quality: per-attribute accuracy of facets computed from cached packages on the held-out generated
faces, for the trained demo reranker and a random-weight one of the same size side by side.

The schema is the faces' five attributes with the demo criteria as value descriptions
(:func:`app.demo.facet_eval.demo_schema`); facets come from the facet job's computation
(:func:`indexer.jobs.facets.compute_facets`). "chance" is the most frequent true value's share. With random
weights nothing about quality is claimed: that column is the line the trained model has to clear. With
``--embedding``, the embedder's zero-shot choice per attribute is printed beside it (the alternative the facets
do not use).

    .venv/bin/python bench/facet_quality.py --reranker DIR/demo-reranker [--embedding DIR/demo-embedding]
        [--baseline UNTRAINED] [--docs 120]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict
from pathlib import Path

from rubricsearch.app.demo.evaluation import eval_set
from rubricsearch.app.demo.faces import ATTRIBUTES
from rubricsearch.app.demo.facet_eval import FacetQuality, facet_quality, zero_shot_accuracy


def table(model: FacetQuality, baseline: FacetQuality, zero_shot: dict[str, float] | None) -> str:
    lines = ["| attribute | trained | random weights | chance | embedder zero-shot |", "|---|---:|---:|---:|---:|"]
    for attr in ATTRIBUTES:
        zs = f"{zero_shot[attr]:.3f}" if zero_shot else "–"
        lines.append(f"| {attr} | {model.accuracy[attr]:.3f} | {baseline.accuracy[attr]:.3f} | "
                     f"{model.chance[attr]:.3f} | {zs} |")
    chance = sum(model.chance.values()) / len(model.chance)
    zs_mean = f"{sum(zero_shot.values()) / len(zero_shot):.3f}" if zero_shot else "–"
    lines.append(f"| mean | {model.mean:.3f} | {baseline.mean:.3f} | {chance:.3f} | {zs_mean} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--reranker", required=True, help="the trained demo reranker checkpoint")
    ap.add_argument("--baseline", default=None, help="a random-weight reranker of the same size (default: "
                    "built here from the demo plan's architecture and seed)")
    ap.add_argument("--embedding", default=None, help="the trained demo embedder, for its zero-shot column")
    ap.add_argument("--docs", type=int, default=120)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    print(f"settings: docs={args.docs} attributes=5 package_storage_dtype=float32 device=cpu   (held-out eval "
          "split; one LM pass per reference x value from cached packages)")
    docs, images = eval_set(args.docs)
    model = facet_quality(args.reranker, docs, images)
    with tempfile.TemporaryDirectory() as tmp:
        baseline_path = args.baseline
        if baseline_path is None:
            from rubricsearch.app.demo.checkpoints import DemoPlan
            from rubricsearch.app.demo.training import Arch, base_checkpoint

            baseline_path = str(base_checkpoint(Path(tmp) / "untrained", "reranker", arch=Arch(),
                                                seed=DemoPlan().seed))
        baseline = facet_quality(baseline_path, docs, images)
    zero_shot = zero_shot_accuracy(args.embedding, docs, images) if args.embedding else None
    print(table(model, baseline, zero_shot))
    print(f"vision encodes during the facet computation: trained {model.vision_encodes}, "
          f"random {baseline.vision_encodes}")
    if args.json:
        args.json.write_text(json.dumps({"model": asdict(model), "baseline": asdict(baseline)}, indent=2))


if __name__ == "__main__":
    main()
