"""Qwen3-VL preprocessing as tensor ops on the model's device: decode, resize, rescale, normalise, patchify.

The official path (``qwen_vl_utils.fetch_image`` + the checkpoint's image processor on the CPU) spends far
longer resizing and decoding a 12-megapixel photo than the tower spends on it (docs/performance.md,
"Measurements behind the code"). Here, on the model's device:

- decode: the image's own pixels as PIL decodes them (CPU threads: libjpeg-turbo works without the GIL), or
  with ``nvjpeg=True`` JPEGs decoded by nvJPEG (``torchvision.io.decode_jpeg`` on the device, EXIF orientation
  applied);
- resize to ``smart_resize``'s size with Pillow's own bicubic arithmetic (:mod:`.exact_resize`),
  so the resized pixels are exactly those of ``fetch_image``;
- rescale, normalise and patchify with the checkpoint's own image processor (its torch ops, on the device).

With PIL's decode the patches are bit-identical to the official ones, so the packages share the official
fingerprint; nvJPEG's IDCT differs from libjpeg-turbo's by a level here and there, so its packages get their own
(``resize`` names the decoder) and its embedding deviation is measured by bench/gpu_preprocess_deviation.py.

On CUDA the work runs on a side stream of the calling thread (:meth:`GpuPreprocessor.run`), never on the
stream the towers and the LM run on: there it queued behind (and held up) the passes of earlier batches, and
the LM's read-back of its vectors waited for the next batch's preprocessing. It also closes a race:
torchvision allocates nvJPEG's output on the caller's stream but writes it on its own decoder stream after
syncing only that one, so memory the caller's stream had freed but was still using could be overwritten. The
side stream is synchronised first (it holds only earlier preprocessing), and the consumer's stream waits for
an event and marks the tensors as used there (:func:`adopt`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from PIL import Image

from rubricsearch.retrieval.errors import ImageError
from rubricsearch.retrieval.images import DecodedImage, ImageLike, inspect_image
from rubricsearch.retrieval.plugins.accelerated.exact_resize import resize

Grid = tuple[int, int, int]
Result = tuple[torch.Tensor, Grid] | Exception
# Pixels (decoded or resized, the larger) per batched pass: its float32 copies and patches peak near 5 x 12 bytes
# a pixel, about 1 GiB at this cap (a 448 px batch of 64 is one pass; a 12-MP photo goes alone).
GROUP_PIXELS = 1 << 24
# Side streams come from torch's pool of priority -1, which nothing else here draws from (the vector search's
# mirrors take -2's): a pooled stream is then shared only by preprocessing threads, which take turns on it
# (:func:`_turn`).
PRIORITY = -1
_TURNS: dict[int, threading.Lock] = {}
_TURNS_LOCK = threading.Lock()


class GpuPreprocessor:
    """Images -> (patches on the device, grid) per image, or the error for that image alone."""

    def __init__(self, image_processor: Any, *, min_pixels: int, max_pixels: int, device: torch.device,
                 dtype: torch.dtype, nvjpeg: bool = False) -> None:
        self.ip = image_processor
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.device, self.dtype, self.nvjpeg = device, dtype, nvjpeg
        self.factor = int(image_processor.patch_size) * int(image_processor.merge_size)
        self._streams = threading.local()  # one side stream per preprocessing thread

    def run(self, images: Sequence[ImageLike], cpu_map: Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]],
            ) -> tuple[list[Result], Any]:
        """:meth:`process` on this thread's side stream (CUDA), with the event a consumer waits for (else None)."""
        if self.device.type != "cuda":
            return self.process(images, cpu_map), None
        stream = getattr(self._streams, "stream", None)
        if stream is None:  # torch hands out streams from a pool of 32: threads may share one, so they take turns
            stream = self._streams.stream = torch.cuda.Stream(device=self.device, priority=PRIORITY)
        with _turn(stream):
            stream.synchronize()  # nothing queued may still use memory nvJPEG is about to write (module docstring)
            with torch.cuda.stream(stream):
                results = self.process(images, cpu_map)
                ready = torch.cuda.Event()
                ready.record(stream)
        return results, ready

    def process(self, images: Sequence[ImageLike], cpu_map: Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]],
                ) -> list[Result]:
        """``cpu_map`` runs a function over items in threads (PIL decodes release the GIL)."""
        pixels: list[torch.Tensor | Exception | None] = [None] * len(images)
        if self.nvjpeg:
            self._decode_jpegs(images, pixels)
        rest = [k for k, p in enumerate(pixels) if p is None]
        pixels_of = _pinned_pixels if self.device.type == "cuda" else _pil_pixels
        for k, result in zip(rest, cpu_map(pixels_of, [images[k] for k in rest]), strict=True):
            pixels[k] = result
        out: list[Result | None] = [None] * len(images)
        groups: dict[tuple[int, ...], list[int]] = {}  # same decoded and target size: one batched pass
        for k, p in enumerate(pixels):
            if isinstance(p, Exception) or p is None:
                out[k] = p if p is not None else ImageError("image was not decoded")
                continue
            try:
                groups.setdefault((*p.shape[-2:], *self._target(p)), []).append(k)
            except ValueError as exc:  # e.g. aspect ratio above 200, as the official resize refuses it
                out[k] = ImageError(f"image cannot be resized for the model: {exc}")
        for key, members in groups.items():
            per = max(1, GROUP_PIXELS // max(key[0] * key[1], key[2] * key[3]))
            for at in range(0, len(members), per):
                chunk = members[at:at + per]
                batch = torch.stack([_upload(_tensor(pixels[k]), self.device) for k in chunk])
                try:
                    done: list[Result] = list(self._patches(batch, (key[2], key[3])))
                except ValueError as exc:  # the same for every image of the chunk (one size)
                    done = [ImageError(f"image cannot be resized for the model: {exc}")] * len(chunk)
                for k, result in zip(chunk, done, strict=True):
                    out[k] = result
        return [r if r is not None else ImageError("image was not preprocessed") for r in out]

    def _target(self, chw: torch.Tensor) -> tuple[int, int]:
        """``smart_resize``'s size for the image (raises ValueError where the official resize refuses it)."""
        from qwen_vl_utils.vision_process import smart_resize

        _, height, width = chw.shape
        h, w = smart_resize(height, width, factor=self.factor, min_pixels=self.min_pixels,
                            max_pixels=self.max_pixels)
        return int(h), int(w)

    def _patches(self, batch: torch.Tensor, size: tuple[int, int]) -> list[tuple[torch.Tensor, Grid]]:
        """Images of one size ``[n, C, H, W]`` (uint8) -> per image (patches, grid): each op runs once for the
        group, and gives every image exactly what it would give alone (the ops work image by image)."""
        x = resize(batch, size)
        x = self.ip.rescale_and_normalize(x, True, self.ip.rescale_factor, True, self.ip.image_mean,
                                          self.ip.image_std)
        patches, grid_h, grid_w = self.ip.patchify(x, patch_size=int(self.ip.patch_size),
                                                   merge_size=int(self.ip.merge_size),
                                                   temporal_patch_size=int(self.ip.temporal_patch_size))
        patches = patches.to(self.dtype)
        return [(patches[b], (1, int(grid_h), int(grid_w))) for b in range(patches.shape[0])]

    def _decode_jpegs(self, images: Sequence[ImageLike], pixels: list[torch.Tensor | Exception | None]) -> None:
        """nvJPEG for 8-bit RGB or greyscale JPEGs (others keep PIL); a bad file fails alone."""
        from torchvision.io import ImageReadMode, decode_jpeg

        picked, raw = [], []
        for k, img in enumerate(images):
            if isinstance(img, DecodedImage):
                continue  # already decoded: its pixels are the official ones
            try:
                data = img.data
                if data[:2] != b"\xff\xd8" or inspect_image(data).mode not in ("RGB", "L"):
                    continue
            except Exception:
                continue
            picked.append(k)
            raw.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if not raw:
            return
        try:
            decoded = decode_jpeg(raw, mode=ImageReadMode.RGB, device=self.device, apply_exif_orientation=True)
        except RuntimeError:  # one bad file fails the batch call: decode one by one to find it
            decoded = []
            for tensor in raw:
                try:
                    decoded.append(decode_jpeg(tensor, mode=ImageReadMode.RGB, device=self.device,
                                               apply_exif_orientation=True))
                except RuntimeError as exc:
                    decoded.append(ImageError(f"image data is corrupt or truncated: {exc}"))
        for k, result in zip(picked, decoded, strict=True):
            pixels[k] = result


def _pil_pixels(img: ImageLike, pin: bool = False) -> torch.Tensor | Exception:
    """The image as the official path decodes it (PIL, EXIF applied, RGB), as a CHW view of HWC memory with a
    fourth, unused channel (Pillow keeps RGB pixels in 4 bytes). An RGB file that needs no rotation is decoded
    straight into that memory (the decoder's rows land there: no 48 MB copy of a 12-MP photo, and none of the page
    faults of fresh memory, since the host allocator hands its cached blocks out again); any other image is pasted
    into it, a plain copy of its rows without the GIL (``np.asarray`` packs them to 3 bytes holding the GIL, which
    serialised the preprocessing threads on 12-MP photos: docs/preprocessing.md, "gpu-nvjpeg's deviation").
    ``pin``: the memory is pinned, so the upload to the GPU is a fast asynchronous copy. :func:`_upload` drops the
    fourth channel."""

    made: list[torch.Tensor] = []

    def memory(width: int, height: int) -> Any:
        made.append(torch.empty((height, width, 4), dtype=torch.uint8, pin_memory=pin))
        return made[-1].numpy()

    try:
        decoded = img.decoded(memory)
        image = decoded.image
        if image.mode != "RGB":  # pragma: no cover - the decoder gives RGB
            raise ImageError(f"expected an RGB image, got {image.mode}")
    except Exception as exc:  # a per-image error (corrupt data, a blob that is gone)
        return exc
    if made and decoded.buffer is not None:  # decoded in place just now
        return made[0].permute(2, 0, 1)
    owner = getattr(decoded.buffer, "base", None)  # decoded in place for another tower: the tensor under its view
    if isinstance(owner, torch.Tensor) and (not pin or owner.is_pinned()):
        return owner.permute(2, 0, 1)
    # memory handed to a decoder that then made its own (rare) still fits an image of the same size
    fits = [m for m in made if tuple(m.shape[:2]) == (image.height, image.width)]
    buffer = fits[0] if fits else torch.empty((image.height, image.width, 4), dtype=torch.uint8, pin_memory=pin)
    # mapped, not copied: Pillow writes the rows into ``buffer`` (ImagingCore.paste; the public paste would copy a
    # read-only mapped image first)
    target = Image.frombuffer("RGBX", image.size, buffer.numpy(), "raw", "RGBX", 0, 1)
    target.im.paste(image.im, (0, 0, *image.size))
    return buffer.permute(2, 0, 1)


def _pinned_pixels(img: ImageLike) -> torch.Tensor | Exception:
    return _pil_pixels(img, pin=True)


def _upload(chw: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The image's RGB channels on the device; a host image is copied in its memory order (a strided copy across
    devices would first make a contiguous copy on the host)."""
    if chw.device != device:
        chw = chw.permute(1, 2, 0).to(device, non_blocking=True).permute(2, 0, 1)
    return chw[:3]


def adopt(results: Sequence[Result], ready: Any, device: torch.device) -> None:
    """Make the current stream wait for preprocessing done on a side stream (``ready`` from
    :meth:`GpuPreprocessor.run`) and tell the allocator the pixels are used there, so their memory is not
    handed out again on the side stream while a pass still reads it."""
    if ready is None:
        return
    current = torch.cuda.current_stream(device)
    current.wait_event(ready)
    for result in results:
        if not isinstance(result, Exception):
            result[0].record_stream(current)


def _tensor(p: torch.Tensor | Exception | None) -> torch.Tensor:
    assert isinstance(p, torch.Tensor)
    return p


def _turn(stream: Any) -> threading.Lock:
    """The lock of one pooled stream: from its sync to the end of the work queued on it, one thread uses it, so
    no other thread's queued work can still read memory freed on it when nvJPEG writes there."""
    with _TURNS_LOCK:
        return _TURNS.setdefault(int(stream.cuda_stream), threading.Lock())
