"""A server that is up before its models are: pages show what is being prepared, model routes answer 503.

``rubricsearch demo`` trains its models on the first run (minutes on a CPU). Rather than leave the browser with
nothing to connect to, the server starts at once with a :class:`Warmup`: a thread runs the preparation (train,
load, index the demo set) and reports progress; every route that needs the models answers 503 with
``Retry-After`` and that progress until the prepared :class:`~app.state.AppState` is installed. Nothing is
served from placeholder models meanwhile, so no result is ever presented as real when it is not. Routes that need
no model (sets, jobs, images) are served from :attr:`Warmup.stores` as soon as the preparation opens them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rubricsearch.app.state import AppState

log = logging.getLogger("rubricsearch.app")


def duration(seconds: float) -> str:
    """A time left in minutes and seconds, as people say it: "about 12 min 30 s", "about 40 s"."""
    seconds = max(1, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds >= 600:
        return f"{round(seconds / 60)} min"
    minutes, rest = divmod(5 * round(seconds / 5), 60)
    return f"{minutes} min {rest} s" if rest else f"{minutes} min"


class Cancelled(Exception):
    """The server is stopping: the preparation gives up (its partial work is discarded by whoever made it)."""


@dataclass(frozen=True)
class Progress:
    """What is being prepared, how far it is (0..1, None when unknown) and about how long it still takes."""

    phase: str
    fraction: float | None = None
    left_s: float | None = None

    def text(self) -> str:
        """One line for the banner and the 503 message, e.g. "demo models training: 45 % — about 3 min 20 s
        left"."""
        text = self.phase
        if self.fraction is not None:
            text += f": {round(100 * self.fraction)} %"
        if self.left_s is not None:
            text += f" — about {duration(self.left_s)} left"
        return text

    def retry_after_s(self) -> int:
        """A polite retry hint: the time left, capped, so a client comes back to see progress."""
        return 5 if self.left_s is None else max(1, min(30, round(self.left_s)))

    def as_dict(self) -> dict[str, Any]:
        percent = None if self.fraction is None else round(100 * self.fraction)
        left = None if self.left_s is None else round(self.left_s)
        return {"phase": self.phase, "percent": percent, "left_s": left, "text": self.text()}


Prepare = Callable[["Warmup"], AppState]


class Warmup:
    """Runs ``prepare`` on a thread; ``prepare`` calls :meth:`report` as it goes and :meth:`check` between steps
    (which raises :class:`Cancelled` once the server stops) and returns the state to serve."""

    def __init__(self, prepare: Prepare, *, first: str = "starting") -> None:
        self._prepare = prepare
        self._progress = Progress(first)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: str | None = None
        self.state: AppState | None = None
        self.stores: AppState | None = None  # the state without its models, once opened (see AppState.preparing)
        self.on_stop: list[Callable[[], None]] = []  # e.g. terminate a training child process
        self.on_failure: list[Callable[[str], None]] = []  # e.g. stop the server: nothing it would serve exists

    # -- for the preparation ---------------------------------------------------------------------
    def report(self, phase: str, fraction: float | None = None, left_s: float | None = None) -> None:
        with self._lock:
            self._progress = Progress(phase, None if fraction is None else min(1.0, max(0.0, fraction)), left_s)

    def check(self) -> None:
        if self._stop.is_set():
            raise Cancelled("the server is stopping")

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # -- for the server --------------------------------------------------------------------------
    @property
    def progress(self) -> Progress:
        with self._lock:
            return self._progress

    @property
    def done(self) -> bool:
        return self.state is not None

    def run(self) -> AppState:
        """Prepare in the calling thread (``rubricsearch demo --no-serve``)."""
        self.state = self._prepare(self)
        return self.state

    def start(self, ready: Callable[[AppState], None]) -> None:
        """Prepare on a thread; ``ready(state)`` installs the state (on that thread, which built it); when it
        cannot be made, :attr:`failure` says why and the ``on_failure`` callbacks run."""

        def main() -> None:
            started = time.monotonic()
            try:
                state = self._prepare(self)
            except Cancelled:
                self.stores = None
                return
            except Exception as exc:
                self.stores = None
                self.failure = f"{type(exc).__name__}: {exc}"
                log.exception("preparing the models failed")
                for callback in self.on_failure:
                    callback(self.failure)
                return
            if self._stop.is_set():
                state.close()
                return
            self.state = state
            log.info("models ready after %.0f s", time.monotonic() - started)
            ready(state)

        self._thread = threading.Thread(target=main, name="warmup", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the preparation to give up (terminating what it started) and wait for it."""
        self._stop.set()
        for callback in self.on_stop:
            try:
                callback()
            except Exception:
                log.exception("stopping the preparation")
        if self._thread is not None:
            self._thread.join(timeout_s)
