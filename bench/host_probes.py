"""Where host threads spend wall time: timers around named functions, and a GIL latency probe.

The torch profiler sees torch ops and CUDA calls, py-spy samples stacks; neither says how long a thread
waits to get the GIL back after a C call released it. ``timed(names)`` wraps functions (``module:Attr.attr``,
patched where callers look them up) and sums each call's wall time per thread; ``GilProbe`` is a thread that
sleeps 1 ms in a loop and records how late it wakes: past the sleep itself, that lateness is the wait for the
GIL that every thread of the process pays each time it releases it (a torch op, a lock, a syscall).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

INGEST = (
    "indexer.jobs.pipeline:BatchProcessor.prepare", "indexer.jobs.pipeline:BatchProcessor.encode",
    "indexer.jobs.pipeline:BatchProcessor.embed", "indexer.jobs.pipeline:BatchProcessor.store",
    "indexer.jobs.pipeline:BatchProcessor.commit", "indexer.jobs.pipeline:BatchProcessor.pack",
    "retrieval.packages.service:VisualPackages.make", "retrieval.packages.service:VisualPackages.keep",
    "retrieval.packages.store:PackageStore.get",
    "retrieval.qwen.vision:VisionEncoder.encode", "retrieval.qwen.vision:adopt",
    "retrieval.qwen.tower_batching:TowerBatcher.run",
    "retrieval.qwen.graphed_tower:GraphedTower.run", "retrieval.qwen.graphed_tower:split_output",
    "retrieval.packages.store:PackageStore.put_many", "retrieval.packages.store:pack_many",
    "retrieval.packages.store:PackageStore._keep", "retrieval.packages.writer:WriteBehind.submit_many",
    "retrieval.embedding.local:LocalEmbedder.embed_contents", "retrieval.embedding.local:LocalEmbedder._prepare",
    "retrieval.packages.store:PackageStore.get_many", "retrieval.packages.store:unpack_many",
    "retrieval.embedding.local:download", "retrieval.qwen.batching:LMScheduler._run_batch",
    "retrieval.qwen.batching:LMScheduler._pass", "retrieval.qwen.graphed_lm:prepare",
    "retrieval.packages.writer:_to_host", "retrieval.packages.writer:WriteBehind._host_copies",
    "retrieval.packages.writer:WriteBehind._write", "retrieval.qwen.graphed_lm:mrope_positions",
    "indexer.jobs.runner:IngestionRunner._claim", "retrieval.qwen.tower_batching:TowerBatcher._run",
    "retrieval.qwen.gpu_preprocess:GpuPreprocessor.run", "retrieval.qwen.gpu_preprocess:GpuPreprocessor._decode_jpegs",
    "retrieval.packages.store:PackageStore._lookup", "retrieval.packages.store:PackageStore.sync",
)


class Timers:
    """Summed wall seconds and calls per (thread name, function)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = (_thread_kind(), name)
                with self._lock:
                    self.seconds[key] += time.perf_counter() - start
                    self.calls[key] += 1

        return timed_call

    def report(self, wall: float) -> list[str]:
        lines = [f"  function timers (inclusive wall seconds per thread; % of the run's {wall:.2f} s):"]
        for (thread, name), sec in sorted(self.seconds.items(), key=lambda kv: (kv[0][0], -kv[1])):
            calls = self.calls[(thread, name)]
            lines.append(f"    {thread:<16} {name.split(':')[1]:<38} {sec:7.3f} s {100 * sec / wall:5.1f}%"
                         f"  {calls:6d} calls {1000 * sec / max(calls, 1):7.2f} ms/call")
        return lines


def _thread_kind() -> str:
    name = threading.current_thread().name
    return name.rstrip("0123456789_-") or name


@contextlib.contextmanager
def timed(names: Sequence[str]) -> Iterator[Timers]:
    """Patch every named function for the duration; restores the originals afterwards."""
    timers = Timers()
    undo: list[tuple[Any, str, Any]] = []
    try:
        for name in names:
            module_name, _, path = name.partition(":")
            owner: Any = importlib.import_module(module_name)
            *parents, attr = path.split(".")
            for part in parents:
                owner = getattr(owner, part)
            original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            undo.append((owner, attr, original))
            setattr(owner, attr, timers.wrap(name, original))
        yield timers
    finally:
        for owner, attr, original in reversed(undo):
            setattr(owner, attr, original)


class GilProbe:
    """A thread that sleeps ``period`` seconds in a loop and records how late each wake-up is."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.late: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-probe", daemon=True)

    def __enter__(self) -> GilProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            time.sleep(self.period)
            self.late.append(time.perf_counter() - start - self.period)

    def report(self, idle_late: Sequence[float] = ()) -> str:
        late = np.asarray(self.late or [0.0]) * 1000
        base = f" (idle process: median {np.median(idle_late) * 1000:.3f} ms)" if len(idle_late) else ""
        return (f"  GIL probe: {len(self.late)} wake-ups, late by median {np.median(late):.3f} ms, mean "
                f"{late.mean():.3f}, p90 {np.percentile(late, 90):.3f}, p99 {np.percentile(late, 99):.3f}, max "
                f"{late.max():.1f} ms{base}")


def idle_lateness(seconds: float = 0.3) -> list[float]:
    """The probe's lateness with the process otherwise idle: the sleep's own overshoot."""
    with GilProbe() as probe:
        time.sleep(seconds)
    return probe.late
