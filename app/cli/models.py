"""``rubricsearch make-test-model``: offline random-weight Qwen3-VL checkpoints."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("make-test-model", help="write a random-weight Qwen3-VL checkpoint (no network)")
    p.add_argument("dir", help="output directory")
    p.add_argument("--kind", choices=["embedding", "reranker"], default="embedding")
    p.add_argument("--size", choices=["tiny", "small", "2b"], default="tiny",
                   help="tiny: fast tests; small: CPU benchmarks; "
                   "2b: the real 2B architecture (random weights) for speed work")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="weights dtype (default: float32 for tiny, bfloat16 for 2b)")
    p.set_defaults(func=run)
    t = sub.add_parser("train-demo-models",
                       help="train the small demo embedding and reranker checkpoints on generated faces (CPU, "
                       "no network)")
    t.add_argument("dir", help="output directory (DIR/demo-embedding and DIR/demo-reranker; reused if current)")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    t.add_argument("--steps", type=int, default=None, help="embedder training steps (default: the demo recipe's)")
    t.add_argument("--reranker-steps", type=int, default=None,
                   help="reranker training steps (default: the demo recipe's)")
    t.add_argument("--seed", type=int, default=None, help="the plan's seed (default: the demo's)")
    t.add_argument("--force", action="store_true", help="retrain even if DIR holds a current checkpoint")
    t.set_defaults(func=train)


def run(args: argparse.Namespace) -> int:
    from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

    dtype = args.dtype or ("bfloat16" if args.size == "2b" else "float32")
    out = make_test_model(args.dir, args.kind, size=args.size, seed=args.seed, dtype=dtype)
    print(f"wrote {args.size} {args.kind} test checkpoint to {out}")
    return 0


def train(args: argparse.Namespace) -> int:
    import dataclasses
    import logging
    from pathlib import Path

    from rubricsearch.app.demo.models import DemoPlan, build_all

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    plan = DemoPlan() if args.seed is None else DemoPlan(seed=args.seed)
    if args.steps is not None:
        plan = dataclasses.replace(plan, embedder=dataclasses.replace(plan.embedder, steps=args.steps))
    if args.reranker_steps is not None:
        plan = dataclasses.replace(plan, reranker=dataclasses.replace(plan.reranker, steps=args.reranker_steps))
    for role, path in build_all(Path(args.dir), plan, threads=args.threads, force=args.force).items():
        print(f"demo {role} checkpoint: {path}")
    return 0
