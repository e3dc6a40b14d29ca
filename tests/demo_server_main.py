"""``rubricsearch demo`` as the browser tests run it: the real command, training the demo models in its child
process for a few steps only (``--steps N``; the full recipe takes CPU-minutes).

``python -m tests.demo_server_main STEPS [demo arguments]``; the settings come from ``RUBRICSEARCH_*``.
"""

from __future__ import annotations

import sys

from app.cli import build_parser
from app.cli.demo import run


def main(argv: list[str]) -> int:
    steps, rest = argv[0], argv[1:]
    args = build_parser().parse_args(["demo", *rest])
    return run(args, train_args=["--steps", steps, "--reranker-steps", steps])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
