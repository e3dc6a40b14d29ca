"""How far the demo models' training is and how long it still takes, from the step lines it logs.

The training runs stretches of very different cost: building the image banks, the vision tower's pre-training,
the embedder's contrastive steps, the reranker's steps and the rerank-policy measurement. Progress counts
*work*, each stretch weighted by its cost measured on the development box (:data:`COSTS`), so the percentage moves
in proportion to time. The time left is the work left at a pace measured on this run, so a box faster or slower
than the one the costs were measured on only scales the pace: the geometric mean of the recent pace (which follows
a box that got busier or quieter) and the whole run's (a shared box's load comes and goes, and the end is often far
enough ahead for it to swing back).
"""

from __future__ import annotations

import math
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
# otherwise) to its first line, less one step; `step_s`: the mean time per step after the first line. Only the
# ratios matter: the live pace scales them.
# TAIL_S: from the reranker's last line to the end (saving it, then measuring the rerank policy), in the same units:
# the geometric mean of three runs on a busy box with threads that wait passively, as the server's training
# child's do (docs/performance.md). Runs whose OpenMP threads spin at barriers on a busy box make every training
# step several times dearer and the tail, which is mostly not training, hardly so: a tail weighed on those falls far
# short of the truth at the last reranker line.
COSTS: Mapping[str, Cost] = {
    "vision tower": Cost(setup_s=105.0, step_s=3.2),
    "embedder": Cost(setup_s=3.0, step_s=9.4),
    "reranker": Cost(setup_s=10.0, step_s=5.3),
}
TAIL_S = 90.0
# The recent pace is measured over at least this share of the time so far: long enough to average the step lines'
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
        """The work left at the geometric mean of two paces: the recent one, from the last line at least
        :data:`WINDOW` of the time so far back, and the whole run's, from the first step line. Either alone is off
        by the ratio between them when the load moves the other way (the recent pace when a burst of other work
        ends, the whole run's when the box stays busier or quieter): the mean is off by at most its square root."""
        if len(self.points) < 2:
            return None
        recent = self._pace(now - WINDOW * (now - self.started), now, done)
        whole = self._pace(self.points[0][0], now, done)
        if recent is None or whole is None:
            return None
        return (total - done) * math.sqrt(recent * whole)

    def _pace(self, horizon: float, now: float, done: float) -> float | None:
        """Seconds per unit of work from the last line at or before ``horizon`` (or the first line) to now."""
        since_t, since_w = self.points[0]
        for t, w in self.points:
            if t > horizon:
                break
            since_t, since_w = t, w
        if done <= since_w or now <= since_t:
            return None
        return (now - since_t) / (done - since_w)
