"""Train the demo models in a child process (``rubricsearch train-demo-models``) and follow its progress.

A child rather than a thread: the server stays responsive (training holds the GIL between ops and sets
torch's thread count for the whole process), stopping it is a signal rather than a flag the training loop
would have to poll, and its memory goes back when it ends. Progress comes from the lines the training logs
every few steps (``embedder [####....]  45% step 27/60 loss …``), weighed by :mod:`app.demo.progress`.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from rubricsearch.app.demo.progress import Tracker
from rubricsearch.app.warmup import duration

log = logging.getLogger("rubricsearch.demo")

Report = Callable[[float | None, float | None], None]  # (fraction done, seconds left)


class TrainingFailed(RuntimeError):
    """The training child exited with an error; the message ends with its last lines."""


def train_in_child(out: Path, report: Report, *, threads: int, extra: Sequence[str] = (),
                   started: Callable[[subprocess.Popen[str]], None] | None = None) -> None:
    """Run ``rubricsearch train-demo-models out`` to completion, calling ``report`` on every step line.

    ``started`` receives the process (so a stopping server can terminate it); ``extra`` adds arguments
    (tests train a few steps). Raises :class:`TrainingFailed` when the child fails or is stopped."""
    from rubricsearch.app.demo.checkpoints import DemoPlan

    plan = DemoPlan()
    steps = {"vision tower": plan.embedder.tower_steps, "embedder": plan.embedder.steps,
             "reranker": plan.reranker.steps}
    began = time.monotonic()
    command = [sys.executable, "-m", "rubricsearch", "train-demo-models", str(out), "--threads", str(threads), *extra]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)  # Ctrl-C reaches the server, which stops the child itself
    if started is not None:
        started(proc)
    tail: deque[str] = deque(maxlen=20)
    assert proc.stdout is not None
    tracker = Tracker(steps, began)
    try:
        for raw in proc.stdout:
            line = raw.rstrip()
            tail.append(line)
            now = time.monotonic()
            seen = tracker.line(line, now)
            if seen is not None:
                report(*seen)
                log.info("demo models training: %3.0f%% after %s%s", 100 * seen[0], duration(now - began),
                         "" if seen[1] is None else f", about {duration(seen[1])} left")
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
