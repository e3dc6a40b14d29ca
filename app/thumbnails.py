"""JPEG thumbnails of ingested images, made once per (image, size) and cached under ``data_dir/thumbs``.

Sizes are rounded up to a few fixed buckets so a client cannot fill the disk by asking for every size
from 1 to 1024. Files are written to a temp name and renamed, so a reader never sees half a thumbnail.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from pathlib import Path

from PIL import Image

from rubricsearch.app.state import AppState
from rubricsearch.indexer.blobs import validate_sha256
from rubricsearch.retrieval.images import decode_image

SIZES = (64, 128, 256, 512, 1024)
DEFAULT_SIZE = 256
JPEG_QUALITY = 85

_MAGIC: tuple[tuple[bytes, int, str], ...] = (
    (b"\xff\xd8\xff", 0, "image/jpeg"),
    (b"\x89PNG\r\n\x1a\n", 0, "image/png"),
    (b"GIF87a", 0, "image/gif"),
    (b"GIF89a", 0, "image/gif"),
    (b"WEBP", 8, "image/webp"),
    (b"BM", 0, "image/bmp"),
    (b"II*\x00", 0, "image/tiff"),
    (b"MM\x00*", 0, "image/tiff"),
)


def content_type(head: bytes) -> str:
    """The image media type from the first bytes of a file (ingested images are one of these)."""
    for magic, offset, mime in _MAGIC:
        if head[offset : offset + len(magic)] == magic and (mime != "image/webp" or head.startswith(b"RIFF")):
            return mime
    return "application/octet-stream"


def bucket(size: int) -> int:
    """The smallest cached size that is at least ``size``."""
    return next((s for s in SIZES if s >= size), SIZES[-1])


def thumbs_root(state: AppState) -> Path:
    return state.settings.data_dir / "thumbs"


def thumbnail_path(state: AppState, sha256: str, size: int) -> Path:
    return thumbs_root(state) / sha256[:2] / f"{sha256}-{bucket(size)}.jpg"


def thumbnail(state: AppState, sha256: str, size: int = DEFAULT_SIZE) -> Path:
    """The cached thumbnail file, made from the blob on first request (caller checked it is ingested)."""
    validate_sha256(sha256)
    path = thumbnail_path(state, sha256, size)
    if path.exists():
        return path
    side = bucket(size)
    decoded = decode_image(state.blobs.get(sha256), max_bytes=max(state.settings.image_bytes,
                                                                  state.blobs.size(sha256)),
                           max_pixels=state.settings.image_pixels)
    image = decoded.image.copy()
    image.thumbnail((side, side), Image.Resampling.LANCZOS, reducing_gap=3.0)
    buf = io.BytesIO()
    image.convert("RGB").save(buf, "JPEG", quality=JPEG_QUALITY, optimize=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".thumb-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(buf.getvalue())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def drop_thumbnails(state: AppState, sha256: str) -> None:
    """Remove an image's thumbnails once its blob is gone (after a delete)."""
    folder = thumbs_root(state) / sha256[:2]
    for size in SIZES:
        (folder / f"{sha256}-{size}.jpg").unlink(missing_ok=True)


def drop_all_orphans(state: AppState, shas: list[str]) -> None:
    """Thumbnails of the given images whose blobs no longer exist."""
    for sha in shas:
        if not state.blobs.exists(sha):
            drop_thumbnails(state, sha)


def clear(state: AppState) -> None:
    """Remove every cached thumbnail (they are rebuilt on demand)."""
    shutil.rmtree(thumbs_root(state), ignore_errors=True)
