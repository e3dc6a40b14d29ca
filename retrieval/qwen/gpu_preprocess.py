"""Qwen3-VL preprocessing on the GPU: resize, rescale, normalise and patchify as tensor ops.

The official path (``qwen_vl_utils.fetch_image`` + the checkpoint's image processor on the CPU) costs
~230 ms to resize a 12-megapixel photo and ~170 ms to decode it (bench/gpu_probe.py on the H100 box), far
more than the tower's ~40 ms. Here, on the model's device:

- decode: the image's own pixels as PIL decodes them (CPU, exact; threads), or with ``nvjpeg=True`` JPEGs
  decoded by nvJPEG (``torchvision.io.decode_jpeg`` on the device, EXIF orientation applied);
- resize to ``smart_resize``'s size with ``torch.nn.functional.interpolate`` (bicubic, antialias, rounded
  to 8-bit levels as PIL's resize is);
- rescale, normalise and patchify with the checkpoint's own image processor (its torch ops, on the
  device), so given the same resized pixels the patches are exactly the official ones.

The pixels differ from the official ones by the resize implementation (and nvJPEG's IDCT), so packages
made this way get their own fingerprint (``resize`` names the implementation); the embedding deviation is
measured by bench/gpu_preprocess_deviation.py and documented in README.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from retrieval.errors import ImageError
from retrieval.images import DecodedImage, ImageLike, inspect_image

Grid = tuple[int, int, int]
Result = tuple[torch.Tensor, Grid] | Exception


class GpuPreprocessor:
    """Images -> (patches on the device, grid) per image, or the error for that image alone."""

    def __init__(self, image_processor: Any, *, min_pixels: int, max_pixels: int, device: torch.device,
                 dtype: torch.dtype, nvjpeg: bool = False) -> None:
        self.ip = image_processor
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.device, self.dtype, self.nvjpeg = device, dtype, nvjpeg
        self.factor = int(image_processor.patch_size) * int(image_processor.merge_size)

    @staticmethod
    def implementation(nvjpeg: bool) -> str:
        import torchvision

        decode = f"nvjpeg (torchvision {torchvision.__version__})" if nvjpeg else "PIL"
        return f"gpu: decode {decode}; torch {torch.__version__.split('+')[0]} bicubic antialias"

    def process(self, images: Sequence[ImageLike], cpu_map: Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]],
                ) -> list[Result]:
        """``cpu_map`` runs a function over items in threads (PIL decodes release the GIL)."""
        pixels: list[torch.Tensor | Exception | None] = [None] * len(images)
        if self.nvjpeg:
            self._decode_jpegs(images, pixels)
        rest = [k for k, p in enumerate(pixels) if p is None]
        for k, result in zip(rest, cpu_map(_pil_pixels, [images[k] for k in rest]), strict=True):
            pixels[k] = result
        out: list[Result] = []
        for p in pixels:
            if isinstance(p, Exception) or p is None:
                out.append(p if p is not None else ImageError("image was not decoded"))
                continue
            try:
                out.append(self._patches(p.to(self.device, non_blocking=True)))
            except ValueError as exc:  # e.g. aspect ratio above 200, as the official resize refuses it
                out.append(ImageError(f"image cannot be resized for the model: {exc}"))
        return out

    def _patches(self, chw: torch.Tensor) -> tuple[torch.Tensor, Grid]:
        from qwen_vl_utils.vision_process import smart_resize

        _, height, width = chw.shape
        h, w = smart_resize(height, width, factor=self.factor, min_pixels=self.min_pixels,
                            max_pixels=self.max_pixels)
        x = chw.unsqueeze(0).to(torch.float32)
        if (h, w) != (height, width):
            x = torch.nn.functional.interpolate(x, size=(h, w), mode="bicubic", antialias=True, align_corners=False)
            x = x.round_().clamp_(0, 255)  # PIL's resize gives 8-bit levels
        x = self.ip.rescale_and_normalize(x, True, self.ip.rescale_factor, True, self.ip.image_mean,
                                          self.ip.image_std)
        patches, grid_h, grid_w = self.ip.patchify(x, patch_size=int(self.ip.patch_size),
                                                   merge_size=int(self.ip.merge_size),
                                                   temporal_patch_size=int(self.ip.temporal_patch_size))
        return patches[0].to(self.dtype), (1, int(grid_h), int(grid_w))

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


def _pil_pixels(img: ImageLike) -> torch.Tensor | Exception:
    """The image as the official path decodes it (PIL, EXIF applied, RGB), as a CHW uint8 tensor."""
    try:
        array = np.asarray(img.image)
    except Exception as exc:  # a per-image error (corrupt data, a blob that is gone)
        return exc
    return torch.from_numpy(np.array(array)).permute(2, 0, 1)  # a writable copy
