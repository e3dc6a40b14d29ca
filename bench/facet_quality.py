"""Facet quality: per-attribute accuracy of facets computed from cached packages on the held-out generated
faces, for the trained demo reranker and a random-weight one of the same size side by side.

The schema is the faces' five attributes with the demo criteria as value descriptions
(:func:`app.demo.facet_eval.demo_schema`); facets come from the facet job's computation
(:func:`indexer.jobs.facets.compute_facets`). "chance" is the most frequent true value's share. With random
weights nothing about quality is claimed: that column is the line the trained model has to clear.

    .venv/bin/python bench/facet_quality.py --reranker DIR/demo-reranker [--baseline UNTRAINED] [--docs 120]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict
from pathlib import Path

from app.demo.evaluation import eval_set
from app.demo.faces import ATTRIBUTES
from app.demo.facet_eval import FacetQuality, facet_quality


def table(model: FacetQuality, baseline: FacetQuality | None) -> str:
    lines = ["| attribute | trained | random weights | chance |", "|---|---:|---:|---:|"]
    for attr in ATTRIBUTES:
        base = f"{baseline.accuracy[attr]:.3f}" if baseline is not None else "–"
        lines.append(f"| {attr} | {model.accuracy[attr]:.3f} | {base} | {model.chance[attr]:.3f} |")
    base_mean = f"{baseline.mean:.3f}" if baseline is not None else "–"
    chance = sum(model.chance.values()) / len(model.chance)
    lines.append(f"| mean | {model.mean:.3f} | {base_mean} | {chance:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--reranker", required=True, help="the trained demo reranker checkpoint")
    ap.add_argument("--baseline", default=None, help="a random-weight reranker of the same size (default: "
                    "built here from the demo plan's architecture and seed)")
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
            from app.demo.models import DemoPlan
            from app.demo.training import Arch, base_checkpoint

            baseline_path = str(base_checkpoint(Path(tmp) / "untrained", "reranker", arch=Arch(),
                                                seed=DemoPlan().seed))
        baseline = facet_quality(baseline_path, docs, images)
    print(table(model, baseline))
    print(f"vision encodes during the facet computation: trained {model.vision_encodes}, "
          f"random {baseline.vision_encodes}")
    if args.json:
        args.json.write_text(json.dumps({"model": asdict(model), "baseline": asdict(baseline)}, indent=2))


if __name__ == "__main__":
    main()
