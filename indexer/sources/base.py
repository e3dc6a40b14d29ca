"""The shape every ingestion source shares.

A source is opened once (source-level problems such as "not a zip" or "outside the allowed root" are
raised right there), then yields :class:`SourceItem` s lazily. Each item carries a display ``ref`` that is
unique within the source and a ``load`` callable that fetches the bytes later, so the ingestion job can
record one job item per ref first and load (or re-load, after a restart) each one on its own. ``load``
raises a typed :class:`~retrieval.errors.RubricSearchError` for that item only; it never breaks the source.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import BinaryIO, Protocol, Self, runtime_checkable

from rubricsearch.retrieval.errors import NotFound, PayloadTooLarge
from rubricsearch.retrieval.images import DEFAULT_MAX_BYTES

IMAGE_EXTENSIONS: frozenset[str] = frozenset(
    {".jpg", ".jpeg", ".jpe", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".mpo"}
)
MAX_RECORDED_SKIPS = 1000
_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class SourceLimits:
    """Resource caps of one source; every source enforces all three."""

    max_item_bytes: int = DEFAULT_MAX_BYTES
    max_items: int = 100_000
    max_total_bytes: int = 8 * 1024**3


@dataclass(frozen=True)
class SourceItem:
    """One reference image to ingest: its display name and a deferred, repeatable loader."""

    ref: str
    load: Callable[[], bytes] = field(repr=False, compare=False)
    size_hint: int | None = None


@dataclass(frozen=True)
class Skipped:
    """An entry the source saw but deliberately does not offer (not an image, a directory link, ...)."""

    ref: str
    reason: str


@runtime_checkable
class Source(Protocol):
    """What the ingestion job runner consumes."""

    kind: str

    def __len__(self) -> int: ...

    def items(self) -> Iterator[SourceItem]: ...

    def load(self, ref: str) -> bytes: ...

    @property
    def skipped(self) -> list[Skipped]: ...

    @property
    def skipped_count(self) -> int: ...

    def close(self) -> None: ...


class SkipLog:
    """Bounded record of skipped entries, so a folder of a million text files cannot exhaust memory."""

    def __init__(self, cap: int = MAX_RECORDED_SKIPS) -> None:
        self.entries: list[Skipped] = []
        self.count = 0
        self._cap = cap

    def add(self, ref: str, reason: str) -> None:
        self.count += 1
        if len(self.entries) < self._cap:
            self.entries.append(Skipped(ref, reason))


class ByteBudget:
    """Running total of bytes a source has delivered, checked on every load (thread safe)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def charge(self, n: int, ref: str) -> None:
        with self._lock:
            if self.used + n > self.limit:
                raise PayloadTooLarge(
                    f"{ref}: the source would exceed its total limit of {self.limit} bytes",
                    limit=self.limit,
                    ref=ref,
                )
            self.used += n


def read_limited(stream: BinaryIO, limit: int, ref: str) -> bytes:
    """Read at most ``limit`` bytes, whatever any header claimed; one byte more is an error.

    Reads in bounded chunks so a decompressing stream never materialises more than ``limit + 1 MiB``.
    """
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = stream.read(min(_CHUNK, limit + 1 - total))
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > limit:
            raise PayloadTooLarge(f"{ref} is larger than the limit of {limit} bytes", limit=limit, ref=ref)
        chunks.append(chunk)


class ListedSource:
    """A source whose entries are listed when it is opened: deterministic order, known size, resumable.

    Subclasses call :meth:`_add` while opening and implement :meth:`_load`.
    """

    kind = "listed"

    def __init__(self, limits: SourceLimits) -> None:
        self.limits = limits
        self._entries: dict[str, int | None] = {}
        self._skips = SkipLog()
        self._budget = ByteBudget(limits.max_total_bytes)

    def _add(self, name: str, size_hint: int | None = None) -> str:
        if len(self._entries) >= self.limits.max_items:
            raise PayloadTooLarge(
                f"the {self.kind} source has more than {self.limits.max_items} items",
                limit=self.limits.max_items,
            )
        ref = unique_ref(name, self._entries)
        self._entries[ref] = size_hint
        return ref

    def _check_declared_total(self, total: int) -> None:
        """Refuse at open time a source whose listed sizes already exceed the total byte limit."""
        limit = self.limits.max_total_bytes
        if total > limit:
            raise PayloadTooLarge(
                f"the {self.kind} source holds {total} bytes; the limit is {limit}", limit=limit, size=total
            )

    def _skip(self, ref: str, reason: str) -> None:
        self._skips.add(ref, reason)

    def _load(self, ref: str) -> bytes:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._entries)

    def refs(self) -> list[str]:
        return list(self._entries)

    def items(self) -> Iterator[SourceItem]:
        for ref, size in self._entries.items():
            yield SourceItem(ref, partial(self.load, ref), size)

    def load(self, ref: str) -> bytes:
        """Bytes of one entry, or a typed error for this entry alone (``NotFound`` if it is not listed)."""
        if ref not in self._entries:
            raise unknown_ref(ref)
        data = self._load(ref)
        self._budget.charge(len(data), ref)
        return data

    @property
    def skipped(self) -> list[Skipped]:
        return list(self._skips.entries)

    @property
    def skipped_count(self) -> int:
        return self._skips.count

    def close(self) -> None:
        """Release what the source holds open; a no-op for most."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def unique_ref(name: str, taken: Container[str]) -> str:
    """Make a display name unique within a source: ``a.jpg``, then ``a.jpg#2``, ..."""
    ref, n = name, 1
    while ref in taken:
        n += 1
        ref = f"{name}#{n}"
    return ref


def unknown_ref(ref: str) -> NotFound:
    return NotFound(f"{ref!r} is not an entry of this source", ref=ref)


def extension(name: str) -> str:
    dot = name.rfind(".")
    return name[dot:].lower() if dot > max(name.rfind("/"), name.rfind("\\")) + 1 else ""
