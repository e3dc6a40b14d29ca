"""CUDA-graph replays of small vision-tower passes (``LocalConfig.cuda_graphs``).

A search encodes one candidate image: a 1,024-patch tower pass keeps a fast GPU busy for a few milliseconds, but
launching its kernels from the transformers tower (24 blocks, dozens of kernels each) takes many times that in
Python. Such passes are captured once per tuple of image grids as a CUDA graph and replayed,
as ``graphed_lm`` does for LM passes (its :class:`GraphCache`: LRU, shared memory pool, eager fallback).

A tower pass is fully determined by the grids and the pixels. Everything the tower derives from the grids
with data-dependent steps, which a graph cannot hold, the eager pass already takes made on the host
(:mod:`retrieval.qwen.engine.tower`); here those inputs are kept on the device once per grid tuple, and the
grouped attention (``tower_attention``) uses the device ``cu_seqlens`` it is handed and the host-side runs for
everything else. The captured pass then launches only kernels on device tensors.

Small passes are graphed (:data:`MAX_IMAGES`, :data:`MAX_PATCHES`): they are the host-bound ones. At 16,384
patches the GPU does 16 times the work of 1,024 (more for attention), well past the time the launches take
(docs/performance.md, "Measurements behind the code"), so a graph
would save little while each one holds its static input and output. 16,384 covers one image of any size the default
``max_pixels`` allows (7,200 patches) and up to 8 concurrent searches' candidates merged by the tower batcher
(under load they queue there); more images make tuples of grids that rarely come back (a graph per tuple would
seldom be replayed). Ingestion batches run eagerly unless ``LocalConfig.bulk_graphs`` is on: then a second
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

import torch

from rubricsearch.retrieval.plugins.accelerated.graphed_lm import GraphCache
from rubricsearch.retrieval.qwen.engine.tower import longest, per_image, tower_forward, tower_inputs

Grid = tuple[int, int, int]
Grids = tuple[Grid, ...]
MAX_IMAGES = 8
MAX_PATCHES = 16384
MAX_GRAPHS = 16


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
