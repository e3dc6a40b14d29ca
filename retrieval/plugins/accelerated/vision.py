"""The accelerated vision encoder: the plain :class:`~retrieval.qwen.engine.vision.VisionEncoder` with the GPU paths.

- Preprocessing: on a GPU the official pixels are made as tensor ops there (:mod:`.gpu_preprocess`, Pillow's
  arithmetic, bit-identical: docs/preprocessing.md), and ``gpu-nvjpeg`` decodes JPEGs with nvJPEG (its own
  fingerprint). CPU-made pixels are cast into pinned memory and uploaded on a side stream while the tower runs.
- Attention: on CUDA all images of a pass go through one variable-length FlashAttention call instead of one SDPA
  call per image (transformers' SDPA path loops over images), runs of photos through cuDNN's fused attention
  (:mod:`.tower_attention`); images are ordered by size for that. The tower's output then differs from the
  per-image path by bf16 rounding only.
- With ``cuda_graphs``, small passes (a search's candidate) replay a CUDA graph per tuple of grids, and with
  ``bulk_graphs`` ingestion's passes of small images too (:mod:`.graphed_tower`).

Off a GPU (and without ``gpu-nvjpeg``) it runs the plain encoder's passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Unpack

import torch

from rubricsearch.retrieval.images import ImageLike
from rubricsearch.retrieval.packages import Prepared, VisualPackage
from rubricsearch.retrieval.plugins.accelerated.gpu_preprocess import GpuPreprocessor, adopt
from rubricsearch.retrieval.plugins.accelerated.graphed_tower import BULK_IMAGE_PATCHES, GraphedTower
from rubricsearch.retrieval.plugins.accelerated.tower_attention import GROUPED_ATTENTION, RUNS, register, runs_of
from rubricsearch.retrieval.qwen.engine.forward import upload
from rubricsearch.retrieval.qwen.engine.vision import (
    EncoderOptions,
    Grid,
    PreprocessMode,
    VisionEncoder,
    _patches,
    _size_order,
)
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen


class AcceleratedVisionEncoder(VisionEncoder):
    """:class:`VisionEncoder` with GPU preprocessing, grouped attention and CUDA graphs (module docstring)."""

    preprocess_modes: tuple[PreprocessMode, ...] = ("official", "gpu-nvjpeg")

    def __init__(
        self,
        loaded: LoadedQwen,
        *,
        grouped_attention: bool | None = None,
        cuda_graphs: bool = False,
        bulk_graphs: bool = False,
        **options: Unpack[EncoderOptions],
    ) -> None:
        """``grouped_attention``: all images of a pass in one attention call (default: on CUDA);
        ``bulk_graphs`` (with ``cuda_graphs``): ingestion passes of small images replay graphs too, once their
        tuple of grids comes a third time (a capture costs two passes); see :class:`GraphedTower`. ``options``:
        the plain encoder's."""
        super().__init__(loaded, **options)
        cuda = loaded.device.type == "cuda"
        nvjpeg = self.preprocess_mode == "gpu-nvjpeg"
        # The official pixels are made where that is fastest: on a GPU as tensor ops (Pillow's arithmetic, exact),
        # on a CPU by PIL's own C resize and the processor (measured: docs/preprocessing.md).
        self._gpu = GpuPreprocessor(
            loaded.processor.image_processor, min_pixels=self.min_pixels, max_pixels=self.max_pixels,
            device=loaded.device, dtype=loaded.model.visual.dtype, nvjpeg=nvjpeg,
        ) if cuda or nvjpeg else None
        available = register()
        self.grouped_attention = (cuda if grouped_attention is None else grouped_attention) and available
        # Small passes replay CUDA graphs; they need the grouped attention (the per-image SDPA path of
        # transformers reads the image lengths back from the GPU, which a graph cannot hold).
        self.cuda_graphs = cuda_graphs and cuda and self.grouped_attention
        self._graphs = GraphedTower(loaded.model.visual, loaded.device) if self.cuda_graphs else None
        self._bulk = GraphedTower(loaded.model.visual, loaded.device, max_images=self.max_batch_patches,
                                  max_patches=self.max_batch_patches, max_graphs=2, after=3, one_length=True,
                                  max_image_patches=BULK_IMAGE_PATCHES,
                                  check_finite=True) if self.cuda_graphs and bulk_graphs else None
        self._upload_stream: Any = None

    # -- preprocessing --------------------------------------------------------------------------
    def prepare(self, images: Sequence[ImageLike]) -> Prepared:
        """Preprocess the images and, on CUDA, upload them on a side stream (or make them there)."""
        todo = {img.sha256: img for img in images}
        out = Prepared()
        if self._gpu is not None:  # pixels made on the device (a side stream): nothing to upload
            results, out.ready = self._gpu.run(list(todo.values()), self._map)
            for sha, result in zip(todo, results, strict=True):
                if isinstance(result, Exception):
                    out.errors[sha] = result
                else:
                    out.pixels[sha] = result
            out.order = sorted(out.pixels, key=lambda sha: _size_order(out.pixels[sha][1]))
            return out
        resized: list[tuple[str, Any]] = []
        for sha, result in zip(todo, self._map(self._resize, list(todo.values())), strict=True):
            if isinstance(result, Exception):
                out.errors[sha] = result
            else:
                resized.append((sha, result))
        # The tower's order (by patch count, stable) already here: the upload needs no reordering.
        resized.sort(key=lambda pair: pair[1].size[0] * pair[1].size[1])
        cuda = self.loaded.device.type == "cuda"
        dtype = None if cuda else self.loaded.model.visual.dtype
        for (sha, _), result in zip(resized, self._run_processor([r for _, r in resized], dtype), strict=True):
            if isinstance(result, Exception):
                out.errors[sha] = result
            else:
                out.pixels[sha] = result
        out.order = sorted(out.pixels, key=lambda sha: _size_order(out.pixels[sha][1]))
        if out.order and cuda:
            self._upload(out)
        return out

    def _process(self, images: Sequence[ImageLike], dtype: torch.dtype | None = None,
                 ) -> list[tuple[torch.Tensor, Grid] | Exception]:
        """With GPU preprocessing the patches are made on the device; else as the plain encoder makes them."""
        if self._gpu is not None:
            results, ready = self._gpu.run(images, self._map)
            adopt(results, ready, self.loaded.device)
            return results
        return super()._process(images, dtype)

    def _upload(self, prep: Prepared) -> None:
        """Cast into pinned memory (one pass: the tower casts its input to its dtype first anyway, so the
        values are the same) and copy to the GPU on a side stream, overlapping the tower."""
        parts = [prep.pixels[sha] for sha in prep.order]
        rows = sum(p.shape[0] for p, _ in parts)
        host = torch.empty((rows, parts[0][0].shape[1]), dtype=self.loaded.model.visual.dtype, pin_memory=True)
        at = 0
        for sha, (pixels, grid) in zip(prep.order, parts, strict=True):
            n = pixels.shape[0]
            host[at:at + n].copy_(pixels)
            prep.pixels[sha] = (host[at:at + n], grid)
            at += n
        if self._upload_stream is None:
            self._upload_stream = torch.cuda.Stream(device=self.loaded.device)
        with torch.cuda.stream(self._upload_stream):
            prep.device = host.to(self.loaded.device, non_blocking=True)
            prep.ready = torch.cuda.Event()
            prep.ready.record()

    # -- the tower ------------------------------------------------------------------------------
    def _adopt(self, pixels: list[tuple[torch.Tensor, Grid]], prepared: Prepared) -> None:
        if prepared.device is None:  # made on the device by the preprocessing thread's stream
            adopt(pixels, prepared.ready, self.loaded.device)

    def _pixel_values(self, order: list[str], made: dict[str, tuple[torch.Tensor, Grid]],
                      prepared: Prepared | None) -> torch.Tensor:
        """The uploaded copy of ``prepared`` where it holds one, else the plain encoder's."""
        if prepared is None or prepared.device is None:
            return super()._pixel_values(order, made, prepared)
        stream = torch.cuda.current_stream(self.loaded.device)
        if prepared.ready is not None:
            stream.wait_event(prepared.ready)
        prepared.device.record_stream(stream)  # made on the upload stream, used (and freed) on this one
        pixel_values = prepared.device
        if order != prepared.order:  # some prepared images were found in the store meanwhile
            offsets, at = {}, 0
            for sha in prepared.order:
                offsets[sha] = at
                at += _patches(prepared.pixels[sha][1])
            pixel_values = torch.cat([pixel_values[offsets[s]:offsets[s] + _patches(made[s][1])] for s in order])
        return pixel_values

    def _run_tower(self, pixel_values: torch.Tensor, grids: list[Grid], shas: list[str]) -> list[VisualPackage]:
        """One tower pass (a graph replay when small enough) in the grouped attention where it runs."""
        visual = self.loaded.model.visual
        device = self.loaded.device
        with self._lock:
            graphs = self._graphed(grids)  # under the lock: it counts sightings
            config = visual.config
            previous = config._attn_implementation
            if self.grouped_attention:
                RUNS.runs = runs_of([h * w for t, h, w in grids for _ in range(t)])
                config._attn_implementation = GROUPED_ATTENTION
            try:
                if graphs is not None:
                    parts = graphs.run(upload(pixel_values, device).type(visual.dtype), grids)
                else:
                    out = self._eager(pixel_values, grids)
            finally:
                config._attn_implementation = previous
                RUNS.runs = None
            self._count(grids)
        if graphs is None:
            parts = self._split(out, grids)
        return self._packages(shas, grids, parts)

    def _graphed(self, grids: list[Grid]) -> GraphedTower | None:
        """The graphs that take this pass, if any: small ones at once, large ones once their grids come back."""
        if self._graphs is None or torch.is_grad_enabled():
            return None
        if self._graphs.fits(grids):
            return self._graphs
        return self._bulk if self._bulk is not None and self._bulk.wants(grids) else None

    def stats(self) -> dict[str, int]:
        names = ("graph_replays", "graph_captures", "graph_capture_failures")
        small = self._graphs.counters if self._graphs is not None else {}
        bulk = self._bulk.counters if self._bulk is not None else {}
        return {**super().stats(),
                **{f"tower_{name}": small.get(name, 0) for name in names},
                **{f"tower_bulk_{name}": bulk.get(name, 0) for name in names}}
