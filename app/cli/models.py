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


def run(args: argparse.Namespace) -> int:
    from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

    dtype = args.dtype or ("bfloat16" if args.size == "2b" else "float32")
    out = make_test_model(args.dir, args.kind, size=args.size, seed=args.seed, dtype=dtype)
    print(f"wrote {args.size} {args.kind} test checkpoint to {out}")
    return 0
