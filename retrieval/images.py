"""Safe image decoding: every image enters rubricsearch through :func:`decode_image`.

Hostile inputs (zero bytes, truncated files, decompression bombs, odd modes, animations) become a typed
:class:`~retrieval.errors.ImageError` or a correct RGB image; never a crash or a hang.
"""

from __future__ import annotations

import base64
import hashlib
import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from PIL import Image, ImageOps

from rubricsearch.retrieval.errors import ImageError, PayloadTooLarge
from rubricsearch.retrieval.image_probe import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_DECODED_PIXELS,
    ImageInfo,
    check_size,
    image_errors,
    inspect_image,
    open_checked,
)

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_DECODED_PIXELS", "DecodedImage", "EncodedImage", "ImageInfo",
           "ImageLike", "Memory", "ReceivedImage", "ReferenceImage", "StoredImage", "data_url_bytes", "decode_image",
           "image_handle", "inspect_image", "read_image_source", "sha256_hex"]


# (width, height) -> a writable buffer of width * height * 4 bytes: memory for an image's RGB pixels in Pillow's own
# layout (4 bytes a pixel, the fourth unused), so a decoder writes them where their next user reads them
Memory = Callable[[int, int], Any]


@dataclass(frozen=True)
class DecodedImage:
    """An image as rubricsearch uses it: RGB pixels plus the sha256 of the original bytes."""

    image: Image.Image
    sha256: str
    data: bytes
    format: str
    width: int
    height: int
    buffer: Any = None  # the ``Memory`` buffer that ``image``'s pixels were decoded into, if any

    def decoded(self, memory: Memory | None = None) -> DecodedImage:
        """Already decoded (``memory`` is not used)."""
        return self


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode_image(
    data: bytes,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
    sha256: str | None = None,
    memory: Memory | None = None,
) -> DecodedImage:
    """Decode and validate image bytes into an RGB image.

    The header is checked before pixels are decoded, so a file claiming 100000x100000 is refused without
    allocating memory. EXIF orientation is applied (the image is used as it is displayed); animations use
    their first frame; alpha is composited on white as qwen-vl-utils does; 16-bit and CMYK become 8-bit RGB.
    ``sha256``: the caller's hash of these very bytes (not computed again). ``memory``: where an RGB image that
    needs no rotation is decoded (the decoder's own rows, so no copy follows); others decode as usual.
    """
    check_size(data, max_bytes)
    buffer = None
    with image_errors():
        probe, info = open_checked(data, max_pixels)
        probe.seek(0)
        mapped = None
        if memory is not None and probe.mode == "RGB" and info.orientation == 1 and probe.tile:
            buffer = memory(*probe.size)
            # Pillow's decoders write into the image's core, which ``load`` makes only where there is none yet (no
            # tiles: the plugin decoded the image when it was opened, as WebP's does)
            mapped = probe.im = Image.core.map_buffer(buffer, probe.size, "raw", 0, ("RGB", 0, 1))
        probe.load()
        ImageOps.exif_transpose(probe, in_place=True)  # the probe is ours alone: no copy of a 12-MP photo's 48 MB
        image = _to_rgb(probe)
    if mapped is None or image is not probe or probe.im is not mapped:  # decoded elsewhere after all
        buffer = None
    return DecodedImage(image=image, sha256=sha256 or sha256_hex(data), data=data, format=info.format,
                        width=image.width, height=image.height, buffer=buffer)


def _to_rgb(img: Image.Image) -> Image.Image:
    """Convert any mode to 8-bit RGB, compositing transparency on white.

    RGBA matches ``qwen_vl_utils.to_rgb`` exactly. For palette and LA images with transparency that
    function would keep the hidden colour under transparent pixels; white is used here on purpose.
    """
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        img = _wide_grey_to_l(img)
    if img.mode == "P":
        img = img.convert("RGBA") if "transparency" in img.info else img.convert("RGB")
    if img.mode in ("LA", "PA"):
        img = img.convert("RGBA")
    if img.mode == "RGBA":
        background = Image.new("RGB", img.size, (255, 255, 255))
        background.paste(img, mask=img.split()[3])
        return background
    return img.convert("RGB") if img.mode != "RGB" else img


