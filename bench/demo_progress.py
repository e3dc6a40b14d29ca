"""What each phase of the demo models' training costs on this box, beside the constants the progress bar uses
(``app.demo.progress.COSTS``), and how the bar's time left compares with the truth on this run.

    .venv/bin/python bench/demo_progress.py                       # 30 tower, 20 embedder, 150 reranker steps
    .venv/bin/python bench/demo_progress.py --smoke               # a few steps on a few images (the suite's check)

The training runs in this process with a shortened plan (the per-step and setup costs do not depend on the step
counts), each step line timestamped as the server's tracker would see it. Printed: each phase's setup and step
seconds, measured and constant, and each phase's step cost relative to the tower's (the ratios are what the bar
uses; the live pace scales them); then the tracker replayed on the run's own lines: the worst ratio of its time
left to the true time left after the first 10 % of the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import scratch_dir  # noqa: E402
from rubricsearch.app.demo.progress import COSTS, PHASES, STEP_LINE, TAIL_S, Tracker  # noqa: E402


class Lines(logging.Handler):
    """The training log's messages with the time each was written."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((time.monotonic(), record.getMessage()))


def costs(lines: list[tuple[float, str]], started: float, ended: float) -> dict[str, tuple[float, float]]:
    """(setup_s, step_s) per phase, and ("tail", (seconds, 0)): setup is the time from the phase's start to its first
    line less one step, a step the mean time between its first and last line."""
    out: dict[str, tuple[float, float]] = {}
    begin = started
    last = started
    for phase in PHASES:
        steps = [(t, m) for t, m in lines if (found := STEP_LINE.search(m)) and found["what"] == phase]
        (t0, m0), (t1, m1) = steps[0], steps[-1]
        s0, s1 = (int(STEP_LINE.search(m)["step"]) for m in (m0, m1))  # type: ignore[index]
        step = (t1 - t0) / max(1, s1 - s0)
        out[phase] = (max(0.0, t0 - begin - s0 * step), step)
        begin = last = t1
    out["tail"] = (ended - last, 0.0)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tower-steps", type=int, default=30)
    parser.add_argument("--embedder-steps", type=int, default=20)
    parser.add_argument("--reranker-steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=2, help="torch threads, as the demo gives its training child")
    parser.add_argument("--smoke", action="store_true", help="a few steps on a few images: checks the machinery")
    args = parser.parse_args()

    from rubricsearch.app.demo.checkpoints import DemoPlan, build_all
    from rubricsearch.app.demo.policy import PolicySize

    plan, policy_size = DemoPlan(), PolicySize()
    embedder = dataclasses.replace(plan.embedder, tower_steps=args.tower_steps, steps=args.embedder_steps)
    reranker = dataclasses.replace(plan.reranker, steps=args.reranker_steps)
    if args.smoke:
        embedder = dataclasses.replace(embedder, tower_steps=2, steps=2, batch=6, pool=6, tower_batch=6,
                                       tower_images=24)
        reranker = dataclasses.replace(reranker, steps=2, queries=2, documents=4)
        plan = dataclasses.replace(plan, train_images=24)
        # and the policy measurement after training on a few faces: at its default size it would cost more than
        # the whole smoke training
        policy_size = PolicySize(docs=30, per_kind=3, shortlist=8)
    plan = dataclasses.replace(plan, embedder=embedder, reranker=reranker)
    steps = {"vision tower": embedder.tower_steps, "embedder": embedder.steps, "reranker": reranker.steps}
    print(f"plan: {steps}, threads {args.threads}" + (" (smoke)" if args.smoke else ""))

    handler = Lines()
    demo_log = logging.getLogger("rubricsearch.demo")
    demo_log.setLevel(logging.INFO)
    demo_log.addHandler(handler)
    started = time.monotonic()
    build_all(scratch_dir("rs-demo-progress-"), plan, threads=args.threads, force=True, policy_size=policy_size)
    ended = time.monotonic()
    print(f"trained in {ended - started:.0f} s")

    measured = costs(handler.seen, started, ended)
    base_measured, base_constant = measured[PHASES[0]][1], COSTS[PHASES[0]].step_s
    print(f"{'phase':14} {'setup s':>8} {'constant':>8} {'step s':>8} {'constant':>8} {'step vs tower':>14} "
          f"{'constant':>8}")
    for phase in PHASES:
        setup, step = measured[phase]
        cost = COSTS[phase]
        print(f"{phase:14} {setup:8.1f} {cost.setup_s:8.1f} {step:8.2f} {cost.step_s:8.2f} "
              f"{step / base_measured:14.2f} {cost.step_s / base_constant:8.2f}")
    print(f"{'tail':14} {measured['tail'][0]:8.1f} {TAIL_S:8.1f}")

    tracker = Tracker(steps, started)
    worst = 1.0
    for at, message in handler.seen:
        seen = tracker.line(message, at)
        if seen is None or seen[1] is None or (at - started) < 0.1 * (ended - started) or ended - at <= 0:
            continue
        worst = max(worst, seen[1] / (ended - at), (ended - at) / seen[1])
    print(f"time left after the first 10 %: worst {worst:.2f}x the truth (estimate / truth or truth / estimate)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
