"""Cross-request batching of vision-tower passes (leader/follower, no extra thread).

Under load every search encodes its own candidate image: one tower pass of one image costs about as many
kernel launches (and as much Python time) as a pass of sixty, and before this each request ran its own pass
behind the tower's lock, so concurrent searches queued on it one image at a time. Now a request queues its
chunk and takes the lock; whoever holds it runs every chunk waiting at that moment (up to a patch budget)
as one pass, and the requests whose chunks it ran find their packages ready when they get the lock. A single
request runs exactly the pass it ran before. A failing merged pass is retried chunk by chunk, so one bad
input fails only its own request.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rubricsearch.retrieval.packages import VisualPackage

Grid = tuple[int, int, int]
RunTower = Callable[[torch.Tensor, list[Grid], list[str]], list[VisualPackage]]


@dataclass(eq=False)
class _Chunk:
    pixels: torch.Tensor
    grids: list[Grid]
    shas: list[str]
    patches: int
    result: list[VisualPackage] | None = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class TowerBatcher:
    """Runs tower chunks of concurrent callers in merged passes of at most ``max_patches`` patches."""

    run_tower: RunTower
    max_patches: int
    counters: dict[str, int] = field(default_factory=lambda: {"merged_tower_passes": 0, "merged_chunks": 0})
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _queue_lock: threading.Lock = field(default_factory=threading.Lock)
    _queue: deque[_Chunk] = field(default_factory=deque)

    def run(self, pixels: torch.Tensor, grids: list[Grid], shas: list[str]) -> list[VisualPackage]:
        chunk = _Chunk(pixels, grids, shas, sum(t * h * w for t, h, w in grids))
        with self._queue_lock:
            self._queue.append(chunk)
        while True:
            with self._lock:
                if chunk.done:
                    break
                self._run(self._take())
        if chunk.error is not None:
            raise chunk.error
        assert chunk.result is not None
        return chunk.result

    def _take(self) -> list[_Chunk]:
        """The oldest waiting chunks within the patch budget (always at least one)."""
        taken: list[_Chunk] = []
        total = 0
        with self._queue_lock:
            while self._queue and (not taken or total + self._queue[0].patches <= self.max_patches):
                entry = self._queue.popleft()
                taken.append(entry)
                total += entry.patches
        return taken

    @torch.inference_mode()  # the leader may run other requests' chunks: the same mode for all
    def _run(self, chunks: list[_Chunk]) -> None:
        if not chunks:
            return
        if len(chunks) == 1:
            self._run_alone(chunks[0])
            return
        try:
            packages = self.run_tower(torch.cat([c.pixels for c in chunks]),
                                      [g for c in chunks for g in c.grids], [s for c in chunks for s in c.shas])
        except Exception:
            for chunk in chunks:  # find the chunk it failed on: each alone
                self._run_alone(chunk)
            return
        self.counters["merged_tower_passes"] += 1
        self.counters["merged_chunks"] += len(chunks)
        at = 0
        for chunk in chunks:
            chunk.result = packages[at:at + len(chunk.shas)]
            at += len(chunk.shas)
            chunk.done = True

    def _run_alone(self, chunk: _Chunk) -> None:
        try:
            chunk.result = self.run_tower(chunk.pixels, chunk.grids, chunk.shas)
        except BaseException as exc:
            chunk.error = exc
        chunk.done = True
