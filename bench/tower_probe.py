"""What the demo models' vision tower shows: held-out accuracy of a linear probe per attribute
(:mod:`app.demo.probe`), for each checkpoint given and a random-weight tower of the same size side by side.

The reranker keeps the embedder's tower, so this is the ceiling under what either language model can read; an
attribute the probe reads poorly (ears, at 16 visual tokens a face) is one no reranker recipe can make reliable.

    .venv/bin/python bench/tower_probe.py DIR/demo-embedding [OTHER ...] [--fit 480] [--held-out 120]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from rubricsearch.app.demo.faces import ATTRIBUTES
from rubricsearch.app.demo.probe import tower_probe


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("checkpoints", nargs="+", type=Path, help="demo embedder (or reranker) checkpoints")
    ap.add_argument("--fit", type=int, default=480, help="freshly drawn training-split faces the probe is fitted on")
    ap.add_argument("--held-out", type=int, default=120, help="faces per held-out split (eval, tune)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    print(f"settings: fit={args.fit} held_out={2 * args.held_out} features=mean+max-pooled-packages probe=linear "
          "l2=0.01 device=cpu   (held-out eval and tune splits)")
    columns = {str(c): tower_probe(c, fit=args.fit, held_out=args.held_out, threads=args.threads)
               for c in args.checkpoints}
    with tempfile.TemporaryDirectory() as tmp:
        from rubricsearch.app.demo.checkpoints import DemoPlan
        from rubricsearch.app.demo.training import Arch, base_checkpoint

        untrained = base_checkpoint(Path(tmp) / "untrained", "embedding", arch=Arch(), seed=DemoPlan().seed)
        columns["random weights"] = tower_probe(untrained, fit=args.fit, held_out=args.held_out, threads=args.threads)
    names = list(columns)
    print("| attribute | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for a in ATTRIBUTES:
        print(f"| {a} | " + " | ".join(f"{columns[n][a]:.3f}" for n in names) + " |")


if __name__ == "__main__":
    main()
