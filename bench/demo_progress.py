"""What each phase of the demo models' training costs on this box, beside the constants the progress bar uses
(``app.demo.progress.COSTS``), and how the bar's time left compares with the truth, on this run or a recorded one.

    .venv/bin/python bench/demo_progress.py                       # 30 tower, 20 embedder, 150 reranker steps
    .venv/bin/python bench/demo_progress.py --smoke               # a few steps on a few images (the suite's check)
    .venv/bin/python bench/demo_progress.py --replay demo-train.log   # a recorded training, replayed

The training runs in this process with a shortened plan (the per-step and setup costs do not depend on the step
counts), each step line timestamped as the server's tracker would see it. Printed: each phase's setup and step
seconds, measured and constant, and each phase's step cost relative to the tower's (the ratios are what the bar
uses; the live pace scales them); then the tracker replayed on the run's own lines.

``--replay FILE`` reads a recorded training instead: each line what the training child prints (the lines the
server's trainer reads), prefixed by the time it was written, in unix seconds or as a date and time, as
``rubricsearch train-demo-models DIR 2>&1 | perl -MTime::HiRes=time -ne 'printf "%.3f %s", time, $_'`` or
moreutils' ``ts '%Y-%m-%d %H:%M:%.S'`` write it. Each step line goes to the product's tracker at its time, as the
server feeds it; the run starts at the first line (``--started`` moves it) and ends at the last.

The replay prints the time left shown at every step line beside the truth (the run's end less the line's time), the
tracker at 10, 25, 50, 75 and 90 % of the run, and the worst and median ratio of its time left to the truth after
the first 10 % of the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# as the server's training child runs (app/demo/trainer.py): a thread spinning at a barrier while its partner waits
# for a core on a busy box inflates the steps' cost many times over, and not the rest's
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from bench.common import scratch_dir  # noqa: E402
from rubricsearch.app.demo.checkpoints import DemoPlan  # noqa: E402
from rubricsearch.app.demo.progress import COSTS, PHASES, STEP_LINE, TAIL_S, Tracker  # noqa: E402
from rubricsearch.app.warmup import duration  # noqa: E402

# a line's time: unix seconds, or a date and time (ISO, or logging's "2026-12-07 04:04:02,360"); naive ones are UTC
STAMP = re.compile(r"^(?:(?P<epoch>\d{9,}(?:\.\d+)?)|(?P<date>\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?"
                   r"(?:Z|[+-]\d\d:?\d\d)?)) ?")
CHECKPOINTS = (0.10, 0.25, 0.50, 0.75, 0.90)
JUDGED_AFTER = 0.10  # the share of the run before which the time left is not judged


class Lines(logging.Handler):
    """The training log's messages with the time each was written."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((time.monotonic(), record.getMessage()))


def read_log(text: str) -> list[tuple[float, str]]:
    """(time, line) for each line the training printed. A progress bar's carriage returns end lines too (the server
    reads the child's output as text, whose newlines include them), all at the time the recorded line has; a line
    without a time of its own has the previous line's."""
    out: list[tuple[float, str]] = []
    at: float | None = None
    for raw in text.split("\n"):
        found = STAMP.match(raw)
        if found is not None:
            at = _seconds(found)
            raw = raw[found.end():]
        if at is None:
            if raw.strip():
                raise ValueError(f"a line without a time before any with one: {raw[:80]!r}")
            continue
        out += [(at, piece.rstrip()) for piece in raw.split("\r") if piece.strip()]
    if not out:
        raise ValueError("no timestamped line")
    return out


def _seconds(found: re.Match[str]) -> float:
    if found["epoch"]:
        return float(found["epoch"])
    when = datetime.fromisoformat(found["date"].replace(",", "."))
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


@dataclasses.dataclass(frozen=True)
class Shown:
    """What the bar showed at a step line, beside the truth."""

    at: float  # seconds since the run started
    fraction: float
    left: float | None
    truth: float  # the run's end less this line's time

    @property
    def ratio(self) -> float | None:
        """The time left shown over the true time left (None: nothing shown, or the run ended with this line)."""
        return None if self.left is None or self.truth <= 0 else self.left / self.truth


