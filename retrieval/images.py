"""Safe image decoding: every image enters rubricsearch through :func:`decode_image`.

Hostile inputs (zero bytes, truncated files, decompression bombs, odd modes, animations) become a typed
:class:`~retrieval.errors.ImageError` or a correct RGB image; never a crash or a hang.
"""

from __future__ import annotations

import base64
import hashlib
import io
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from retrieval.errors import ImageError, PayloadTooLarge

DEFAULT_MAX_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_DECODED_PIXELS = 64_000_000  # 8000 x 8000
ALLOWED_FORMATS = frozenset({"JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "MPO"})

# Refuse truncated files instead of padding them with grey.
ImageFile.LOAD_TRUNCATED_IMAGES = False


@dataclass(frozen=True)
class DecodedImage:
    """An image as rubricsearch uses it: RGB pixels plus the sha256 of the original bytes."""

    image: Image.Image
    sha256: str
    data: bytes
    format: str
    width: int
    height: int


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode_image(
    data: bytes,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
) -> DecodedImage:
    """Decode and validate image bytes into an RGB image.

    The header is checked before pixels are decoded, so a file claiming 100000x100000 is refused without
    allocating memory. EXIF orientation is applied (the image is used as it is displayed); animations use
    their first frame; alpha is composited on white as qwen-vl-utils does; 16-bit and CMYK become 8-bit RGB.
    """
    if not data:
        raise ImageError("image is empty (0 bytes)")
    if len(data) > max_bytes:
        raise PayloadTooLarge(f"image is {len(data)} bytes; the limit is {max_bytes}", limit=max_bytes)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            probe = Image.open(io.BytesIO(data))
            fmt = probe.format or "unknown"
            if fmt not in ALLOWED_FORMATS:
                raise ImageError(f"unsupported image format {fmt}", format=fmt)
            width, height = probe.size
            if width < 1 or height < 1:
                raise ImageError(f"image has no pixels ({width}x{height})")
            if width * height > max_pixels:
                raise ImageError(
                    f"image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}",
                    limit=max_pixels,
                )
            probe.seek(0)
            probe.load()
            image = _to_rgb(ImageOps.exif_transpose(probe) or probe)
    except ImageError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"not a readable image: {exc}") from exc
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, MemoryError) as exc:
        raise ImageError(f"image data is corrupt or truncated: {exc}") from exc
    return DecodedImage(
        image=image, sha256=sha256_hex(data), data=data, format=fmt, width=image.width, height=image.height
    )


def _to_rgb(img: Image.Image) -> Image.Image:
    """Convert any mode to 8-bit RGB, compositing transparency on white like ``qwen_vl_utils.to_rgb``."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        # 16/32-bit greyscale: scale to 8 bits instead of clipping.
        import numpy as np

        arr = np.asarray(img, dtype=np.float64)
        peak = arr.max() if arr.size and arr.max() > 255 else 255.0
        img = Image.fromarray((arr * (255.0 / peak)).clip(0, 255).astype("uint8"), mode="L")
    if img.mode == "P":
        img = img.convert("RGBA") if "transparency" in img.info else img.convert("RGB")
    if img.mode in ("LA", "PA"):
        img = img.convert("RGBA")
    if img.mode == "RGBA":
        background = Image.new("RGB", img.size, (255, 255, 255))
        background.paste(img, mask=img.split()[3])
        return background
    return img.convert("RGB") if img.mode != "RGB" else img.copy()


def read_image_source(
    source: Any,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
) -> DecodedImage:
    """Accept the image forms of the official embedder: bytes, a path, a ``file://`` or ``data:`` URL, PIL.

    Remote http(s) URLs are refused here on purpose: fetching belongs to the ingestion layer, which
    guards against server-side request forgery.
    """
    if isinstance(source, DecodedImage):
        return source
    if isinstance(source, Image.Image):
        buf = io.BytesIO()
        source.save(buf, format="PNG")
        return decode_image(buf.getvalue(), max_bytes=max(max_bytes, len(buf.getvalue())), max_pixels=max_pixels)
    if isinstance(source, bytes | bytearray | memoryview):
        return decode_image(bytes(source), max_bytes=max_bytes, max_pixels=max_pixels)
    if isinstance(source, Path):
        return _read_path(source, max_bytes, max_pixels)
    if isinstance(source, str):
        if source.startswith("data:"):
            header, _, payload = source.partition(",")
            if ";base64" not in header:
                raise ImageError("data: URLs must be base64 encoded")
            try:
                raw = base64.b64decode(payload, validate=True)
            except ValueError as exc:
                raise ImageError(f"invalid base64 in data URL: {exc}") from exc
            return decode_image(raw, max_bytes=max_bytes, max_pixels=max_pixels)
        if source.startswith(("http://", "https://")):
            raise ImageError("remote image URLs are not fetched by the model layer; import them into a set")
        path = Path(source[7:] if source.startswith("file://") else source)
        return _read_path(path, max_bytes, max_pixels)
    raise ImageError(f"unsupported image value of type {type(source).__name__}")


def _read_path(path: Path, max_bytes: int, max_pixels: int) -> DecodedImage:
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise PayloadTooLarge(f"{path.name} is {size} bytes; the limit is {max_bytes}", limit=max_bytes)
        data = path.read_bytes()
    except OSError as exc:
        raise ImageError(f"cannot read image file {path}: {exc.strerror or exc}") from exc
    return decode_image(data, max_bytes=max_bytes, max_pixels=max_pixels)
