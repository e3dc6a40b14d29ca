"""glibc heap upkeep for the server process: fewer malloc arenas and a periodic ``malloc_trim``.

Why: under the soak benchmark (searches, ingestions and deletes interleaved) the server's in-use heap
(glibc ``mallinfo2().uordblks``) and its Python objects stay flat once the bounded caches are full, yet
RSS kept rising with the free bytes held inside glibc's arenas (``fordblks``; the figures are in
docs/hardening.md, "Memory under churn"). Tensors and buffers allocated and freed by the server's many threads
spread over glibc's default arenas (8 per core), and freed chunks between live ones are never returned to the
system. Capping the arenas and trimming every
few seconds hands those pages back (``bench/soak.py`` watches it). Elsewhere than glibc both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from functools import lru_cache

log = logging.getLogger("rubricsearch.memory")

M_ARENA_MAX = -8  # mallopt parameter number (glibc malloc.h)


@lru_cache(maxsize=1)
def _glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc (it has ``malloc_trim`` and ``mallopt``), else ``None``."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not all(hasattr(libc, name) for name in ("malloc_trim", "mallopt", "gnu_get_libc_version")):
        return None
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


def limit_arenas(arenas: int) -> bool:
    """Cap glibc's malloc arenas for threads created from now on (0 = leave glibc's default)."""
    libc = _glibc()
    if libc is None or arenas <= 0:
        return False
    return bool(libc.mallopt(M_ARENA_MAX, arenas))


def trim() -> bool:
    """Return the free pages of every arena to the system; True if some memory was released."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


class HeapTrimmer:
    """A daemon thread calling :func:`trim` every ``interval_s`` seconds until :meth:`stop`.

    A trim walks the arenas' free lists, short work next to an interval of seconds, so it costs nothing
    measurable and keeps the retained free memory bounded by what one interval frees."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.trims = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HeapTrimmer:
        if self.interval_s > 0 and _glibc() is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="heap-trimmer", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                trim()
                self.trims += 1
            except Exception:  # upkeep must never take the server down
                log.exception("malloc_trim failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
