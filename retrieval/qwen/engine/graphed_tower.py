"""CUDA-graph replays of small vision-tower passes (``RUBRICSEARCH_MODELS__CUDA_GRAPHS``).

A search encodes one candidate image: a 1,024-patch tower pass keeps a fast GPU busy for a few milliseconds, but
launching its kernels from the transformers tower (24 blocks, dozens of kernels each) takes many times that in
Python. Such passes are captured once per tuple of image grids as a CUDA graph and replayed,
as ``graphed_lm`` does for LM passes (its :class:`GraphCache`: LRU, shared memory pool, eager fallback).

A tower pass is fully determined by the grids and the pixels. Everything the tower derives from the grids
with data-dependent steps (``.tolist()``, ``repeat_interleave``, a host tensor copied to the device), which a
graph cannot hold, is computed here on the host once per grid tuple, with transformers' own ``get_vision_*``
functions, and kept on the device: the cumulative image lengths, the longest image, the rotary position ids
and the position-embedding interpolation indices and weights. The tower pops them from its kwargs instead of
computing them, and the grouped attention (``tower_attention``) uses the device ``cu_seqlens`` it is handed
and the host-side runs for everything else. The captured pass then launches only kernels on device tensors. Eager
passes take the same host-made inputs (:func:`tower_forward`), so they never wait for the GPU.

Small passes are graphed (:data:`MAX_IMAGES`, :data:`MAX_PATCHES`): they are the host-bound ones. At 16,384
patches the GPU does 16 times the work of 1,024 (more for attention), well past the time the launches take
(docs/performance.md, "Measurements behind the code"), so a graph
would save little while each one holds its static input and output. 16,384 covers one image of any size the default
``max_pixels`` allows (7,200 patches) and up to 8 concurrent searches' candidates merged by the tower batcher
(under load they queue there); more images make tuples of grids that rarely come back (a graph per tuple would
seldom be replayed). Ingestion batches run eagerly unless ``RUBRICSEARCH_MODELS__BULK_GRAPHS`` is on: then a second
instance (the vision encoder's bulk graphs, ``after=3``, two graphs) replays batches of small images (at most
:data:`BULK_IMAGE_PATCHES` each, all of one length) whose grid tuple comes back, since a set of same-size images is
one tuple batch after batch. A mixed-size set's towers stay eager: its grid tuples rarely repeat, and graphs keyed
by bucketed sizes pay for their pads more than they save. Alone, an ingestion pass of small images is GPU-bound,
but in the pipeline its hundreds of launches wait behind the decoding and writing threads for the GIL, which a
replay does not. Photos are left out: their passes are GPU-bound anyway, so a graph gains nothing while holding
a photo batch's static buffers. Up to :data:`MAX_GRAPHS` grid tuples
keep a graph (LRU): each holds its static pixels and output (2B: about 7 MiB at 1,024 patches, 110 MiB at
16,384), while the intermediates share the pool. Outputs are copied out (two kernels for the batch,
:func:`per_image`) before the next replay can overwrite them. Results equal the eager pass at rounding level;
checked on a GPU in ``tests/test_gpu_tower.py``, the precomputed-input pass on the CPU in
``tests/test_graphed_tower.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rubricsearch.retrieval.qwen.engine.forward import upload
from rubricsearch.retrieval.qwen.engine.graphed_lm import GraphCache

Grid = tuple[int, int, int]
Grids = tuple[Grid, ...]
MAX_IMAGES = 8
MAX_PATCHES = 16384
MAX_GRAPHS = 16


def tower_inputs(visual: Any, grids: Sequence[Grid], device: torch.device) -> dict[str, torch.Tensor]:
    """The grid-derived inputs of a tower pass, computed on the host and uploaded to ``device`` without waiting
    for it (outside any capture): ``cu_seqlens``, ``position_ids``, ``interp_indices``, ``interp_weights``, exactly
    as the tower's forward would compute them from ``grid_thw`` (the same transformers functions). Each image's
    values depend on its grid alone, so they are computed once per distinct grid, in one call for all of them (a
    batch of same-size images pays for one grid, not one per image), and gathered in the batch's order."""
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    distinct = list(dict.fromkeys(grids))
    unique = torch.tensor([list(g) for g in distinct], dtype=torch.long)
    indices, weights = get_vision_interpolation_indices_and_weights(
        unique, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.config.spatial_merge_size)
    sizes = [t * h * w for t, h, w in distinct]
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    spans = {g: (start, start + n) for g, n, start in zip(distinct, sizes, starts, strict=True)}
    rows = torch.from_numpy(np.concatenate([np.arange(*spans[g]) for g in grids]))
    host = {"cu_seqlens": get_vision_cu_seqlens(torch.tensor([list(g) for g in grids], dtype=torch.long)),
            "position_ids": get_vision_position_ids(unique, visual.spatial_merge_size)[rows],
            "interp_indices": indices[rows], "interp_weights": weights[rows]}
    return {name: upload(t, device) for name, t in host.items()}


