"""``rubricsearch demo`` as the browser tests run it: the real command line (``app.cli.main``), training the demo
models in its child process for a few steps only (``--steps N``, and the vision tower's pre-training for
``TOWER_STEPS``: enough step lines for the banner's progress; the full recipe takes CPU-minutes) and measuring
their rerank policy on a few faces (``--policy-size``; the default size costs minutes, and these tests check the
pages, not what the policy finds).

``python -m tests.demo_server_main STEPS [demo arguments]``; the settings come from ``RUBRICSEARCH_*``.
"""

from __future__ import annotations

import functools
import sys

import rubricsearch.app.demo.cli as demo
from rubricsearch.app.cli import main as cli_main

POLICY_SIZE = ("30", "3", "8")  # faces, queries per kind, shortlist
# A step line comes every 10 steps and at the last: 11 steps give the two lines from which the banner shows the
# time left before the embedder's steps; more steps cost CPU and give no line that the tests read.
TOWER_STEPS = "11"


def main(argv: list[str]) -> int:
    steps, rest = argv[0], argv[1:]
    # the sub-command is registered when the parser is built, so it picks this up
    train_args = ["--tower-steps", TOWER_STEPS, "--steps", steps, "--reranker-steps", steps,
                  "--policy-size", *POLICY_SIZE]
    demo.run = functools.partial(demo.run, train_args=train_args)  # type: ignore[assignment]
    return cli_main(["demo", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
