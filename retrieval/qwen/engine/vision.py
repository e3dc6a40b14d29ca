"""Images -> visual packages: preprocessing and the vision tower, run at most once per image and settings.

Preprocessing gives the official pixels: ``qwen_vl_utils.fetch_image`` (smart_resize to multiples of
patch*merge within min/max pixels), then the checkpoint's image processor with ``do_resize=False``, image by image
in a thread pool (the processor's work is per image, so the pixels are exactly those of one batched call). It can
be done ahead of time with :meth:`VisionEncoder.prepare` while the tower runs an earlier batch. The tower runs
eagerly, fed its grid-derived inputs made on the host (:mod:`.tower`), with the checkpoint's own attention. The
encoder caches nothing itself: the package stage (:class:`~retrieval.packages.VisualPackages`) looks packages up
and calls it only for misses.

This is the plain reference encoder; the accelerated plug-in's
(:class:`~retrieval.plugins.accelerated.vision.AcceleratedVisionEncoder`) makes the same pixels on the GPU, runs
all images of a pass in one attention call and replays CUDA graphs, through the hooks marked below.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Literal, TypedDict

import torch

from rubricsearch.retrieval.errors import ImageError, InvalidInput
from rubricsearch.retrieval.images import ImageLike
from rubricsearch.retrieval.packages import Fingerprint, Prepared, Preprocess, VisualPackage
from rubricsearch.retrieval.qwen.engine.forward import upload
from rubricsearch.retrieval.qwen.engine.tower import longest, per_image, tower_forward, tower_inputs
from rubricsearch.retrieval.qwen.engine.tower_batching import TowerBatcher
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen

DEFAULT_MIN_PIXELS = 4 * 32 * 32  # 4096, official default
DEFAULT_MAX_PIXELS = 1800 * 32 * 32  # 1,843,200, official default
Grid = tuple[int, int, int]
# Bump when rubricsearch changes how pixels reach the tower (decode, orientation, alpha, the resize call).
PREPROCESS_VERSION = "rs1"


def resize_implementation() -> str:
    """The resize code and version that made the pixels (part of every package fingerprint)."""
    import PIL

    try:
        utils = version("qwen-vl-utils")
    except PackageNotFoundError:  # pragma: no cover - a dependency of the project
        utils = "unknown"
    pillow = ".".join(PIL.__version__.split(".")[:2])
    return f"{PREPROCESS_VERSION}: qwen_vl_utils.fetch_image {utils} / Pillow {pillow} bicubic"


PreprocessMode = Literal["official", "gpu-nvjpeg"]


def nvjpeg_decoder() -> str:
    """What decodes JPEGs in the ``gpu-nvjpeg`` mode (part of those packages' fingerprint)."""
    import torchvision

    return f"decode nvjpeg (torchvision {torchvision.__version__})"


def preprocess_spec(processor: Any, min_pixels: int, max_pixels: int, mode: PreprocessMode = "official",
                    ) -> Preprocess:
    """Everything of the preprocessing that decides the tower's input, read off the processor. The official
    pixels have one fingerprint wherever they are made (PIL on a CPU, :mod:`exact_resize` on a GPU)."""
    ip = processor.image_processor
    resize = resize_implementation() if mode == "official" else (
        f"{resize_implementation()}; {nvjpeg_decoder()}")
    return Preprocess(
        min_pixels=int(min_pixels), max_pixels=int(max_pixels), patch_size=int(ip.patch_size),
        merge_size=int(ip.merge_size), temporal_patch_size=int(ip.temporal_patch_size),
        image_mean=tuple(float(v) for v in ip.image_mean), image_std=tuple(float(v) for v in ip.image_std),
        resize=resize,
    )


def tower_fingerprint(loaded: LoadedQwen, min_pixels: int, max_pixels: int, mode: PreprocessMode = "official",
                      ) -> Fingerprint:
    """The package key of a loaded checkpoint's tower at these pixel bounds and preprocessing."""
    return Fingerprint.of(loaded.tower_hash, preprocess_spec(loaded.processor, min_pixels, max_pixels, mode))


class EncoderOptions(TypedDict, total=False):
    """:class:`VisionEncoder`'s keywords, which an encoder built on it takes and passes on whole."""

    min_pixels: int
    max_pixels: int
    max_batch_patches: int | None
    preprocess_threads: int | None
    preprocess: PreprocessMode


class VisionEncoder:
    """Preprocessing + the vision tower of one loaded checkpoint (a :class:`~retrieval.packages.VisionTower`)."""

    # Preprocessing modes this encoder makes pixels for; ``gpu-nvjpeg`` needs the accelerated one.
    preprocess_modes: tuple[PreprocessMode, ...] = ("official",)

    def __init__(
        self,
        loaded: LoadedQwen,
        *,
        min_pixels: int = DEFAULT_MIN_PIXELS,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        max_batch_patches: int | None = None,
        preprocess_threads: int | None = None,
        preprocess: PreprocessMode = "official",
    ) -> None:
        if min_pixels > max_pixels:
            raise ValueError("min_pixels must not exceed max_pixels")
        if preprocess not in self.preprocess_modes:
            raise InvalidInput(f"preprocessing {preprocess!r} runs on the accelerated engine (engine 'auto' or "
                               "'accelerated'); the plain one makes the official pixels")
        self.loaded = loaded
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.preprocess_mode = preprocess
        self.fingerprint: Fingerprint = tower_fingerprint(loaded, min_pixels, max_pixels, preprocess)
        cuda = loaded.device.type == "cuda"
        self.max_batch_patches = max_batch_patches or (65536 if cuda else 16384)
        self.preprocess_threads = preprocess_threads or min(8, os.cpu_count() or 1)
        self.counters = {"tower_images": 0, "tower_batches": 0}
        self._lock = threading.Lock()
        # Concurrent requests' tower chunks run in merged passes (one search = one candidate image).
        self._batcher = TowerBatcher(self._run_tower, self.max_batch_patches)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @property
    def prepare_key(self) -> tuple[object, ...]:
        """Alike preprocessing on the same device and input dtype: prepared pixels are interchangeable."""
        return (self.fingerprint.preprocess, str(self.loaded.device), str(self.loaded.model.visual.dtype))

    @property
    def parameter_count(self) -> int:
        """Parameters held in memory (a vision-only worker's: the tower alone)."""
        return sum(p.numel() for p in self.loaded.model.parameters())

    # -- preprocessing --------------------------------------------------------------------------
    def preprocess(self, images: Sequence[ImageLike]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixel patches and ``image_grid_thw`` exactly as the official embedder prepares them."""
        done = _raise_first(self._process(images))
        pixels = [p for p, _ in done]
        grids = torch.tensor([list(g) for _, g in done], dtype=torch.long)
        return (pixels[0] if len(pixels) == 1 else torch.cat(pixels)), grids

    def prepare(self, images: Sequence[ImageLike]) -> Prepared:
        """Preprocess the images ahead of :meth:`encode`, in the tower's order.

        Per-image failures land in ``errors`` instead of raising, so a caller can fail just those images.
        """
        todo = {img.sha256: img for img in images}
        out = Prepared()
        for sha, result in zip(todo, self._process(list(todo.values()), self.loaded.model.visual.dtype),
                               strict=True):
            if isinstance(result, Exception):
                out.errors[sha] = result
            else:
                out.pixels[sha] = result
        out.order = sorted(out.pixels, key=lambda sha: _size_order(out.pixels[sha][1]))
        return out

    def _process(self, images: Sequence[ImageLike], dtype: torch.dtype | None = None,
                 ) -> list[tuple[torch.Tensor, Grid] | Exception]:
        """(patches, grid) or the error, per image: resizing in threads (PIL works without the GIL), then
        one processor call for all of them (it works per image, so the values are those of single calls).
        ``dtype`` casts the patches as the tower does first anyway."""
        return self._run_processor(self._map(self._resize, images), dtype)

    def _run_processor(self, resized: list[Any], dtype: torch.dtype | None) -> list[Any]:
        results = list(resized)
        ok = [k for k, r in enumerate(results) if not isinstance(r, Exception)]
        if not ok:
            return results
        processor = self.loaded.processor.image_processor
        try:
            out = processor(images=[results[k] for k in ok], do_resize=False, return_tensors="pt")
        except Exception:  # find the image it failed on
            for k in ok:
                try:
                    results[k] = self._cut(processor(images=[results[k]], do_resize=False, return_tensors="pt"),
                                           dtype)[0]
                except Exception as exc:
                    results[k] = exc
            return results
        for k, done in zip(ok, self._cut(out, dtype), strict=True):
            results[k] = done
        return results

    def _resize(self, img: ImageLike) -> Any:
        from qwen_vl_utils import fetch_image

        try:
            return fetch_image({"image": img.image, "min_pixels": self.min_pixels, "max_pixels": self.max_pixels},
                               image_patch_size=int(self.loaded.processor.image_processor.patch_size))
        except ValueError as exc:  # e.g. aspect ratio above 200
            return ImageError(f"image {img.sha256[:12]} cannot be resized for the model: {exc}")
        except Exception as exc:  # e.g. a stored image whose blob is gone
            return exc

    @staticmethod
    def _cut(out: Any, dtype: torch.dtype | None) -> list[tuple[torch.Tensor, Grid]]:
        pixels = out["pixel_values"] if dtype is None else out["pixel_values"].to(dtype)
        done, at = [], 0
        for t, h, w in out["image_grid_thw"].tolist():
            n = int(t) * int(h) * int(w)
            done.append((pixels[at:at + n], (int(t), int(h), int(w))))
            at += n
        return done

    def _map(self, fn: Any, images: Sequence[ImageLike]) -> list[Any]:
        if len(images) < 2 or self.preprocess_threads < 2:
            return [fn(img) for img in images]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.preprocess_threads, thread_name_prefix="vision-preprocess")
            pool = self._pool
        return list(pool.map(fn, images))

    def close(self) -> None:
        """Stop and join the preprocessing threads (a later call starts new ones)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # -- the tower ------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, images: Sequence[ImageLike], prepared: Prepared | None = None) -> list[VisualPackage]:
        """Run preprocessing + the vision tower (no cache lookup), in batches bounded by patch count.

        ``prepared`` (from :meth:`prepare`, possibly for more images) supplies pixels made ahead of time;
        images it lacks are preprocessed here."""
        if not images:
            return []
        shas = [img.sha256 for img in images]
        unique = {img.sha256: img for img in images}
        have: dict[str, tuple[torch.Tensor, Grid]] = {}
        if prepared is not None:
            for sha in unique:
                if sha in prepared.errors:
                    raise prepared.errors[sha]
            have = {sha: prepared.pixels[sha] for sha in unique if sha in prepared.pixels}
            self._adopt(list(have.values()), prepared)
        todo = [img for sha, img in unique.items() if sha not in have]
        fresh = _raise_first(self._process(todo, self.loaded.model.visual.dtype))
        made = {**have, **dict(zip([img.sha256 for img in todo], fresh, strict=True))}
        order = sorted(unique, key=lambda sha: _size_order(made[sha][1]))  # same-sized images side by side
        grids = [made[sha][1] for sha in order]
        pixel_values = self._pixel_values(order, made, prepared if not todo else None)
        by_sha_pkg: dict[str, VisualPackage] = {}
        start_img, start_patch = 0, 0
        while start_img < len(order):
            end_img, total = start_img, 0
            while end_img < len(order) and (
                end_img == start_img or total + _patches(grids[end_img]) <= self.max_batch_patches
            ):
                total += _patches(grids[end_img])
                end_img += 1
            chunk = pixel_values[start_patch:start_patch + total]
            for pkg in self._batcher.run(chunk, grids[start_img:end_img], order[start_img:end_img]):
                by_sha_pkg[pkg.image_sha256] = pkg
            start_img, start_patch = end_img, start_patch + total
        return [by_sha_pkg[sha] for sha in shas]

    # Where the accelerated encoder hooks in: pixels made on (or uploaded to) the device ahead of the pass.
    def _adopt(self, pixels: list[tuple[torch.Tensor, Grid]], prepared: Prepared) -> None:
        """Make this thread's work wait for pixels ``prepared`` made elsewhere (host pixels: nothing to wait for)."""

    def _pixel_values(self, order: list[str], made: dict[str, tuple[torch.Tensor, Grid]],
                      prepared: Prepared | None) -> torch.Tensor:
        """The pass's pixels, its images in ``order`` (``prepared``: it made every one of them)."""
        return torch.cat([made[sha][0] for sha in order]) if len(order) > 1 else made[order[0]][0]

    def _run_tower(self, pixel_values: torch.Tensor, grids: list[Grid], shas: list[str]) -> list[VisualPackage]:
        """One tower pass; the output is split with the grids known here, so nothing waits for the device."""
        with self._lock:
            out = self._eager(pixel_values, grids)
            self._count(grids)
        return self._packages(shas, grids, self._split(out, grids))

    def _eager(self, pixel_values: torch.Tensor, grids: list[Grid]) -> Any:
        """The tower's output for a pass, its grid-derived inputs made on the host as a graph's are: handed
        ``grid_thw`` on the device, the tower's own ``.tolist()`` and ``repeat_interleave`` would sync the stream
        several times a pass."""
        visual = self.loaded.model.visual
        device = self.loaded.device
        pixels = upload(pixel_values, device).type(visual.dtype)  # host pixels: no wait for the device either
        return tower_forward(visual, {"pixels": pixels, **tower_inputs(visual, grids, device)}, longest(grids))

    def _count(self, grids: list[Grid]) -> None:
        self.counters["tower_images"] += len(grids)
        self.counters["tower_batches"] += 1

    def _split(self, out: Any, grids: list[Grid]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        merge = int(self.loaded.model.visual.spatial_merge_size) ** 2
        sizes = [t * h * w // merge for t, h, w in grids]
        return per_image(out.pooler_output, torch.stack(list(out.deepstack_features)), sizes)

    def _packages(self, shas: list[str], grids: list[Grid], parts: list[tuple[torch.Tensor, torch.Tensor]],
                  ) -> list[VisualPackage]:
        return [
            VisualPackage(image_sha256=sha, fingerprint=self.fingerprint, grid_thw=grid, embeds=embeds_i,
                          deepstack=deepstack_i)  # made under inference mode: nothing to detach
            for sha, grid, (embeds_i, deepstack_i) in zip(shas, grids, parts, strict=True)
        ]

    def stats(self) -> dict[str, int]:
        return {**self.counters, **self._batcher.counters}


def _size_order(grid: Grid) -> tuple[int, Grid]:
    """Sort key of a pass's images: by size, then by grid, so a batch of photos in both orientations makes
    the same tuple of grids whatever the upload order (the bulk graphs are keyed by it)."""
    return _patches(grid), grid


def _patches(grid: Grid) -> int:
    return grid[0] * grid[1] * grid[2]


def _raise_first(results: list[tuple[torch.Tensor, Grid] | Exception]) -> list[tuple[torch.Tensor, Grid]]:
    done = []
    for r in results:
        if isinstance(r, Exception):
            raise r
        done.append(r)
    return done
