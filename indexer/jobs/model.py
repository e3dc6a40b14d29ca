"""Small pieces the job modules share: how a failure is recorded, and where the time went."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from rubricsearch.retrieval.errors import RubricSearchError

STAGES = ("load", "decode", "dedup", "vision", "embed", "blob", "index", "sync", "catalog")


def describe(exc: BaseException) -> str:
    """The reason recorded for a failed item: the error's stable kind, then its message."""
    if isinstance(exc, RubricSearchError):
        return f"{exc.kind}: {exc.message}"[:2000]
    return f"internal_error: {type(exc).__name__}: {exc}"[:2000]


class StageTimes:
    """Seconds spent per ingestion stage (summed over threads for load/decode/blob), for the benchmark."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.items = 0
        self.batches = 0

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.seconds[stage] += seconds

    @contextlib.contextmanager
    def time(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - start)

    def count(self, items: int) -> None:
        with self._lock:
            self.items += items
            self.batches += 1

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {**self.seconds, "items": float(self.items), "batches": float(self.batches)}

    def reset(self) -> None:
        with self._lock:
            self.seconds = dict.fromkeys(STAGES, 0.0)
            self.items = self.batches = 0


# The batch pipeline's stages (indexer/jobs/pipeline.py): preprocessing runs ahead of the towers, packing after
PIPELINE_STAGES = (*STAGES[:3], "preprocess", *STAGES[3:4], "pack", *STAGES[4:])
GROUPS = ("prepare", "store")  # wall time of these groups of stages (vision, pack, embed and catalog are one each)


class PipelineTimes(StageTimes):
    """:class:`StageTimes` with the pipeline's stages (:data:`PIPELINE_STAGES`) and the stage groups."""

    def __init__(self) -> None:
        super().__init__()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.seconds = dict.fromkeys(PIPELINE_STAGES + GROUPS, 0.0)
            self.items = self.batches = 0
