"""Where threads make the host wait for the GPU: torch's sync debug mode, counted per thread and call site.

With every thread's kernels on one CUDA stream, a synchronising call (``.cpu()``, ``.item()``, a copy from
pageable memory) in one thread waits for the work every other thread has queued. ``counted()`` turns
``torch.cuda.set_sync_debug_mode("warn")`` on for a block and counts each warning by thread name and the
innermost frames of this project's code; ``summary()`` prints them, most frequent first. Torch warns only in
its synchronising copies and stream syncs: waits on an event (``forward.download``, the LM read-back since
2026-11-25) and explicit ``Stream``/``Event.synchronize`` calls are not counted. The warnings slow the run,
so its images/s are not a measurement.
"""

from __future__ import annotations

import contextlib
import re
import threading
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

_OURS = re.compile(r"/(app|retrieval|rerank|indexer)/")


@contextlib.contextmanager
def counted() -> Iterator[Counter[str]]:
    import torch

    seen: Counter[str] = Counter()
    lock = threading.Lock()
    previous = warnings.showwarning

    def record(message: Any, category: Any, filename: str, lineno: int, *args: Any, **kwargs: Any) -> None:
        if "synchroniz" not in str(message):
            previous(message, category, filename, lineno, *args, **kwargs)
            return
        frames = [f for f in traceback.extract_stack()[:-1] if _OURS.search(f.filename)]
        where = " > ".join(f"{f.name} ({'/'.join(f.filename.split('/')[-2:])}:{f.lineno})" for f in frames[-2:])
        thread = re.sub(r"[-_ ]?\d+$", "", threading.current_thread().name)
        with lock:
            seen[f"{thread}: {where or filename}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        gpu = torch.cuda.is_available()  # nothing to count without one
        if gpu:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            if gpu:
                torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = previous


def summary(seen: Counter[str], top: int = 15) -> list[str]:
    lines = [f"synchronising calls: {sum(seen.values())} (by thread and call site)"]
    lines += [f"  {n:6d}  {where[:150]}" for where, n in seen.most_common(top)]
    return lines