def longest(grids: Sequence[Grid]) -> int:
    """The longest attention segment (one frame of one image), known on the host."""
    return max(h * w for _, h, w in grids)


def tower_forward(visual: Any, inputs: dict[str, torch.Tensor], max_seqlen: int) -> Any:
    """The tower's output for ``inputs``: ``pixels`` (tower dtype, on its device) and the :func:`tower_inputs`. No
    host data and no sync: ``grid_thw`` is only a placeholder, the tower pops the precomputed values instead."""
    grid_thw = torch.empty((0, 3), dtype=torch.long)  # never read: every value derived from it is given
    return visual(inputs["pixels"], grid_thw=grid_thw, return_dict=True, max_seqlen=max_seqlen,
                  cu_seqlens=inputs["cu_seqlens"], position_ids=inputs["position_ids"],
                  interp_indices=inputs["interp_indices"], interp_weights=inputs["interp_weights"])


def tower_pass(visual: Any, inputs: dict[str, torch.Tensor], max_seqlen: int) -> torch.Tensor:
    """``[1 + levels, tokens, hidden]``: :func:`tower_forward`'s merger output stacked on its DeepStack features (a
    graph returns one tensor)."""
    out = tower_forward(visual, inputs, max_seqlen)
    return torch.stack([out.pooler_output, *out.deepstack_features])


