"""Images -> visual packages: preprocessing and the vision tower, run at most once per image and settings.

Preprocessing follows the official path: ``qwen_vl_utils.fetch_image`` (smart_resize to multiples of
patch*merge within min/max pixels), then the checkpoint's image processor with ``do_resize=False``.
On a store hit neither preprocessing nor the tower runs.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from retrieval.errors import ImageError
from retrieval.images import ImageLike
from retrieval.packages import Fingerprint, PackageStore, VisualPackage
from retrieval.qwen.loading import LoadedQwen

DEFAULT_MIN_PIXELS = 4 * 32 * 32  # 4096, official default
DEFAULT_MAX_PIXELS = 1800 * 32 * 32  # 1,843,200, official default


class VisionEncoder:
    """Get-or-compute visual packages for decoded images, batching the misses through the tower."""

    def __init__(
        self,
        loaded: LoadedQwen,
        store: PackageStore,
        *,
        min_pixels: int = DEFAULT_MIN_PIXELS,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        max_batch_patches: int | None = None,
    ) -> None:
        if min_pixels > max_pixels:
            raise ValueError("min_pixels must not exceed max_pixels")
        self.loaded = loaded
        self.store = store
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.fingerprint: Fingerprint = loaded.fingerprint(min_pixels, max_pixels)
        default_patches = 65536 if loaded.device.type == "cuda" else 16384
        self.max_batch_patches = max_batch_patches or default_patches
        self.counters = {"vision_encodes": 0, "vision_batches": 0, "package_hits": 0, "package_misses": 0}
        self._lock = threading.Lock()

    def packages(self, images: Sequence[ImageLike]) -> list[VisualPackage]:
        """One package per input image (same order); each distinct image is encoded at most once."""
        found: dict[str, VisualPackage] = {}
        missing: dict[str, ImageLike] = {}
        for img in images:
            if img.sha256 in found or img.sha256 in missing:
                continue
            pkg = self.store.get(img.sha256, self.fingerprint)
            if pkg is None:
                missing[img.sha256] = img
                self.counters["package_misses"] += 1
            else:
                found[img.sha256] = pkg
                self.counters["package_hits"] += 1
        if missing:
            for pkg in self.encode(list(missing.values())):
                found[pkg.image_sha256] = self.store.put(pkg)
        return [found[img.sha256] for img in images]

    def preprocess(self, images: Sequence[ImageLike]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixel patches and ``image_grid_thw`` exactly as the official embedder prepares them."""
        from qwen_vl_utils import fetch_image

        patch = int(self.loaded.processor.image_processor.patch_size)
        resized = []
        for img in images:
            try:
                resized.append(fetch_image(
                    {"image": img.image, "min_pixels": self.min_pixels, "max_pixels": self.max_pixels},
                    image_patch_size=patch,
                ))
            except ValueError as exc:  # e.g. aspect ratio above 200
                raise ImageError(f"image {img.sha256[:12]} cannot be resized for the model: {exc}") from exc
        out = self.loaded.processor.image_processor(images=resized, do_resize=False, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    @torch.inference_mode()
    def encode(self, images: Sequence[ImageLike]) -> list[VisualPackage]:
        """Run preprocessing + the vision tower (no store lookup), in batches bounded by patch count."""
        if not images:
            return []
        pixel_values, grids = self.preprocess(images)
        patches = grids.prod(-1).tolist()
        results: list[VisualPackage] = []
        start_img, start_patch = 0, 0
        while start_img < len(images):
            end_img, total = start_img, 0
            while end_img < len(images) and (
                end_img == start_img or total + patches[end_img] <= self.max_batch_patches
            ):
                total += patches[end_img]
                end_img += 1
            chunk = pixel_values[start_patch:start_patch + total]
            results.extend(self._run_tower(chunk, grids[start_img:end_img], images[start_img:end_img]))
            start_img, start_patch = end_img, start_patch + total
        return results

    def _run_tower(
        self, pixel_values: torch.Tensor, grids: torch.Tensor, images: Sequence[ImageLike]
    ) -> list[VisualPackage]:
        model = self.loaded.model
        with self._lock:
            out: Any = model.get_image_features(
                pixel_values.to(self.loaded.device), grids.to(self.loaded.device), return_dict=True
            )
            self.counters["vision_encodes"] += len(images)
            self.counters["vision_batches"] += 1
        embeds = out.pooler_output  # tuple of [n_i, H]
        levels = out.deepstack_features  # list over L of tuples of [n_i, H]
        packages = []
        for i, img in enumerate(images):
            t, h, w = (int(v) for v in grids[i].tolist())
            packages.append(VisualPackage(
                image_sha256=img.sha256,
                fingerprint=self.fingerprint,
                grid_thw=(t, h, w),
                embeds=embeds[i].detach(),
                deepstack=torch.stack([lvl[i] for lvl in levels]).detach(),
            ))
        return packages

    def stats(self) -> dict[str, int]:
        return dict(self.counters)
