"""Train the demo models in a child process (``rubricsearch train-demo-models``) and follow its progress.

A child rather than a thread: the server stays responsive (training holds the GIL between ops and sets
torch's thread count for the whole process), stopping it is a signal rather than a flag the training loop
would have to poll, and its memory goes back when it ends. Progress comes from the lines the training logs
every few steps (``embedder [####....]  45% step 27/60 loss … (12 s, about 15 s left)``).
"""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger("rubricsearch.demo")

STEP_LINE = re.compile(r"^(?P<what>vision tower|embedder|reranker)\b.*\bstep (?P<step>\d+)/(?P<steps>\d+)\b.*?"
                       r"\((?P<elapsed>\d+) s, about (?P<left>\d+) s left\)")
PHASES = ("vision tower", "embedder", "reranker")  # the order the training runs them in
Report = Callable[[float | None, float | None], None]  # (fraction done, seconds left)


class TrainingFailed(RuntimeError):
    """The training child exited with an error; the message ends with its last lines."""


class Tracker:
    """Overall progress of the phases (:data:`PHASES`) from their step lines.

    A phase's share of the total is its step count (the plan's until its first line tells); the time left is
    the current phase's estimate plus the later phases' steps at the current pace."""

    def __init__(self, tower_steps: int, embedder_steps: int, reranker_steps: int) -> None:
        self.steps = dict(zip(PHASES, (tower_steps, embedder_steps, reranker_steps), strict=True))
        self.done = dict.fromkeys(PHASES, 0)

    def line(self, text: str) -> tuple[float, float | None] | None:
        match = STEP_LINE.search(text)
        if match is None:
            return None
        what, step, steps = match["what"], int(match["step"]), int(match["steps"])
        self.steps[what], self.done[what] = steps, step
        later = PHASES[PHASES.index(what) + 1:]
        for earlier in PHASES[:PHASES.index(what)]:  # a reused model logs nothing: it is done either way
            self.done[earlier] = self.steps[earlier]
        total = sum(self.steps.values())
        fraction = sum(self.done.values()) / total if total else 1.0
        if step < min(10, steps):  # the first step's time is mostly warm-up: no pace to tell yet
            return fraction, None
        left = float(match["left"]) + float(match["elapsed"]) / step * sum(self.steps[p] for p in later)
        return fraction, left


def train_in_child(out: Path, report: Report, *, threads: int, extra: Sequence[str] = (),
                   started: Callable[[subprocess.Popen[str]], None] | None = None) -> None:
    """Run ``rubricsearch train-demo-models out`` to completion, calling ``report`` on every step line.

    ``started`` receives the process (so a stopping server can terminate it); ``extra`` adds arguments
    (tests train a few steps). Raises :class:`TrainingFailed` when the child fails or is stopped."""
    from app.demo.models import DemoPlan

    plan = DemoPlan()
    tracker = Tracker(plan.embedder.tower_steps, plan.embedder.steps, plan.reranker.steps)
    command = [sys.executable, "-m", "app.cli", "train-demo-models", str(out), "--threads", str(threads), *extra]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)  # Ctrl-C reaches the server, which stops the child itself
    if started is not None:
        started(proc)
    tail: deque[str] = deque(maxlen=20)
    assert proc.stdout is not None
    began = time.monotonic()
    try:
        for raw in proc.stdout:
            line = raw.rstrip()
            tail.append(line)
            seen = tracker.line(line)
            if seen is not None:
                report(*seen)
                log.info("demo models training: %3.0f%% after %.0f s%s", 100 * seen[0], time.monotonic() - began,
                         "" if seen[1] is None else f", about {seen[1]:.0f} s left")
        code = proc.wait()
    finally:  # interrupted here (Ctrl-C without a server): the child must not train on alone
        interrupt(proc)
    if code != 0:
        raise TrainingFailed(f"training the demo models failed (exit {code}): " + " | ".join(tail))


def interrupt(proc: subprocess.Popen[str], wait_s: float = 30.0) -> None:
    """Stop a training child as Ctrl-C would (it removes its half-trained directory), else kill it."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