def split_output(stacked: torch.Tensor, grids: Sequence[Grid], merge: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per image: (embeds ``[tokens, hidden]``, deepstack ``[levels, tokens, hidden]``), contiguous and copied,
    so nothing a caller keeps is a view of the graph's static output."""
    sizes = [t * h * w // merge for t, h, w in grids]
    return per_image(stacked[0].clone(memory_format=torch.contiguous_format), stacked[1:], sizes)


def per_image(embeds: torch.Tensor, deepstack: torch.Tensor, sizes: Sequence[int],
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A pass's merged embeddings ``[tokens, hidden]`` (contiguous) and DeepStack features ``[levels, tokens,
    hidden]`` cut into each image's contiguous parts with one gather for the whole batch: embeds are row
    views, the features of every image are copied next to each other (not one copy per image, which launched
    two small kernels per image from the thread the GPU waits on). The cuts are a few torch calls for the
    whole batch, not a few per image: each call lets go of the GIL and waits to get it back."""
    levels, total, hidden = deepstack.shape
    n = np.asarray(sizes, dtype=np.int64)
    starts, rows = np.cumsum(n) - n, levels * n  # each image: first token, rows of its output block
    k = np.arange(levels * total, dtype=np.int64) - np.repeat(np.cumsum(rows) - rows, rows)  # row in its block
    size = np.maximum(np.repeat(n, rows), 1)
    index = (k // size) * total + np.repeat(starts, rows) + k % size  # level-major within each image
    flat = deepstack.reshape(levels * total, hidden).index_select(0, upload(torch.from_numpy(index), embeds.device))
    parts = embeds.split(list(sizes))
    if len(set(sizes)) == 1:  # a batch of one size (the usual ingestion batch): one view, unbound
        return list(zip(parts, flat.view(len(sizes), levels, sizes[0], hidden).unbind(0), strict=True))
    blocks = flat.split(rows.tolist())
    return [(part, block.view(levels, count, hidden)) for part, block, count in zip(parts, blocks, sizes, strict=True)]


BULK_IMAGE_PATCHES = 1024  # 512 x 512 px: the host-bound regime where bulk graphs pay (see the module docstring)


class GraphedTower:
    """Runs tower passes of at most ``max_images`` images and ``max_patches`` patches as CUDA-graph replays,
    one graph per tuple of grids. The caller holds the tower's lock and sets its attention implementation
    (the grouped one, whose FlashAttention call takes ``cu_seqlens`` from the device)."""

    def __init__(self, visual: Any, device: torch.device, *, max_images: int = MAX_IMAGES,
                 max_patches: int = MAX_PATCHES, max_graphs: int = MAX_GRAPHS, after: int = 1,
                 max_image_patches: int | None = None, check_finite: bool = False, one_length: bool = False) -> None:
        """``after``: a grid tuple is graphed from its ``after``-th pass on (1: at once); ``max_image_patches``:
        passes with a larger image run eagerly; ``check_finite``: see :class:`GraphCache`; ``one_length``: so do
        passes whose images differ in length (the bulk graphs: see the module docstring)."""
        self.visual, self.device, self.one_length = visual, device, one_length
        self.max_images, self.max_patches, self.after = max_images, max_patches, after
        self.max_image_patches = max_image_patches
        self.graphs = GraphCache(device, max_graphs=max_graphs, check_finite=check_finite)
        # Static inputs per grid tuple (pixels buffer + precomputed inputs); a graph captured with this very
        # dict replays with no further copy. Same bound as the graphs.
        self._inputs: OrderedDict[Grids, dict[str, torch.Tensor]] = OrderedDict()
        self._done: Any = None  # event after the last output copy: the next replay waits for it

    @property
    def counters(self) -> dict[str, int]:
        return self.graphs.counters

    def fits(self, grids: Sequence[Grid]) -> bool:
        sizes = [t * h * w for t, h, w in grids]
        return (len(grids) <= self.max_images and sum(sizes) <= self.max_patches
                and (self.max_image_patches is None or max(sizes) <= self.max_image_patches)
                and (not self.one_length or len(set(sizes)) == 1))

    def wants(self, grids: Sequence[Grid]) -> bool:
        """Whether :meth:`run` should take this pass: it fits, and its grid tuple has come ``after`` times
        (a sighting is counted here)."""
        return self.fits(grids) and self.graphs.ready(tuple(grids), self.after)

    def static_inputs(self, grids: Sequence[Grid], dim: int) -> dict[str, torch.Tensor]:
        key = tuple(grids)
        found = self._inputs.get(key)
        if found is None:
            patches = sum(t * h * w for t, h, w in grids)
            found = {"pixels": torch.empty((patches, dim), dtype=self.visual.dtype, device=self.device),
                     **tower_inputs(self.visual, grids, self.device)}
            self._inputs[key] = found
            while len(self._inputs) > self.graphs.max_graphs:
                self._inputs.popitem(last=False)
        self._inputs.move_to_end(key)
        return found

    @torch.inference_mode()
    def run(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(embeds, deepstack) per image, as the eager pass splits them; fresh tensors on the device."""
        stream = torch.cuda.current_stream(self.device)
        if self._done is not None:  # a caller on another stream may still be copying the last output
            stream.wait_event(self._done)
        inputs = self.static_inputs(grids, int(pixels.shape[1]))
        inputs["pixels"].copy_(pixels, non_blocking=True)
        max_seqlen = longest(grids)
        visual = self.visual
        out = self.graphs.run(tuple(grids), inputs, lambda t: tower_pass(visual, t, max_seqlen))
        parts = split_output(out, grids, int(visual.spatial_merge_size) ** 2)
        self._done = torch.cuda.Event()
        self._done.record(stream)
        return parts
