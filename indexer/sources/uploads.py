"""Images uploaded in one request: a list of (filename, bytes).

The client's filename is only a display name: it is reduced to its last path component and stripped of
control, bidi and zero-width characters (:func:`indexer.names.clean_name`), so ``C:\\fakepath\\a.jpg`` or
``../../a.jpg`` become ``a.jpg``. Extensions are not filtered: the user picked every file on purpose, so a
non-image gets a per-item error, not a silent skip.
"""

from __future__ import annotations

from collections.abc import Iterable

from rubricsearch.indexer.names import clean_name
from rubricsearch.indexer.sources.base import ListedSource, SourceLimits
from rubricsearch.retrieval.errors import ImageError, PayloadTooLarge

MAX_NAME_CHARS = 255


def display_name(filename: str | None, index: int) -> str:
    """A safe display name for an uploaded file (never a path)."""
    name = clean_name((filename or "").replace("\\", "/")).rsplit("/", 1)[-1].strip()
    if name in ("", ".", ".."):
        return f"upload-{index + 1}"
    return name[:MAX_NAME_CHARS]


class UploadSource(ListedSource):
    """Holds the uploaded bytes in memory; the job runner should persist them before a long job."""

    kind = "upload"

    def __init__(self, files: Iterable[tuple[str | None, bytes]], limits: SourceLimits | None = None) -> None:
        super().__init__(limits or SourceLimits())
        self._data: dict[str, bytes] = {}
        for index, (filename, data) in enumerate(files):
            ref = self._add(display_name(filename, index), len(data))
            self._data[ref] = bytes(data)
        self._check_declared_total(sum(map(len, self._data.values())))

    def _load(self, ref: str) -> bytes:
        data = self._data[ref]
        if not data:
            raise ImageError(f"{ref} is empty (0 bytes)", ref=ref)
        limit = self.limits.max_item_bytes
        if len(data) > limit:
            raise PayloadTooLarge(f"{ref} is {len(data)} bytes; the limit is {limit}", limit=limit, ref=ref)
        return data