def replay(lines: Iterable[tuple[float, str]], steps: Mapping[str, int], started: float,
           ended: float) -> list[Shown]:
    """Feed each line to the product's tracker at its time, as the server's trainer does."""
    tracker = Tracker(steps, started)
    shown: list[Shown] = []
    for at, text in lines:
        seen = tracker.line(text, at)
        if seen is not None:
            shown.append(Shown(at - started, seen[0], seen[1], ended - at))
    return shown


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The time left against the truth after the first 10 % of the run."""

    judged: int  # step lines after the first 10 % that showed a time left (the last one excluded: nothing is left)
    blank: int  # step lines after the first 10 % that showed none (the first step line: no pace yet)
    worst: float  # the judged ratio farthest from 1, either way
    worst_at: float  # when it was shown, seconds since the run started
    median: float

    @property
    def off(self) -> float:
        """How many times off the worst ratio is, either way (2.0: half or twice the truth)."""
        return max(self.worst, 1 / self.worst) if self.worst > 0 else math.inf


def verdict(shown: list[Shown], run_s: float) -> Verdict:
    after = [s for s in shown if s.at >= JUDGED_AFTER * run_s and s.truth > 0]
    judged = [(r, s.at) for s in after if (r := s.ratio) is not None]
    if not judged:
        return Verdict(0, len(after), math.nan, math.nan, math.nan)
    worst, at = max(judged, key=lambda j: abs(math.log(j[0])) if j[0] > 0 else math.inf)
    return Verdict(len(judged), len(after) - len(judged), worst, at, statistics.median(r for r, _ in judged))


def _row(s: Shown) -> str:
    left = "-" if s.left is None else f"about {duration(s.left)} left"
    ratio = "-" if s.ratio is None else f"{s.ratio:.2f}"
    return f"{duration(s.at):>12} {100 * s.fraction:5.1f} % {left:>22} {duration(s.truth):>12} {ratio:>6}"


def report(shown: list[Shown], run_s: float, *, every: bool = True) -> Verdict:
    """Print the bar at each step line (or only at the checkpoints) and the verdict after the first 10 %."""
    header = f"{'after':>12} {'shown':>7} {'time left shown':>22} {'truly left':>12} {'ratio':>6}"
    if every:
        print(f"the bar at each step line ({len(shown)}):\n{header}")
        for s in shown:
            print(_row(s))
    print(f"checkpoints (the first step line from that share of the run's {duration(run_s)} on):")
    print(f"{'run':>4} {header}")
    for share in CHECKPOINTS:
        at = next((s for s in shown if s.at >= share * run_s), None)
        print(f"{100 * share:3.0f}% " + ("(no step line)" if at is None else _row(at)))
    v = verdict(shown, run_s)
    print(f"time left after the first 10 %: worst {v.off:.2f}x the truth (time left shown / true {v.worst:.2f}, after "
          f"{duration(v.worst_at)}), median {v.median:.2f}, over {v.judged} step lines"
          + (f" ({v.blank} more showing none: no pace before the second)" if v.blank else ""))
    return v


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


def print_costs(lines: list[tuple[float, str]], started: float, ended: float) -> None:
    measured = costs(lines, started, ended)
    base_measured, base_constant = measured[PHASES[0]][1], COSTS[PHASES[0]].step_s
    print(f"{'phase':14} {'setup s':>8} {'constant':>8} {'step s':>8} {'constant':>8} {'step vs tower':>14} "
          f"{'constant':>8}")
    for phase in PHASES:
        setup, step = measured[phase]
        cost = COSTS[phase]
        print(f"{phase:14} {setup:8.1f} {cost.setup_s:8.1f} {step:8.2f} {cost.step_s:8.2f} "
              f"{step / base_measured:14.2f} {cost.step_s / base_constant:8.2f}")
    print(f"{'tail':14} {measured['tail'][0]:8.1f} {TAIL_S:8.1f}")


def planned(lines: Iterable[tuple[float, str]], plan: DemoPlan) -> dict[str, int]:
    """The step count per phase the server's trainer would have given the tracker: the one this run's step lines say
    (a shortened plan's too), the default plan's for a phase without lines (a reused model)."""
    steps = {"vision tower": plan.embedder.tower_steps, "embedder": plan.embedder.steps,
             "reranker": plan.reranker.steps}
    for _, text in lines:
        if found := STEP_LINE.search(text):
            steps[found["what"]] = int(found["steps"])
    return steps


def replay_file(path: Path, started: float | None) -> int:
    lines = read_log(path.read_text(errors="replace"))
    steps = planned(lines, DemoPlan())
    begin, ended = lines[0][0] if started is None else started, lines[-1][0]
    print(f"replaying {path}: {len(lines)} lines over {duration(ended - begin)}, plan {steps}")
    if all(any((m := STEP_LINE.search(t)) and m["what"] == p for _, t in lines) for p in PHASES):
        print_costs(lines, begin, ended)
    report(replay(lines, steps, begin, ended), ended - begin)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tower-steps", type=int, default=30)
    parser.add_argument("--embedder-steps", type=int, default=20)
    parser.add_argument("--reranker-steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=2, help="torch threads, as the demo gives its training child")
    parser.add_argument("--smoke", action="store_true", help="a few steps on a few images: checks the machinery")
    parser.add_argument("--replay", type=Path, metavar="FILE", help="replay a recorded training's log instead")
    parser.add_argument("--record", type=Path, metavar="FILE", help="write this run's lines for --replay to FILE")
    parser.add_argument("--started", type=float, metavar="SECONDS",
                        help="with --replay: when the run started, in unix seconds (default: its first line)")
    args = parser.parse_args()
    if args.replay is not None:
        return replay_file(args.replay, args.started)

    from rubricsearch.app.demo.checkpoints import build_all
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
    if args.record is not None:  # unix seconds, the run's start and end included: --replay judges the same run
        to_unix = time.time() - time.monotonic()
        stamped = [(started, "started"), *handler.seen, (ended, "ended")]
        args.record.write_text("".join(f"{at + to_unix:.3f} {text}\n" for at, text in stamped))
    print_costs(handler.seen, started, ended)
    report(replay(handler.seen, steps, started, ended), ended - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
