"""What an image's header says, checked against the limits before a pixel is decoded: format, size and the EXIF
orientation the decode will apply. Every check of :func:`retrieval.images.decode_image` that comes before its
decode lives here, so the check alone (:func:`inspect_image`) costs what reading a header costs.
"""

from __future__ import annotations

import contextlib
import io
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from PIL import Image, ImageFile, PngImagePlugin, UnidentifiedImageError

from rubricsearch.retrieval.errors import ImageError, PayloadTooLarge

DEFAULT_MAX_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_DECODED_PIXELS = 64_000_000  # 8000 x 8000
ALLOWED_FORMATS = frozenset({"JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "MPO"})
_OPEN_FORMATS = sorted(ALLOWED_FORMATS - {"MPO"})  # Pillow opens MPO through the JPEG parser
_EXIF_FORMATS = frozenset({"JPEG", "MPO", "WEBP", "TIFF", "PNG"})
_ORIENTATION = 0x0112

# Refuse truncated files instead of padding them with grey.
ImageFile.LOAD_TRUNCATED_IMAGES = False


@dataclass(frozen=True)
class ImageInfo:
    """What an image's header says, checked against the limits without decoding a pixel."""

    format: str
    width: int  # as stored (before EXIF orientation)
    height: int
    orientation: int  # EXIF orientation tag (1 = as stored)
    mode: str


def check_size(data: bytes, max_bytes: int) -> None:
    """Empty or oversized bytes are refused before any parser sees them."""
    if not data:
        raise ImageError("image is empty (0 bytes)")
    if len(data) > max_bytes:
        raise PayloadTooLarge(f"image is {len(data)} bytes; the limit is {max_bytes}", limit=max_bytes)


def inspect_image(
    data: bytes,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
) -> ImageInfo:
    """Validate the bytes' size and header (format, dimensions, pixel limit): the checks of
    :func:`~retrieval.images.decode_image` that come before decoding, so a bomb is refused without allocating
    memory and a valid image is not decoded twice."""
    check_size(data, max_bytes)
    with image_errors():
        return open_checked(data, max_pixels)[1]


def open_checked(data: bytes, max_pixels: int) -> tuple[ImageFile.ImageFile, ImageInfo]:
    """The image opened (its header read, no pixel decoded) and checked against the limits; call it inside
    :func:`image_errors`."""
    probe = Image.open(io.BytesIO(data), formats=_OPEN_FORMATS)
    fmt = probe.format or "unknown"
    if fmt not in ALLOWED_FORMATS:
        raise ImageError(f"unsupported image format {fmt}", format=fmt)
    width, height = probe.size
    if width < 1 or height < 1:
        raise ImageError(f"image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise ImageError(f"image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}",
                         limit=max_pixels)
    orientation = int(_exif(probe, data).get(_ORIENTATION, 1) or 1) if fmt in _EXIF_FORMATS else 1
    return probe, ImageInfo(fmt, width, height, orientation if 1 <= orientation <= 8 else 1, probe.mode)


def _exif(probe: Image.Image, data: bytes) -> Image.Exif:
    """The EXIF the decode will apply. Only a PNG's may lie behind its pixel data, where ``getexif()`` would decode
    the whole image to reach it; every other format's is in its header (JPEG/MPO APP1, the WebP container, the
    TIFF IFD)."""
    if isinstance(probe, PngImagePlugin.PngImageFile) and "exif" not in probe.info:
        return _png_exif_after_pixels(data)
    return probe.getexif()


def _png_exif_after_pixels(data: bytes) -> Image.Exif:
    """A PNG's EXIF as ``getexif()`` gives it after decoding, read without decoding.

    The chunks after the first IDAT are walked as Pillow's decode ends (``PngImageFile.load_end``): each by
    Pillow's own chunk handler, the image data skipped by its length instead of inflated, stopping at IEND,
    at a chunk list it cannot frame, or at an animation's next frame. The info they leave (eXIf, EXIF text
    profiles, XMP) is read by Pillow's own EXIF parser. So the orientation is the one the decode applies, and a
    chunk the decode would fail on fails here with the same error.
    """
    png = PngImagePlugin.PngImageFile(io.BytesIO(data))  # a parse of our own: its chunk stream is read to the end
    stream, fp = png.png, png.fp
    assert stream is not None and fp is not None
    if not png.tile:  # the parse ended at IEND
        raise ImageError("PNG has no image data (no IDAT chunk)")
    fp.seek(stream.im_idat, io.SEEK_CUR)  # the first image-data chunk, whose header ended the parse
    while True:
        fp.read(4)  # the CRC (after the image data Pillow checks none)
        try:
            cid, pos, length = stream.read()
        except (struct.error, SyntaxError):
            break
        if cid == b"IEND" or (cid == b"fcTL" and png.is_animated):
            break
        try:
            stream.call(cid, pos, length)
        except UnicodeDecodeError:
            break
        except EOFError:  # image data (IDAT, or an fdAT whose 4-byte sequence number was read)
            _skip(fp, length - 4 if cid == b"fdAT" else length, len(data))
        except AttributeError:  # a chunk type Pillow has no handler for
            _skip(fp, length, len(data))
    return Image.Image.getexif(png)  # Pillow's EXIF/XMP reading of the info, without PngImageFile's load


def _skip(fp: IO[bytes], length: int, size: int) -> None:
    """Past a chunk's payload without reading it; one the file ends inside fails as Pillow's read of it does."""
    if fp.seek(length, io.SEEK_CUR) > size:
        raise OSError("Truncated File Read")


@contextlib.contextmanager
def image_errors() -> Iterator[None]:
    """Every way hostile bytes can fail a decoder becomes an :class:`ImageError` with the reason."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except ImageError:
        raise
    except UnidentifiedImageError as exc:
        supported = ", ".join(sorted(ALLOWED_FORMATS))
        raise ImageError(f"not an image in a supported format ({supported})") from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"not a readable image: {exc}") from exc
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, MemoryError) as exc:
        raise ImageError(f"image data is corrupt or truncated: {exc}") from exc
    except Exception as exc:  # a decoder bug on hostile bytes must still be a per-image error
        raise ImageError(f"image could not be decoded ({type(exc).__name__}: {exc})") from exc