def _wide_grey_to_l(img: Image.Image) -> Image.Image:
    """16-bit, 32-bit int and float greyscale to 8 bits by a fixed scale, never by the image's own peak.

    Scaling by the peak would turn a uniform 16-bit mid-grey (32768) into white; ``/257`` maps the 16-bit
    range exactly onto 0..255. 32-bit integers are treated as 16-bit data (what Pillow gives for most such
    files) unless they exceed that range; floats are taken as 0..1 if they fit, else clipped.
    """
    import numpy as np

    arr = np.asarray(img, dtype=np.float64)
    peak = float(arr.max()) if arr.size else 0.0
    if img.mode == "F":
        scale = 255.0 if peak <= 1.0 else 1.0
    elif img.mode == "I" and peak > 65535:
        scale = 255.0 / peak
    else:
        scale = 1.0 / 257.0
    return Image.fromarray(np.rint(arr * scale).clip(0, 255).astype("uint8"), mode="L")


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
        data = buf.getvalue()
        return decode_image(data, max_bytes=max(max_bytes, len(data)), max_pixels=max_pixels)
    if isinstance(source, bytes | bytearray | memoryview):
        return decode_image(bytes(source), max_bytes=max_bytes, max_pixels=max_pixels)
    if isinstance(source, Path):
        return _read_path(source, max_bytes, max_pixels)
    if isinstance(source, str):
        if source.startswith("data:"):
            return decode_image(data_url_bytes(source), max_bytes=max_bytes, max_pixels=max_pixels)
        if source.startswith(("http://", "https://")):
            raise ImageError("remote image URLs are not fetched by the model layer; import them into a set")
        path = Path(source[7:] if source.startswith("file://") else source)
        return _read_path(path, max_bytes, max_pixels)
    raise ImageError(f"unsupported image value of type {type(source).__name__}")


def data_url_bytes(url: str) -> bytes:
    """The payload of a base64 ``data:`` URL (the only inline form the API accepts)."""
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise ImageError("data: URLs must be base64 encoded")
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError as exc:
        raise ImageError(f"invalid base64 in data URL: {exc}") from exc


def _read_path(path: Path, max_bytes: int, max_pixels: int) -> DecodedImage:
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise PayloadTooLarge(f"{path.name} is {size} bytes; the limit is {max_bytes}", limit=max_bytes)
        data = path.read_bytes()
    except OSError as exc:
        raise ImageError(f"cannot read image file {path}: {exc.strerror or exc}") from exc
    return decode_image(data, max_bytes=max_bytes, max_pixels=max_pixels)


class ImageLike(Protocol):
    """What the model layer needs of an image: its content hash, and pixels (or the encoded bytes, for a
    decoder on the GPU) only on a package miss."""

    @property
    def sha256(self) -> str: ...

    @property
    def image(self) -> Image.Image: ...

    @property
    def data(self) -> bytes: ...

    def decoded(self, memory: Memory | None = None) -> DecodedImage:
        """The decoded image (decoded now if it was not: into ``memory`` where :func:`decode_image` can)."""
        ...


