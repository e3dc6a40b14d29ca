"""How far the demo models' training is and how long it still takes, from the step lines it logs.

The training runs stretches of very different cost: building the image banks, the vision tower's pre-training,
the embedder's contrastive steps, the reranker's steps and the rerank-policy measurement. Progress counts
*work*, each stretch weighted by its cost measured on the development box (:data:`COSTS`), so the percentage moves
in proportion to time. The time left is the work left at the pace measured over the recent part of the run,
so a box that gets busier or quieter is followed within a few lines, and a box faster or slower than the one the
costs were measured on only scales the pace.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

STEP_LINE = re.compile(r"^(?P<what>vision tower|embedder|reranker)\b.*\bstep (?P<step>\d+)/(?P<steps>\d+)\b")
PHASES = ("vision tower", "embedder", "reranker")  # the order the training runs them in


@dataclass(frozen=True)
class Cost:
    """A phase's cost in seconds on the reference box: what runs before its first step, and each step."""

    setup_s: float
    step_s: float


# From `bench/demo_progress.py` run on the development box twice, busy and quieter (the runs and how far they
# differ: docs/performance.md, "Measurements behind the code"). The phases' relative costs differ with the box's
# load, so each constant is the geometric mean of the two runs in busy tower-step seconds. `setup_s`: from the phase's
# start (the child's start for the tower: imports, base checkpoint, image banks; the previous phase's last line
# otherwise) to its first line, less one step; `step_s`: the mean time per step after the first line; TAIL_S:
# from the reranker's last line to the end (saving it, then measuring the rerank policy), the geometric mean of
# those two runs' 36 s and a third busy run's 13.9 (docs/performance.md): at 36 it was the bar's worst error, the
# time left at the last reranker line over twice the truth on the busy box. Only the ratios matter: the live pace
# scales them.
COSTS: Mapping[str, Cost] = {
    "vision tower": Cost(setup_s=105.0, step_s=3.2),
    "embedder": Cost(setup_s=3.0, step_s=9.4),
    "reranker": Cost(setup_s=10.0, step_s=5.3),
}
TAIL_S = 22.0
# The pace is measured over at least this share of the time so far: long enough to average the step lines'
# jitter, short enough to follow a box whose load changes.
WINDOW = 1 / 3


class Tracker:
    """Overall progress of the training from its step lines, each given with the time it arrived.

    ``steps`` is the plan's step count per phase (the lines correct it). ``line`` returns (fraction done,
    seconds left) for a step line, None for any other line; the time left is None until there is a pace (from
    the second step line on)."""

    def __init__(self, steps: Mapping[str, int], started: float, *, costs: Mapping[str, Cost] = COSTS,
                 tail_s: float = TAIL_S) -> None:
        self.steps = {p: int(steps[p]) for p in PHASES}
        self.done = dict.fromkeys(PHASES, 0)
        self.costs = costs
        self.tail_s = tail_s
        self.started = started
        self.points: list[tuple[float, float]] = []  # (time, work done) at each step line
        self.phase: str | None = None

    def _work(self, phase: str, steps: int) -> float:
        cost = self.costs[phase]
        return cost.setup_s + steps * cost.step_s if steps else 0.0

    def total(self) -> float:
        return sum(self._work(p, self.steps[p]) for p in PHASES) + self.tail_s

    def work_done(self) -> float:
        return sum(self._work(p, self.done[p]) for p in PHASES)

    def line(self, text: str, now: float) -> tuple[float, float | None] | None:
        match = STEP_LINE.search(text)
        if match is None:
            return None
        what, step, steps = match["what"], int(match["step"]), int(match["steps"])
        self.steps[what], self.done[what] = steps, min(step, steps)
        first = self.phase is None
        if first:  # a reused model logs nothing: its phases are done
            for earlier in PHASES[:PHASES.index(what)]:
                self.done[earlier] = self.steps[earlier]
        self.phase = what
        done, total = self.work_done(), self.total()
        # The pace is measured from the first step line on: the start-up before it (imports, image banks) varies
        # most with the box's load, and a reused model's phases took no time at all.
        self.points = [(now, done)] if first else [*self.points, (now, done)]
        return min(1.0, done / total), self.left(now, done, total)

    def left(self, now: float, done: float, total: float) -> float | None:
        """The work left at the pace of the recent lines: from the last line at least :data:`WINDOW` of the
        time so far back (or the first line), so the pace spans a few lines and follows a change of load."""
        if len(self.points) < 2:
            return None
        horizon = now - WINDOW * (now - self.started)
        since_t, since_w = self.points[0]
        for t, w in self.points:
            if t > horizon:
                break
            since_t, since_w = t, w
        if done <= since_w or now <= since_t:
            return None
        return (total - done) * (now - since_t) / (done - since_w)