class StoredImage:
    """An image known by its sha256 whose bytes are read (and decoded) only if its pixels are needed.

    Search passes references this way: with their packages cached, no blob is read and nothing is decoded.
    """

    def __init__(
        self,
        sha256: str,
        load: Callable[[], bytes],
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
    ) -> None:
        self._sha256 = sha256
        self._load = load
        self._limits = (max_bytes, max_pixels)
        self._decoded: DecodedImage | None = None

    @property
    def sha256(self) -> str:
        return self._sha256

    @property
    def data(self) -> bytes:
        """The encoded bytes (read again from the source: nothing is kept but the decoded image)."""
        return self._decoded.data if self._decoded is not None else self._load()

    @property
    def image(self) -> Image.Image:
        return self.decoded().image

    def decoded(self, memory: Memory | None = None) -> DecodedImage:
        if self._decoded is None:
            self._decoded = self._decode(memory)
        return self._decoded

    def _decode(self, memory: Memory | None) -> DecodedImage:
        """Decoded and checked against the hash it is known by (a blob changed on disk is refused)."""
        decoded = decode_image(self._load(), max_bytes=self._limits[0], max_pixels=self._limits[1], memory=memory)
        if decoded.sha256 != self._sha256:
            raise ImageError(f"stored image {self._sha256[:12]} does not match its content hash")
        return decoded


class ReceivedImage(StoredImage):
    """Bytes that came with a request, hashed when they arrived: decoded on first pixel access, never hashed again
    (they are the very bytes the hash was taken of)."""

    def __init__(self, data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_pixels: int = DEFAULT_MAX_DECODED_PIXELS) -> None:
        super().__init__(sha256_hex(data), lambda: data, max_bytes=max_bytes, max_pixels=max_pixels)

    def _decode(self, memory: Memory | None) -> DecodedImage:
        return decode_image(self._load(), max_bytes=self._limits[0], max_pixels=self._limits[1], sha256=self.sha256,
                            memory=memory)


class EncodedImage:
    """Image bytes whose header passed the checks (:func:`inspect_image`); the pixels are decoded only when
    asked for (PIL, in :attr:`image`), or by a decoder that reads :attr:`data` (nvJPEG on a GPU).

    Ingestion holds images this way: a duplicate is recognised by its sha256 and never decoded, and the
    decode runs where preprocessing runs (threads, or the GPU) instead of on the loader threads.
    """

    def __init__(self, data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_pixels: int = DEFAULT_MAX_DECODED_PIXELS, sha256: str | None = None) -> None:
        self.info = inspect_image(data, max_bytes=max_bytes, max_pixels=max_pixels)
        self._data = data
        self.sha256 = sha256 or sha256_hex(data)
        self.format = self.info.format
        turned = self.info.orientation in (5, 6, 7, 8)  # EXIF rotations by 90 degrees swap the sides
        self.width = self.info.height if turned else self.info.width
        self.height = self.info.width if turned else self.info.height
        self._limits = (max_bytes, max_pixels)
        self._decoded: DecodedImage | None = None

    @property
    def data(self) -> bytes:
        return self._data

    @property
    def image(self) -> Image.Image:
        return self.decoded().image

    def decoded(self, memory: Memory | None = None) -> DecodedImage:
        if self._decoded is None:
            self._decoded = decode_image(self._data, max_bytes=self._limits[0], max_pixels=self._limits[1],
                                         sha256=self.sha256, memory=memory)
        return self._decoded


class ReferenceImage(StoredImage):
    """An image of a reference set, read from the blob store only if its pixels are needed.

    The type says what the image is for: a vision encode of a reference while serving is a cache miss the
    product promises never to have, so the package stage counts it apart from query images.
    """


def image_handle(
    source: Any,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
) -> ImageLike:
    """Like :func:`read_image_source`, but bytes are only hashed now and decoded on first pixel access.

    A cached package makes decoding pointless (its image was validated when the package was made), so a
    repeated reference costs a sha256 instead of a full decode. A new image is still fully validated:
    the vision encoder asks for its pixels and gets an :class:`ImageError` for a hostile one.
    """
    if isinstance(source, DecodedImage | StoredImage):
        return source
    data: bytes | None = None
    if isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
    elif isinstance(source, str) and source.startswith("data:"):
        data = data_url_bytes(source)
    if data is None:
        return read_image_source(source, max_bytes=max_bytes, max_pixels=max_pixels)
    check_size(data, max_bytes)
    return ReceivedImage(data, max_bytes=max_bytes, max_pixels=max_pixels)
